"""An `Engine` without a model, whose outputs can be worked out by hand.

Next token = (last token + 1) % vocab_size, always with log-prob `logprob`. So a request
with prompt [..., 7] and `max_new_tokens=3` yields tokens [8, 9, 10]. Everything else is
the real engine's host code: the same `KVPool` (pages, prefix cache, pinning, token
accounting), slots, stop tokens, max new tokens, `OutOfPages`, metrics. Schedulers and the
controller are tested against it with no compilation; the device steps are numpy
re-statements of `serving.steps` with the same packed `ResultTokens` layout.
"""

from __future__ import annotations

import numpy as np
from tidejax.serving import steps
from tidejax.serving.config import EngineConfig
from tidejax.serving.engine import Engine
from tidejax.serving.steps import DecodeState, ResultTokens, SlotRow


class MockEngine(Engine):
    """Same interface as `Engine`; `params` are ignored (pass None)."""

    def __init__(self, engine_config: EngineConfig | None = None, vocab_size: int = 512,
                 logprob: float = -0.5):
        self.config = None
        self.engine_config = ec = engine_config or EngineConfig()
        self.vocab_size = vocab_size
        self.logprob = np.float32(logprob)
        self._mesh = None
        self._init_host(ec)
        self._kv = None
        self.params = None
        self._prefill, self._generate = self._mock_prefill, self._mock_generate
        self._insert, self._free = self._mock_insert, self._mock_free
        self._packed_prefill = self._mock_packed_prefill

    def load_params(self, params):
        return params

    def init_decode_state(self) -> DecodeState:
        ec = self.engine_config
        state = steps.init_decode_state(ec.max_slots, ec.max_pages_per_seq, ec.max_stop_tokens,
                                        self.pool.trash_page)
        self._last_state = _to_numpy(state)
        return self._last_state

    def compile_counts(self) -> dict[str, int]:
        return {"prefill": 0, "generate": 0, "insert": 0, "free": 0, "packed_prefill": 0}

    # The five "device" steps, in numpy.
    def _row(self, token, done, position, generated, valid=1) -> np.ndarray:
        return np.array([token, self.logprob.view(np.int32), valid, done, position, generated],
                        np.int32)

    def _mock_prefill(self, mode, params, kv, tokens_T, num_new, cached_len, page_row_P, write, seed,
                      temperature, top_k, top_p, max_new, stop_S):
        token = (int(tokens_T[int(num_new) - 1]) + 1) % self.vocab_size
        position = int(cached_len) + int(num_new)
        done = token in set(stop_S.tolist()) or max_new <= 1 or \
            position >= self.engine_config.max_seq_len
        return kv, ResultTokens(self._row(token, int(done), position, 1)[None])

    def _mock_packed_prefill(self, mode, params, kv, tokens_RC, segment_R, position_R,
                             num_real_R, cached_len_R, page_table_RP, write_R, sample_R, seed_R,
                             temperature_R, top_k_R, top_p_R, max_new_R, stop_RS):
        rows = []
        for r in range(len(segment_R)):
            real = max(int(num_real_R[r]), 1)
            token = (int(tokens_RC[r, real - 1]) + 1) % self.vocab_size
            position = int(position_R[r]) + int(num_real_R[r])
            done = token in set(stop_RS[r].tolist()) or max_new_R[r] <= 1 or \
                position >= self.engine_config.max_seq_len
            rows.append(self._row(token, int(done), position, 1, int(sample_R[r])))
        return kv, ResultTokens(np.stack(rows))

    def _mock_insert(self, state: DecodeState, slot, first: ResultTokens, row: SlotRow
                     ) -> DecodeState:
        state = _copy(state)
        slot = int(slot)
        data = np.asarray(first.data)[0]
        state.tokens_B[slot] = data[steps.TOKEN]
        state.lengths_B[slot] = row.length
        state.page_table_BP[slot] = row.page_row_P
        state.active_B[slot] = data[steps.DONE] == 0
        state.generated_B[slot] = data[steps.GENERATED]
        state.max_new_B[slot] = row.max_new
        state.stop_BS[slot] = row.stop_S
        return state

    def _mock_free(self, state: DecodeState, slot) -> DecodeState:
        state = _copy(state)
        state.active_B[int(slot)] = False
        return state

    def _mock_generate(self, num_steps, span_pages, mode, params, kv, state: DecodeState,
                       page_table_BP):
        state = _copy(state).replace(page_table_BP=np.array(page_table_BP, copy=True))
        steps_data = []
        for _ in range(num_steps):
            active = state.active_B.copy()
            token = (state.tokens_B + 1) % self.vocab_size
            new_len = state.lengths_B + active
            generated = state.generated_B + active
            is_stop = (token[:, None] == state.stop_BS).any(axis=1)
            done = active & (is_stop | (generated >= state.max_new_B)
                             | (new_len >= self.engine_config.max_seq_len))
            steps_data.append(np.stack([self._row(t, d, p, g, v) for t, d, p, g, v in
                                        zip(token, done, new_len, generated, active)]))
            state = state.replace(
                tokens_B=np.where(active, token, state.tokens_B).astype(np.int32),
                lengths_B=new_len.astype(np.int32), active_B=active & ~done,
                generated_B=generated.astype(np.int32),
                decode_tokens=np.int32(state.decode_tokens + active.sum()))
        return kv, state, ResultTokens(np.stack(steps_data))


def _to_numpy(state: DecodeState) -> DecodeState:
    return DecodeState(**{f: np.array(getattr(state, f)) for f in _FIELDS})


def _copy(state: DecodeState) -> DecodeState:
    return DecodeState(**{f: np.array(getattr(state, f), copy=True) for f in _FIELDS})


_FIELDS = tuple(f.name for f in DecodeState.__dataclass_fields__.values())

"""Optional adapter: a tidejax `Engine` behind JetStream's `engine_api.Engine`, so that
JetStream's orchestrator (`pip install -e ".[jetstream]"`, i.e. google-jetstream 0.2.2)
can serve tidejax models.

Threads: JetStream's `Driver` calls `prefill` from its prefill thread and `insert` /
`generate` from its generate thread. One tidejax engine owns one KV page pool that both
write, so every call takes the adapter's lock, and only interleaved mode is supported
(`Driver(..., interleaved_mode=True)` with this adapter as both prefill and generate
engine): a `Prefix` names pages in this engine's pool and cannot move to another.

Semantics of JetStream 0.2.2 kept as they are: its orchestrator streams tokens from
`generate` only (the prefill's first token is fed to decoding, not streamed), finishes a
request when the reported length exceeds `max_tokens` or a token is a tokenizer stop
token, and never frees slots (a finished slot keeps decoding until `insert` reuses it).
So the adapter reports lengths as tokens streamed so far, releases a slot's pages when
the slot is reused, and needs a pool that holds every slot at full length.

JetStream 0.2.2 calls `jax.tree_map`, which jax >= 0.6 removed; importing this module
restores that one alias if it is missing.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np
from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2
from tidejax.serving.engine import Engine, Prefix
from tidejax.serving.steps import GENERATED, TOKEN, VALID

if not hasattr(jax, "tree_map"):  # JetStream 0.2.2's orchestrator still calls it
    jax.tree_map = jax.tree.map

_JETSTREAM_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class TokenIdTokenizer(tokenizer_api.Tokenizer):
    """Token ids in and out (clients tokenize); `decode` joins ids for the text field."""

    def __init__(self, pad_id: int = 0, eos_id: int = 1, bos_id: int = 2):
        self._pad, self._eos, self._bos = pad_id, eos_id, bos_id

    def encode(self, s: str, **kwargs) -> tuple[np.ndarray, int]:
        raise NotImplementedError("send token_content: tidejax engines take token ids")

    def decode(self, token_ids: list[int], **kwargs) -> str:
        return " ".join(str(t) for t in token_ids)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def bos_id(self) -> int:
        return self._bos


class JetStreamEngine(engine_api.Engine):
    """`engine_api.Engine` over a tidejax `Engine`; see the module docstring."""

    def __init__(self, engine: Engine, tokenizer: tokenizer_api.Tokenizer | None = None):
        ec = engine.engine_config
        if ec.num_pages < ec.max_slots * ec.max_pages_per_seq:
            raise ValueError("JetStreamEngine: num_pages must hold max_slots * max_pages_per_seq "
                             "pages (JetStream never frees a finished slot)")
        self.engine = engine
        self.tokenizer = tokenizer or TokenIdTokenizer()
        self._lock = threading.Lock()
        self._to_jetstream = jax.jit(_to_jetstream_data)

    # -- accelerator calls
    def prefill(self, *, params: Any, existing_prefix: Any = None, padded_tokens: Any,
                true_length: int) -> Prefix:
        if existing_prefix is not None:
            raise NotImplementedError("prefix reuse is automatic (the engine's prefix cache)")
        tokens = np.asarray(padded_tokens)[:true_length].tolist()
        with self._lock:
            return self.engine.prefill(params, tokens)

    def insert(self, prefix: Prefix, decode_state: Any, slot: int) -> Any:
        with self._lock:
            if self.engine.slot_task(slot) is not None:
                decode_state = self.engine.free_slot(decode_state, slot, keep=False)
            return self.engine.insert(prefix, decode_state, slot)

    def generate(self, params: Any, decode_state: Any) -> tuple[Any, engine_api.ResultTokens]:
        with self._lock:
            # JetStream's orchestrator reads one token per slot per generate.
            decode_state, result = self.engine.generate(params, decode_state, num_steps=1)
        return decode_state, engine_api.ResultTokens(
            data=self._to_jetstream(result.data[0]), tokens_idx=(0, 1), valid_idx=(1, 2),
            length_idx=(2, 3), samples_per_slot=1)

    def init_decode_state(self, *args, **kwargs) -> Any:
        with self._lock:
            return self.engine.init_decode_state()

    def load_params(self, *args, **kwargs) -> Any:
        params = kwargs.get("params", args[0] if args else None)
        return self.engine.params if params is None else self.engine.load_params(params)

    # -- description
    def get_prefix_destination_sharding(self) -> Any:
        return None  # interleaved mode only: prefixes never move

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path="tidejax-token-ids")

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters
                        ) -> tokenizer_api.Tokenizer:
        return self.tokenizer

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.engine_config.max_slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        # JetStream pads prompts to one of its own buckets, capped at this value.
        fits = [b for b in _JETSTREAM_BUCKETS if b < self.engine.engine_config.max_seq_len]
        return fits[-1]

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.engine.mesh

    @property
    def colocated_cpus(self) -> None:
        return None


def _to_jetstream_data(data_B6: jax.Array) -> jax.Array:
    """tidejax's packed columns -> JetStream's [token, valid, length]; length counts the
    tokens streamed so far (JetStream does not stream the prefill's first token)."""
    return jax.numpy.stack([data_B6[:, TOKEN], data_B6[:, VALID], data_B6[:, GENERATED] - 1],
                           axis=1)

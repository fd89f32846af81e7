"""Engine and sampling configuration: frozen, validated in `__post_init__`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tidejax.serving.paged_attention import KERNELS


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples. `temperature == 0` is greedy (top-k/top-p ignored).

    `top_k == 0` and `top_p == 1.0` disable those filters. `seed` makes the request's PRNG
    stream explicit: the token at position t uses `fold_in(key(seed), t)`, so results do
    not depend on which slot or batch the request lands in.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0
                and math.isfinite(self.temperature)):
            raise ValueError(f"SamplingParams.temperature must be a finite float >= 0, "
                             f"got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"SamplingParams.max_new_tokens must be a positive int, "
                             f"got {self.max_new_tokens!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be >= 0, "
                             f"got {self.stop_token_ids!r}")
        if not isinstance(self.seed, int):
            raise TypeError(f"SamplingParams.seed must be an int, got {self.seed!r}")

    @classmethod
    def greedy(cls, **changes: Any) -> SamplingParams:
        return cls(temperature=0.0, **changes)

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Shapes of one rollout rank's engine. Fixed so nothing recompiles in steady state.

    `num_pages` pages of `page_size` tokens form the rank's KV pool; a sequence holds at
    most `max_pages_per_seq` pages, so `max_seq_len = page_size * max_pages_per_seq`.
    Prompts are padded up to the smallest of `prefill_buckets` that fits the tokens left
    after the prefix-cache hit. `max_stop_tokens` bounds the per-slot stop-id table.
    `attention` names the paged-attention kernel (see `serving.paged_attention.KERNELS`):
    "gather" (plain JAX) or "pallas" (decode through `serving.pallas_attention`;
    interpreted, so slow, off GPUs).
    """

    page_size: int = 16
    num_pages: int = 256
    max_slots: int = 8
    max_pages_per_seq: int = 32
    prefill_buckets: tuple[int, ...] = (32, 64, 128, 256)
    max_stop_tokens: int = 4
    sampling: SamplingParams = SamplingParams()
    attention: str = "gather"
    # What decode attention reads: "full" gathers every row's max_pages_per_seq pages (the
    # numerics of the engine before issue 16, bit for bit, so a seed gives the same tokens);
    # "live" reads the smallest power-of-two span of pages holding the longest live row
    # (less memory traffic; logits move by float rounding, ~1e-6 relative, so a sampled
    # token can in rare near-ties differ from "full").
    attention_span: str = "full"
    # Prefill several admitted requests' new tokens packed in calls of up to the largest
    # bucket, as rows of `prefill_row_tokens` (a request fills consecutive rows and pads
    # only its last; it splits across calls where one fills). False: one request per call,
    # padded to its bucket (the engine before issue 16; the attention reductions differ,
    # so logits differ by float rounding and a token can differ in a rare near-tie).
    prefill_packing: bool = True
    # Smaller rows pad less (half a row per request on average); each row gathers its
    # request's cached pages, so a call's gather grows with its rows. Divides every bucket.
    prefill_row_tokens: int = 16
    # Tokens per slot one generate dispatch decodes (an on-device loop). Higher hides more
    # host time; a slot that stops early idles for the rest of the call, and the env sees
    # a finished turn up to this many steps (plus one call, results being read a call
    # late) after its last token.
    decode_steps_per_call: int = 8
    # The request-level loop admits a request only if this many free-or-evictable pages
    # would remain for decode growth after its prefill (vLLM's watermark).
    admission_watermark_pages: int = 1
    # New prompt tokens the request-level loop prefills between two generate dispatches
    # (a step admits requests until their new tokens reach it; at least one request): 64
    # slots filling at once would otherwise stall every running slot's decode for all of
    # their prefills (vLLM's max_num_batched_tokens plays this part).
    prefill_tokens_per_step: int = 4096

    def __post_init__(self):
        for name in ("page_size", "num_pages", "max_slots", "max_pages_per_seq",
                     "max_stop_tokens", "decode_steps_per_call", "prefill_row_tokens",
                     "prefill_tokens_per_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.admission_watermark_pages, int) or self.admission_watermark_pages < 0:
            raise ValueError(f"EngineConfig.admission_watermark_pages must be an int >= 0, "
                             f"got {self.admission_watermark_pages!r}")
        buckets = tuple(self.prefill_buckets)
        if not buckets or any(not isinstance(b, int) or b <= 0 for b in buckets):
            raise ValueError(f"EngineConfig.prefill_buckets must be positive ints, got {buckets!r}")
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"EngineConfig.prefill_buckets must be strictly increasing, "
                             f"got {buckets!r}")
        if buckets[-1] > self.max_seq_len:
            raise ValueError(f"EngineConfig.prefill_buckets: largest bucket {buckets[-1]} "
                             f"exceeds max_seq_len {self.max_seq_len}")
        object.__setattr__(self, "prefill_buckets", buckets)
        if self.prefill_packing and any(b % self.prefill_row_tokens for b in buckets):
            raise ValueError(f"EngineConfig.prefill_row_tokens ({self.prefill_row_tokens}) "
                             f"must divide every prefill bucket {buckets} when "
                             f"prefill_packing is on")
        if self.max_pages_per_seq > self.num_pages:
            raise ValueError(f"EngineConfig.max_pages_per_seq ({self.max_pages_per_seq}) "
                             f"must be <= num_pages ({self.num_pages})")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"EngineConfig.sampling must be SamplingParams, "
                             f"got {type(self.sampling).__name__}")
        if len(self.sampling.stop_token_ids) > self.max_stop_tokens:
            raise ValueError("EngineConfig.sampling has more stop_token_ids than max_stop_tokens")
        if self.attention_span not in ("full", "live"):
            raise ValueError(f"EngineConfig.attention_span must be 'full' or 'live', "
                             f"got {self.attention_span!r}")
        if self.attention not in KERNELS:
            raise ValueError(f"EngineConfig.attention must be one of {sorted(KERNELS)}, "
                             f"got {self.attention!r}")

    @property
    def max_seq_len(self) -> int:
        return self.page_size * self.max_pages_per_seq

    @property
    def capacity_tokens(self) -> int:
        return self.page_size * self.num_pages

    def bucket_for(self, length: int) -> int:
        """Smallest prefill bucket holding `length` tokens."""
        for bucket in self.prefill_buckets:
            if length <= bucket:
                return bucket
        raise ValueError(f"{length} new prompt tokens exceed the largest prefill bucket "
                         f"{self.prefill_buckets[-1]}")

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

"""Env latency sampling: per-call delays drawn from each env type's `LatencySpec`.

Samples are drawn from a Generator seeded by (model seed, task id, call number), so a
task's latencies do not depend on how the pool interleaves tasks.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Mapping

import numpy as np

from tidejax.envs.latency_spec import LatencySpec
from tidejax.envs.registry import env_types, get_spec


@dataclasses.dataclass(frozen=True)
class LatencyModel:
    """Samples per-call env latency; `time_scale` shrinks (or stretches) every draw.

    time_scale=0 turns latency off; tests use ~1e-3 so a 0.2 s median becomes 0.2 ms.
    """

    specs: Mapping[str, LatencySpec]
    time_scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.time_scale >= 0.0:
            raise ValueError(f"time_scale must be >= 0, got {self.time_scale}")
        object.__setattr__(self, "specs", dict(self.specs))

    @classmethod
    def default(cls, time_scale: float = 1.0, seed: int = 0) -> LatencyModel:
        """A model over the latency specs of every registered env type."""
        return cls({t: get_spec(t).latency for t in env_types()}, time_scale, seed)

    def sample(self, env_type: str, kind: str, task_id: str, call: int, reset: bool) -> float:
        """Latency in seconds for call number `call` (0 = the first reset) of one task."""
        spec = self.specs.get(env_type)
        if spec is None or self.time_scale == 0.0 or spec.median_s == 0.0:
            return 0.0
        rng = np.random.default_rng([self.seed, zlib.crc32(task_id.encode()), call])
        z = rng.standard_normal()
        value = spec.median_s * math.exp(spec.sigma(kind) * z)
        value = min(value, spec.p99(kind) * spec.max_over_p99)
        if reset:
            value *= spec.reset_factor
        return value * self.time_scale

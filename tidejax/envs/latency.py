"""Env latency: a lognormal per env type, fitted to a median and a p99.

A lognormal with median m and 99th percentile q has mu = ln m and
sigma = ln(q / m) / z99 (z99 = 2.3263, the standard normal's 99th percentile). Some task
kinds get a heavier tail (a larger p99 at the same median) so that long-tail
trajectories exist, as they do on real WebShop/ALFWorld clusters.

Samples are drawn from a Generator seeded by (model seed, task id, call number), so a
task's latencies do not depend on how the pool interleaves tasks.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Mapping

import numpy as np

Z99 = 2.3263478740408408  # standard normal quantile at 0.99


@dataclasses.dataclass(frozen=True)
class LatencySpec:
    """Per-call latency of one env type, in seconds before `time_scale`.

    `tail_p99_scale` maps a task kind to a factor on p99 (same median, heavier tail);
    kinds not listed use the base p99. `max_over_p99` clips the rare huge draw.
    """

    median_s: float
    p99_s: float
    tail_p99_scale: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: {"long_tail": 5.0}
    )
    reset_factor: float = 1.0  # reset (page load, scene build) relative to a step
    max_over_p99: float = 20.0

    def __post_init__(self) -> None:
        if not self.median_s >= 0.0:
            raise ValueError(f"median_s must be >= 0, got {self.median_s}")
        if not self.p99_s >= self.median_s:
            raise ValueError(f"p99_s must be >= median_s, got {self.p99_s} < {self.median_s}")
        for kind, scale in self.tail_p99_scale.items():
            if not scale >= 1.0:
                raise ValueError(f"tail_p99_scale[{kind!r}] must be >= 1, got {scale}")
        if not self.reset_factor >= 0.0:
            raise ValueError(f"reset_factor must be >= 0, got {self.reset_factor}")
        if not self.max_over_p99 >= 1.0:
            raise ValueError(f"max_over_p99 must be >= 1, got {self.max_over_p99}")
        object.__setattr__(self, "tail_p99_scale", dict(self.tail_p99_scale))

    def sigma(self, kind: str = "normal") -> float:
        if self.median_s == 0.0:
            return 0.0
        p99 = self.p99_s * self.tail_p99_scale.get(kind, 1.0)
        return math.log(p99 / self.median_s) / Z99

    def p99(self, kind: str = "normal") -> float:
        return self.p99_s * self.tail_p99_scale.get(kind, 1.0)


# Sources: calibration.md rows env.webshop.step (lognormal, median 0.1-0.3 s, p99 1-3 s)
# and env.alfworld.step (0.067-0.10 s single process; its p99 is not published, so the
# household tail below is an assumption: 4x the median).
WEBSHOP_LATENCY = LatencySpec(median_s=0.2, p99_s=2.0)
HOUSEHOLD_LATENCY = LatencySpec(median_s=0.08, p99_s=0.32)


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
        from tidejax.envs.registry import env_types, get_spec

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

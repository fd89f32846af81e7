"""Env latency specs: a lognormal per env type, fitted to a median and a p99.

A lognormal with median m and 99th percentile q has mu = ln m and
sigma = ln(q / m) / z99 (z99 = 2.3263, the standard normal's 99th percentile). Some task
kinds get a heavier tail (a larger p99 at the same median) so that long-tail
trajectories exist, as they do on real WebShop/ALFWorld clusters.

Plain data: each env type registers its spec (`registry.EnvSpec.latency`), and
`latency.LatencyModel` samples from the registered specs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

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

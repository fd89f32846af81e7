"""GPU-time accounting: where every GPU-second goes, per-GPU roles and utilisation over time.

Busy kinds: rollout ``decode`` / ``prefill`` (new tokens) / ``recompute`` (tokens computed
before and lost from the cache); trainer ``ref`` / ``actor`` / ``swap``; both ``sync`` and
``switch`` (role changes, resharding). Whatever a GPU's role time is not busy with is idle;
rollout idle while the staleness quota throttles admission is RWT, trainer idle is TWT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

USEFUL = ("decode", "prefill", "ref", "actor")
OVERHEAD = ("recompute", "swap", "sync", "switch")
ROLES = ("rollout", "actor", "ref", "colocated", "idle")


class Ledger:
    """Accumulates busy intervals and role changes for ``n_gpus`` GPUs."""

    def __init__(self, n_gpus: int, bin_s: float) -> None:
        if n_gpus <= 0 or bin_s <= 0:
            raise ValueError("Ledger needs n_gpus > 0 and bin_s > 0")
        self.n_gpus = n_gpus
        self.bin_s = bin_s
        self.totals: dict[str, float] = {}
        self.useful_bins: list[list[float]] = [[] for _ in range(n_gpus)]
        self.roles: list[list[tuple[float, str]]] = [[(0.0, "idle")] for _ in range(n_gpus)]

    def add(self, gpus: Sequence[int], t0: float, t1: float, kind: str) -> None:
        dur = t1 - t0
        if dur <= 0:
            return
        self.totals[kind] = self.totals.get(kind, 0.0) + dur * len(gpus)
        if kind in USEFUL:
            self.bin_useful(gpus, t0, t1)

    def add_total(self, kind: str, gpu_s: float) -> None:
        """GPU-seconds of ``kind`` whose timeline bins were (or need not be) filled."""
        self.totals[kind] = self.totals.get(kind, 0.0) + gpu_s

    def bin_useful(self, gpus: Sequence[int], t0: float, t1: float) -> None:
        """Spread useful-busy time over the timeline bins of ``gpus``."""
        dur = t1 - t0
        if dur <= 0:
            return
        w = self.bin_s
        b0, b1 = int(t0 / w), int(t1 / w)
        for g in gpus:
            row = self.useful_bins[g]
            if len(row) <= b1:
                row.extend([0.0] * (b1 + 1 - len(row)))
            if b0 == b1:
                row[b0] += dur
                continue
            row[b0] += (b0 + 1) * w - t0
            for b in range(b0 + 1, b1):
                row[b] += w
            row[b1] += t1 - b1 * w

    def set_role(self, gpus: Sequence[int], t: float, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        for g in gpus:
            self.roles[g].append((t, role))

    def role_seconds(self, t_end: float) -> dict[str, float]:
        out = dict.fromkeys(ROLES, 0.0)
        for changes in self.roles:
            for (t, role), (t_next, _) in zip(changes, changes[1:] + [(t_end, "")]):
                out[role] += max(0.0, min(t_next, t_end) - min(t, t_end))
        return out

    def timeline(self, t_end: float) -> tuple[list[list[str]], list[list[float]]]:
        """Per GPU, per bin: the role at the bin's middle and the useful-busy fraction."""
        n_bins = max(1, int(t_end / self.bin_s) + 1)
        roles, util = [], []
        for g in range(self.n_gpus):
            row, changes, j = [], self.roles[g], 0
            for b in range(n_bins):
                mid = (b + 0.5) * self.bin_s
                while j + 1 < len(changes) and changes[j + 1][0] <= mid:
                    j += 1
                row.append(changes[j][1])
            roles.append(row)
            busy = self.useful_bins[g] + [0.0] * max(0, n_bins - len(self.useful_bins[g]))
            util.append([min(1.0, x / self.bin_s) for x in busy[:n_bins]])
        return roles, util


def overlap(
    intervals: Sequence[tuple[float, float]], windows: Sequence[tuple[float, float]]
) -> float:
    """Total length of ``intervals`` inside ``windows`` (both lists sorted or not)."""
    if not intervals or not windows:
        return 0.0
    wins = sorted(windows)
    total = 0.0
    for a, b in sorted(intervals):
        for c, d in wins:
            if c >= b:
                break
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                total += hi - lo
    return total


@dataclass
class RunResult:
    """What one simulated run reports (times in seconds, GPU-time in GPU-seconds)."""

    system: str
    workload: str
    steps: int
    wall_s: float
    consumed_tokens: int  # trained tokens (prompt + observations + generated) consumed
    consumed_response_tokens: int  # generated tokens consumed: what goodput counts
    dropped_tokens: int  # generated tokens of groups dropped as stale
    goodput: float  # generated tokens consumed by the trainer / s (the runtime's GoodputMeter)
    rwt_gpu_s: float
    twt_gpu_s: float
    kv_hit_rate: float
    mean_staleness: float
    max_staleness: int
    breakdown: dict[str, float]  # GPU-seconds per kind, plus idle per role
    roles: dict[str, float]  # GPU-seconds per role
    extra: dict = field(default_factory=dict)
    timeline: tuple | None = None  # (roles, utilisation) per GPU per bin, for plots
    bin_s: float = 0.0
    dropped_groups: int = 0  # training groups dropped by the staleness bound

    @property
    def trained_tok_s(self) -> float:
        """Trained tokens (prompt + observations + generated) consumed per second."""
        return self.consumed_tokens / self.wall_s if self.wall_s else 0.0

    def summary(self) -> dict:
        return {
            "system": self.system,
            "workload": self.workload,
            "steps": self.steps,
            "wall_s": round(self.wall_s, 2),
            "goodput_tok_s": round(self.goodput, 1),
            "trained_tok_s": round(self.trained_tok_s, 1),
            "consumed_tokens": self.consumed_tokens,
            "consumed_response_tokens": self.consumed_response_tokens,
            "dropped_tokens": self.dropped_tokens,
            "dropped_groups": self.dropped_groups,
            "rwt_gpu_h": round(self.rwt_gpu_s / 3600, 3),
            "twt_gpu_h": round(self.twt_gpu_s / 3600, 3),
            "kv_hit_rate": round(self.kv_hit_rate, 4),
            "mean_staleness": round(self.mean_staleness, 3),
            "max_staleness": self.max_staleness,
            "breakdown_gpu_h": {k: round(v / 3600, 3) for k, v in sorted(self.breakdown.items())},
            **self.extra,
        }

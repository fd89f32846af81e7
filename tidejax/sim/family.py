"""A workload family: seeded variations of the presets, for robustness comparisons.

:func:`sample` draws ``n`` members from one seed. Each member is a
:class:`~tidejax.sim.workload.WorkloadSpec` and a GPU count. Around the preset task types
(WebShop, ALFWorld, OSWorld-like GUI) it varies, independently and log-uniformly unless said:

* turns: ``max_turns`` and the successful-turns median x [0.5, 1.5];
* generation length: the per-turn response median and p99 x [1/3, 3] (the 512-token cap of
  calibration ``env.tokens_per_turn.response_cap`` stays);
* observation length: median and p99 x [1/4, 4];
* environment latency: median and p99 x [1/4, 4]; the straggler tail's p99 one of
  none, 4, 8, 16 (calibration ``workload.tail.p99_over_median`` up to 10, 25-32 longest);
* group size: 4, 8 or 16;
* GPUs: 8, 16, 32, 64 or 128 (model 7B or 14B; 14B only from 16 GPUs, where its train
  state fits with room for rollout);
* non-stationarity, one of: none; response growth (x2-x4 over the run); evaluation phases
  twice as often and twice as large; a change of task mix halfway (new tasks of the same
  suite, their lengths and latencies drawn afresh as above, take 90% of the groups; a text
  batch of GUI tasks would be a different job, not a drift).

The batch, ``B_min``, evaluation size and environment capacity scale with the GPU count
from the preset the member derives from (per-GPU trajectories per update, env sessions per
GPU), so a member is a preset's cluster grown or shrunk, not a different operating point.
These ranges describe the family; no policy reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from tidejax.sim import workload as wl
from tidejax.sim.workload import Dist, TaskType, WorkloadSpec

GPU_COUNTS = (8, 16, 32, 64, 128)
GROUP_SIZES = (4, 8, 16)
STRAGGLER_P99 = (1.0, 4.0, 8.0, 16.0)  # 1: no straggler tail
DRIFTS = ("none", "growth", "eval", "mix")
PRESET_GPUS = 32  # the presets describe TideRL's 32-GPU testbed


@dataclass(frozen=True, slots=True)
class Member:
    spec: WorkloadSpec
    n_gpus: int
    drift: str  # one of DRIFTS

    @property
    def stationary(self) -> bool:
        return self.drift == "none"


def _scale(d: Dist, f: float) -> Dist:
    """``d`` with median and p99 times ``f``, inside its clip range."""
    med = min(d.hi, max(d.lo, d.median * f))
    return replace(d, median=med, p99=max(med, min(d.hi, d.p99 * f)))


def _vary(t: TaskType, rng: np.random.Generator, straggler: float) -> TaskType:
    def logu(lo: float, hi: float) -> float:
        return float(np.exp(rng.uniform(np.log(lo), np.log(hi))))

    turns = logu(0.5, 1.5)
    max_turns = max(2, round(t.max_turns * turns))
    succ = _scale(t.success_turns, turns)
    succ = replace(succ, hi=max_turns, lo=min(succ.lo, max_turns))
    succ = replace(succ, median=min(succ.median, max_turns), p99=min(succ.p99, max_turns))
    succ = replace(succ, p99=max(succ.p99, succ.median))
    return replace(
        t,
        max_turns=max_turns,
        success_turns=succ,
        response_tokens=_scale(t.response_tokens, logu(1 / 3, 3)),
        obs_tokens=_scale(t.obs_tokens, logu(1 / 4, 4)),
        env_s=_scale(t.env_s, logu(1 / 4, 4)),
        env_straggler=None if straggler == 1.0 else Dist(1.0, straggler, 1.0, 4 * straggler),
    )


def member(
    seed: int, index: int, steps: int, gpu_counts: tuple[int, ...] = GPU_COUNTS
) -> Member:
    """Member ``index`` of the family drawn with ``seed`` for runs of ``steps`` updates, its
    GPU count drawn from ``gpu_counts``."""
    rng = np.random.default_rng([seed, index])
    drift = DRIFTS[index % len(DRIFTS)]  # every kind equally often in any sample
    gui_base = rng.random() < 1 / 3
    gpus = int(rng.choice(gpu_counts))
    model = "qwen2.5-14b" if (not gui_base and gpus >= 16 and rng.random() < 0.5) else "qwen2.5-7b"
    base = wl.osworld(model) if gui_base else wl.text(model)
    straggler = float(rng.choice(STRAGGLER_P99))
    types = tuple(_vary(t, rng, straggler) for t in base.types)
    group = int(rng.choice(GROUP_SIZES))
    per_gpu = base.batch_groups * base.group_size / PRESET_GPUS  # trajectories per update
    batch = max(2, round(per_gpu * gpus / group))
    grow = gpus / PRESET_GPUS
    size = model.rsplit("-", 1)[-1]
    fields = dict(
        name=f"m{index:02d}-{drift}-{'gui' if gui_base else 'text'}-{size}-{gpus}g",
        model=model,
        group_size=group,
        batch_groups=batch,
        b_min_groups=max(1, batch // 2),
        eval_tasks=max(1, round(base.eval_tasks * grow)),
        env_capacity=max(group, round(base.env_capacity * grow)),
        seed=seed * 1000 + index,
    )
    if drift == "growth":
        factor = float(rng.uniform(2.0, 4.0))  # responses x2-x4 by the end of the run
        fields["response_growth"] = (factor - 1) / steps
    elif drift == "eval":
        fields["eval_every"] = max(1, base.eval_every // 2)
        fields["eval_tasks"] = 2 * fields["eval_tasks"]
    elif drift == "mix":
        # new tasks of the same suite, their lengths and latencies drawn afresh, take 90%
        extra = tuple(replace(_vary(t, rng, straggler), weight=0.0) for t in base.types)
        types = types + extra
        after = [0.1 * t.weight for t in types[: len(base.types)]]
        after += [0.9 / len(extra)] * len(extra)
        fields["mix_shift_at"] = max(1, steps // 2)
        fields["mix_after"] = tuple(after)
    spec = replace(base, types=types, **fields)
    return Member(spec, gpus, drift)


def sample(
    n: int, seed: int = 0, steps: int = 100, gpu_counts: tuple[int, ...] = GPU_COUNTS
) -> list[Member]:
    """The first ``n`` members of the family drawn with ``seed``."""
    if n <= 0:
        raise ValueError("family.sample needs n > 0")
    if not gpu_counts or min(gpu_counts) < 2:
        raise ValueError("family.sample needs GPU counts >= 2")
    return [member(seed, i, steps, tuple(gpu_counts)) for i in range(n)]

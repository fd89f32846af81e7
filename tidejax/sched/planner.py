"""BiDiRL-style static planner: the initial rollout/trainer split from time-performance models.

BiDiRL's body text was not available; this follows the reconstruction in
``shared/calibration.md`` §6.4: enumerate hot-switch-compatible splits (``x`` rollout GPUs,
``G - x`` trainer GPUs, both whole rollout ranks, the trainer at least large enough to hold
the sharded train state) and pick ``argmin_x max(T_roll(x), T_train(G - x))`` using the
:mod:`tidejax.sched.perf` curves and a :class:`WorkloadProfile` of per-step means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tidejax.sched import perf
from tidejax.sched.perf import HardwareSpec, ModelSpec


@dataclass(frozen=True, slots=True)
class WorkloadProfile:
    """Per-trajectory means the planner needs (tokens, seconds)."""

    batch_groups: int  # groups per update
    group_size: int  # trajectories per group (GRPO G)
    mean_turns: float
    mean_prompt_tokens: float  # initial prompt
    mean_response_tokens: float  # per turn
    mean_obs_tokens: float  # per turn (observation appended before the next turn)
    mean_env_s: float  # environment latency per turn
    mean_sq_len: float  # mean of squared final trajectory lengths (attention cost)
    mean_train_tokens: float = 0.0  # tokens trained per trajectory (0: its final length)
    group_tail: float = 1.0  # mean (slowest trajectory of a group) / mean trajectory latency
    staleness_bound: int = 1  # in-flight work is up to (bound + 1) batches
    env_capacity: int = 1 << 30  # tasks the environments can run at once
    max_running: int = 256  # vLLM EngineArgs max_num_seqs default

    def __post_init__(self) -> None:
        for name in ("batch_groups", "group_size", "mean_turns", "max_running", "env_capacity"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WorkloadProfile.{name} must be positive")
        for name in (
            "mean_prompt_tokens",
            "mean_response_tokens",
            "mean_obs_tokens",
            "mean_env_s",
            "mean_sq_len",
            "staleness_bound",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"WorkloadProfile.{name} must be >= 0")

    @property
    def trajectories(self) -> int:
        return self.batch_groups * self.group_size

    @property
    def final_len(self) -> float:
        return self.mean_prompt_tokens + self.mean_turns * (
            self.mean_response_tokens + self.mean_obs_tokens
        )


@dataclass(frozen=True, slots=True)
class PlanChoice:
    rollout_gpus: int
    train_gpus: int
    t_rollout: float  # predicted seconds per step
    t_train: float
    candidates: tuple[tuple[int, float, float], ...]  # (rollout_gpus, t_rollout, t_train)


def rollout_time(
    model: ModelSpec, hw: HardwareSpec, wl: WorkloadProfile, gpus: int, tp: int = 1
) -> float:
    """Seconds to generate one batch on ``gpus`` rollout GPUs (throughput-bound estimate)."""
    ranks = gpus // tp
    if ranks <= 0:
        return math.inf
    curve = perf.DecodeCurve.of(model, hw, tp)
    ctx = wl.mean_prompt_tokens + wl.mean_turns * (wl.mean_response_tokens + wl.mean_obs_tokens) / 2
    in_flight = (wl.staleness_bound + 1) * wl.trajectories / ranks
    cap = perf.kv_capacity_tokens(model, hw, tp)
    batch, active = 1.0, 1.0
    for _ in range(8):  # fixed point: active share of a task's time vs env waits
        batch = max(1.0, min(wl.max_running, cap / max(ctx, 1.0), in_flight * active))
        t_iter = curve.iters_time(round(batch), round(batch) * ctx, 1)
        t_gen = wl.mean_response_tokens * t_iter
        active = t_gen / (t_gen + wl.mean_env_s) if t_gen + wl.mean_env_s > 0 else 1.0
    t_iter = curve.iters_time(round(batch), round(batch) * ctx, 1)
    decode = wl.trajectories * wl.mean_turns * wl.mean_response_tokens * t_iter / batch / ranks
    new_tokens = wl.mean_prompt_tokens + wl.mean_turns * wl.mean_obs_tokens
    prefill = wl.trajectories * perf.prefill_time(model, hw, new_tokens, ctx, tp) / ranks
    # contexts beyond the KV pool are evicted between turns and prefilled again
    spill = max(0.0, 1.0 - cap / max(1.0, in_flight * ctx))
    redo = perf.prefill_time(model, hw, ctx, 0, tp) * wl.mean_turns * spill
    prefill += wl.trajectories * redo / ranks
    # Little's law: the bound admits (bound + 1) batches, one of which the trainer holds
    # until its update, so about `bound` batches (or the env capacity) are in flight; a
    # group is ready only when its slowest trajectory is, so a batch takes at least
    # group latency * batch / groups in flight, however many GPUs generate
    turn = wl.mean_response_tokens * t_iter + wl.mean_env_s
    turn += perf.prefill_time(model, hw, wl.mean_obs_tokens, ctx, tp)
    group_latency = wl.group_tail * wl.mean_turns * turn
    in_flight = min(max(1, wl.staleness_bound) * wl.batch_groups, wl.env_capacity / wl.group_size)
    return max(decode + prefill, group_latency * wl.batch_groups / in_flight)


def train_time(model: ModelSpec, hw: HardwareSpec, wl: WorkloadProfile, gpus: int) -> float:
    """Seconds of Ref + Actor work, one aggregated swap pair and the weight sync per step."""
    if gpus < perf.min_train_gpus(model, hw):
        return math.inf
    tokens = wl.trajectories * (wl.mean_train_tokens or wl.final_len)
    sq = wl.trajectories * wl.mean_sq_len
    work = perf.train_time(model, hw, tokens, sq, gpus) + perf.ref_time(model, hw, tokens, sq, gpus)
    return work + perf.swap_time(model, hw, gpus) + perf.sync_time(model, hw, cross_node=True)


def initial_partition(
    model: ModelSpec,
    hw: HardwareSpec,
    workload: WorkloadProfile,
    total_gpus: int = 32,
    tp: int = 1,
) -> PlanChoice:
    """``argmin_x max(T_roll(x), T_train(total - x))`` over hot-switch-compatible splits."""
    if total_gpus <= tp:
        raise ValueError(f"total_gpus {total_gpus} leaves no trainer beside one rollout rank")
    rows = []
    for x in range(tp, total_gpus, tp):
        rows.append(
            (
                x,
                rollout_time(model, hw, workload, x, tp),
                train_time(model, hw, workload, total_gpus - x),
            )
        )
    feasible = [r for r in rows if math.isfinite(r[2])]
    if not feasible:
        raise ValueError("no split leaves the trainer enough GPUs for the train state")
    best = min(feasible, key=lambda r: (max(r[1], r[2]), r[0]))
    return PlanChoice(best[0], total_gpus - best[0], best[1], best[2], tuple(rows))

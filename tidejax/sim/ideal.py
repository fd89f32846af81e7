"""The ideal bound: every GPU-second spent on useful tokens, none waiting.

For the same task stream as a run (``steps`` batches of training groups plus the evaluation
phases), add up the GPU-seconds the work needs at its most efficient and divide by the GPU
count: decode at the largest batch the KV pool and ``max_num_seqs`` allow, each prompt and
observation prefilled exactly once (a group's shared prompt once per group), Ref + Actor on
every trained token; no waiting, no recompute, no swap, no sync, no role switch.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidejax.sched import perf
from tidejax.sched.perf import HardwareSpec, ModelSpec
from tidejax.sim import workload as wl
from tidejax.sim.costs import CostModel


@dataclass(frozen=True, slots=True)
class IdealBound:
    wall_s: float
    goodput: float  # trained tokens / s
    gpu_s: dict[str, float]  # useful GPU-seconds per kind


def _decode_gpu_s(cost: CostModel, cap: int, ctx0: int, n: int) -> float:
    """GPU-seconds of ``n`` decode tokens starting at context ``ctx0`` at the best batch."""
    curve = cost.curve
    mid = ctx0 + n / 2
    batch = max(1, min(cost.max_running, int(cap / max(mid, 1.0))))
    per_token = max(curve.a / batch + curve.b * mid, curve.c) + curve.ovh / batch
    return per_token * n


def _trajectory(cost: CostModel, cap: int, t: wl.TaskType, prompt: int, tr: wl.Trajectory):
    dec = pf = 0.0
    for k in range(tr.turns):
        ctx = wl.context_after(t, prompt, tr, k)
        if k > 0:  # the observation (or the rewritten window) is new; the rest is cached
            new = ctx - prompt if t.history_turns and k > t.history_turns else tr.obs[k - 1]
            pf += cost.prefill(new, ctx - new)
        dec += _decode_gpu_s(cost, cap, ctx, tr.responses[k])
    return dec, pf


def ideal(spec: wl.WorkloadSpec, steps: int, n_gpus: int) -> IdealBound:
    model = ModelSpec.preset(spec.model)
    cost = CostModel(model, HardwareSpec.h100())
    cap = perf.kv_capacity_tokens(model, cost.hw)
    stream = wl.TaskStream(spec)
    gpu = {"decode": 0.0, "prefill": 0.0, "ref": 0.0, "actor": 0.0}
    trained = 0
    groups = [stream.group(i) for i in range(steps * spec.batch_groups)]
    phases = (steps - 1) // spec.eval_every if spec.eval_every else 0
    groups += [stream.eval_group(i) for i in range(phases * spec.eval_tasks)]
    for g in groups:
        t = spec.types[g.type_index]
        gpu["prefill"] += cost.prefill(g.prompt, 0)
        for tr in g.trajectories:
            dec, pf = _trajectory(cost, cap, t, g.prompt, tr)
            gpu["decode"] += dec
            gpu["prefill"] += pf
            if not g.is_eval:
                tok, sq = wl.train_tokens(t, g.prompt, tr)
                trained += tok
                gpu["actor"] += cost.train(tok, sq, 1)
                gpu["ref"] += cost.ref(tok, sq, 1)
    wall = sum(gpu.values()) / n_gpus
    return IdealBound(wall_s=wall, goodput=trained / wall, gpu_s=gpu)

"""Upper bounds on goodput for a run's task stream: the ideal and a tighter one.

Both count the same work: ``steps`` batches of training groups plus the evaluation phases,
and both report goodput as the runtime does, generated tokens consumed per second.

* :func:`ideal`: every GPU-second spent on useful tokens, none waiting. Decode at the
  largest batch the KV pool and ``max_num_seqs`` allow, each prompt and observation
  prefilled once (a group's shared prompt once per group), Ref + Actor on every trained
  token; no waiting, recompute, swap, sync or role switch.
* :func:`tight`: the ideal's work with the costs no schedule avoids, and the wall time the
  staleness quota imposes. Its wall time is the largest of

  - *work*: the ideal's GPU-seconds with the short-context derate applied to decode
    (perf model: a batch whose mean context is below ``short_ctx_tokens`` runs at
    ``short_ctx_derate``; the bound reads each token's batch as holding like contexts),
    divided over the GPUs, plus one weight sync per update (every GPU takes part: the
    trainer sends, rollout stalls; the cheaper of the disaggregated broadcast and the
    colocated offload + in-place sync + reload);
  - *quota* (Little's law): at most ``(bound + 1) * batch_groups`` training groups are
    admitted and not consumed, and each holds its slot at least for its latency (its slowest
    trajectory's environment waits, plus every response decoded at batch 1, the fastest an
    iteration can run, plus its prefills at full rate), so
    ``wall >= sum(latencies) / quota``;
  - *environments*: the same with every trajectory (evaluation too) on the env capacity.

  It stays an upper bound up to the like-contexts reading of the derate.

* :func:`stream_order_floor`: not a bound on every schedule, a floor on the wall time of one
  that admits groups in stream order (no foresight of which are slow) with the staleness
  quota full, as every asynchronous system here runs (text-7b: throttled 95% of the time):
  the first version's weights admit ``(bound + 1) * batch_groups`` groups, each later
  version the next ``batch_groups``. A group admitted once version ``v`` reaches rollout must
  be taken by update ``v + bound``, so the ``bound + 1`` weight-sync intervals from there last
  at least its latency; over disjoint windows, the slowest group of every
  ``(bound + 1)``-th version sums to a floor. Printed beside the bounds; it changes neither.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from tidejax.sched import perf, staleness
from tidejax.sched.perf import HardwareSpec, ModelSpec
from tidejax.sim import workload as wl
from tidejax.sim.costs import CostModel


@dataclass(frozen=True, slots=True)
class IdealBound:
    wall_s: float
    goodput: float  # generated tokens of the trained groups / s
    trained_tok_s: float  # trained tokens (prompt + observations + generated) / s
    gpu_s: dict[str, float]  # GPU-seconds per kind
    walls: dict[str, float] | None = None  # tight bound: each lower bound on the wall time

    @property
    def binding(self) -> str:
        """Which lower bound on the wall time binds ("work" for the ideal)."""
        return max(self.walls, key=self.walls.get) if self.walls else "work"


def _decode_gpu_s(cost: CostModel, cap: int, ctx0: int, n: int) -> tuple[float, float]:
    """GPU-seconds of ``n`` decode tokens from context ``ctx0`` at the best batch, without
    and with the short-context derate."""
    curve = cost.curve
    mid = ctx0 + n / 2
    batch = max(1, min(cost.max_running, int(cap / max(mid, 1.0))))
    per_token = (max(curve.a / batch + curve.b * mid, curve.c) + curve.ovh / batch) * n
    return per_token, per_token / curve.derate if mid < curve.short_ctx else per_token


def _new_tokens(t: wl.TaskType, prompt: int, tr: wl.Trajectory, k: int, ctx: int) -> int:
    """Tokens turn ``k`` adds that were never computed (observation or rewritten window)."""
    return ctx - prompt if t.history_turns and k > t.history_turns else tr.obs[k - 1]


@dataclass
class _Work:
    """The task stream's work, summed once for both bounds."""

    gpu_s: dict[str, float]  # useful GPU-seconds per kind (decode without derate)
    decode_derated_s: float = 0.0
    trained: int = 0  # trained tokens of training groups
    generated: int = 0  # generated tokens of training groups
    decode_tokens: int = 0  # every decoded token (evaluation too)
    decode_ctx: float = 0.0  # sum over decoded tokens of their context
    turns: int = 0  # turns of training trajectories
    env_s: float = 0.0  # their environment waits
    group_latencies: list = field(default_factory=list)  # per training group, in stream order
    traj_latency: float = 0.0  # sum over every trajectory of its latency lower bound
    # per training group, per trajectory: decoded tokens and seconds outside decode
    # (environment waits and prefills at full rate)
    group_tokens: list = field(default_factory=list)
    group_other_s: list = field(default_factory=list)


def _trajectory(cost: CostModel, cap: int, t: wl.TaskType, prompt: int, tr, w: _Work):
    """Add one trajectory's rollout work to ``w``; return its latency lower bound and the
    part of it spent outside decode (s)."""
    curve = cost.curve
    latency = other = sum(tr.env)
    for k in range(tr.turns):
        ctx = wl.context_after(t, prompt, tr, k)
        if k > 0:  # the observation (or the rewritten window) is new; the rest is cached
            new = _new_tokens(t, prompt, tr, k, ctx)
            p = cost.prefill(new, ctx - new)
            w.gpu_s["prefill"] += p
            latency += p
            other += p
        n = tr.responses[k]
        plain, derated = _decode_gpu_s(cost, cap, ctx, n)
        w.gpu_s["decode"] += plain
        w.decode_derated_s += derated
        w.decode_tokens += n
        w.decode_ctx += n * (ctx + n / 2)
        # batch 1 is the fastest iteration: weights plus its own context, no derate
        latency += n * (curve.a + curve.ovh) + curve.b * (n * ctx + n * (n - 1) / 2)
    return latency, other


def _sum_work(cost: CostModel, spec: wl.WorkloadSpec, steps: int) -> _Work:
    cap = perf.kv_capacity_tokens(cost.model, cost.hw)
    stream = wl.TaskStream(spec)
    w = _Work({"decode": 0.0, "prefill": 0.0, "ref": 0.0, "actor": 0.0})
    groups = [stream.group(i) for i in range(steps * spec.batch_groups)]
    phases = (steps - 1) // spec.eval_every if spec.eval_every else 0
    groups += [stream.eval_group(i) for i in range(phases * spec.eval_tasks)]
    for g in groups:
        t = spec.types[g.type_index]
        prompt_s = cost.prefill(g.prompt, 0)
        w.gpu_s["prefill"] += prompt_s
        slowest = 0.0
        tokens, others = [], []
        for tr in g.trajectories:
            lat, other = _trajectory(cost, cap, t, g.prompt, tr, w)
            lat += prompt_s
            tokens.append(sum(tr.responses))
            others.append(other + prompt_s)
            slowest = max(slowest, lat)
            w.traj_latency += lat
            if not g.is_eval:
                tok, sq = wl.train_tokens(t, g.prompt, tr)
                w.trained += tok
                w.generated += sum(tr.responses)
                w.turns += tr.turns
                w.env_s += sum(tr.env)
                w.gpu_s["actor"] += cost.train(tok, sq, 1)
                w.gpu_s["ref"] += cost.ref(tok, sq, 1)
        if not g.is_eval:
            w.group_latencies.append(slowest)
            w.group_tokens.append(tokens)
            w.group_other_s.append(others)
    return w


@functools.lru_cache(maxsize=4)
def _work(spec: wl.WorkloadSpec, steps: int) -> _Work:
    """The stream's work, summed once per (spec, steps) for the ideal, the tighter bound and
    the stream-order floor (a pass takes 10-30 s at 100 steps); callers only read it."""
    return _sum_work(_cost(spec), spec, steps)


def _cost(spec: wl.WorkloadSpec) -> CostModel:
    return CostModel(ModelSpec.preset(spec.model), HardwareSpec.h100())


def ideal(spec: wl.WorkloadSpec, steps: int, n_gpus: int) -> IdealBound:
    w = _work(spec, steps)
    wall = sum(w.gpu_s.values()) / n_gpus
    return IdealBound(wall, w.generated / wall, w.trained / wall, dict(w.gpu_s))


def sync_floor(cost: CostModel) -> float:
    """Seconds per update every GPU loses to weight sync, whichever way it is done."""
    colocated = cost.engine_sleep() + cost.colocated_sync() + cost.engine_wake()
    return min(cost.sync(), colocated)


def iteration_s(curve: perf.DecodeCurve, batch: float, ctx: float) -> float:
    """One decode iteration of ``batch`` sequences at mean context ``ctx`` (real batch)."""
    t = max(curve.a + curve.b * batch * ctx, curve.c * batch) + curve.ovh
    return t / curve.derate if ctx < curve.short_ctx else t


def partition_wall(cost: CostModel, w: _Work, n_gpus: int, quota_groups: int) -> float:
    """The fluid wall time of the best fixed partition under the quota (see :func:`tight`)."""
    curve = cost.curve
    ctx = w.decode_ctx / max(1, w.decode_tokens)
    cap = perf.kv_capacity_tokens(cost.model, cost.hw)
    b_max = float(min(cost.max_running, cap / max(ctx, 1.0)))
    width = max(len(x) for x in w.group_tokens)
    tokens = np.zeros((len(w.group_tokens), width))
    other = np.zeros_like(tokens)
    for i, (n, o) in enumerate(zip(w.group_tokens, w.group_other_s)):
        tokens[i, : len(n)] = n
        other[i, : len(o)] = o
    train = w.gpu_s["ref"] + w.gpu_s["actor"]

    def quota_wall(b: float) -> float:  # Little's law: each group holds a slot its latency
        return float((tokens * iteration_s(curve, b, ctx) + other).max(axis=1).sum()) / quota_groups

    best = float("inf")
    for n_roll in range(1, n_gpus - cost.min_train_gpus + 1):

        def roll_wall(b: float, n_roll=n_roll) -> float:
            rate = n_roll * b / iteration_s(curve, b, ctx)
            return w.decode_tokens / rate + w.gpu_s["prefill"] / n_roll

        # rollout time falls with the batch, the quota's rises: bisect for where they cross
        lo, hi = 1e-3, b_max
        if roll_wall(hi) >= quota_wall(hi):
            lo = hi
        else:
            for _ in range(40):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if roll_wall(mid) >= quota_wall(mid) else (lo, mid)
        rollout = max(roll_wall(lo), quota_wall(lo))
        best = min(best, max(rollout, train / (n_gpus - n_roll)))
    return best


def tight(spec: wl.WorkloadSpec, steps: int, n_gpus: int, staleness_bound: int) -> IdealBound:
    """The tighter bound (see the module docstring)."""
    cost = _cost(spec)
    w = _work(spec, steps)
    quota = staleness.max_outstanding(staleness_bound, spec.batch_groups)
    gpu = dict(w.gpu_s, decode=w.decode_derated_s)
    sync = steps * sync_floor(cost)
    walls = {
        "work": sum(gpu.values()) / n_gpus + sync,
        "partition": partition_wall(cost, w, n_gpus, quota) + sync,
        "quota": sum(w.group_latencies) / quota,
        "env": w.traj_latency / spec.env_capacity,
    }
    wall = max(walls.values())
    return IdealBound(wall, w.generated / wall, w.trained / wall, gpu, walls)


def stream_order_floor(spec: wl.WorkloadSpec, steps: int, staleness_bound: int) -> float:
    """Wall-time floor of a stream-order schedule with the quota full (module docstring);
    each group's latency is the tighter bound's (batch 1 decode, full-rate prefill)."""
    latencies = _work(spec, steps).group_latencies
    b, span = spec.batch_groups, staleness_bound + 1
    # version v admits groups [(v + span - 1) b, (v + span) b); version 0 everything before
    slowest = [max(latencies[: span * b])]
    slowest += [
        max(latencies[(v + span - 1) * b : (v + span) * b]) for v in range(1, steps - span + 1)
    ]
    # windows starting span versions apart are disjoint intervals of the run
    return max(sum(slowest[o::span]) for o in range(span))

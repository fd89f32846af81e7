"""The paper's comparisons as functions returning rows (printing lives in experiments/).

Every table runs the same :mod:`tidejax.sim` machinery; nothing here is a hard-coded result.
Runs fan out over processes (``jobs``); each returns a :class:`RunResult`.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import os
from collections.abc import Sequence
from pathlib import Path

from tidejax.sched import ra2p
from tidejax.sched.perf import HardwareSpec, ModelSpec, swap_time
from tidejax.sim import systems, workload
from tidejax.sim.config import SimConfig, SystemSpec
from tidejax.sim.ideal import ideal as ideal_bound
from tidejax.sim.ideal import stream_order_floor
from tidejax.sim.ideal import tight as tight_bound
from tidejax.sim.metrics import RunResult
from tidejax.sim.workload import WorkloadSpec

E2E_WORKLOADS = ("text-7b", "text-14b", "osworld")


def _run(job: tuple[SystemSpec, WorkloadSpec, SimConfig]) -> RunResult:
    return systems.run(*job)


def run_many(jobs: Sequence[tuple[SystemSpec, WorkloadSpec, SimConfig]], n: int) -> list:
    """Run simulations in ``n`` processes (forked; results come back pickled)."""
    n = max(1, min(n, len(jobs)))
    if n == 1:
        return [_run(j) for j in jobs]
    ctx = mp.get_context("fork")
    with ctx.Pool(n) as pool:
        return pool.map(_run, jobs, chunksize=1)


def default_jobs() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


# ----------------------------------------------------------------------------- e2e
def sweep(family, spec: WorkloadSpec, cfg: SimConfig, steps: int, n: int) -> list[RunResult]:
    short = dataclasses.replace(cfg, steps=steps)
    return run_many([(family(x), spec, short) for x in systems.RATIOS], n)


def e2e(spec: WorkloadSpec, cfg: SimConfig, sweep_steps: int, n: int) -> dict:
    """All systems on one workload. Each fixed-ratio family (AReaL-like, StreamRL-like) is
    swept over :data:`systems.RATIOS` in short runs and its best ratio rerun in full; "best
    fixed" is the better of those full runs."""
    swept = {
        "areal": sweep(systems.areal, spec, cfg, sweep_steps, n),
        "streamrl": sweep(systems.streamrl, spec, cfg, sweep_steps, n),
    }
    best = {k: max(v, key=lambda r: r.goodput) for k, v in swept.items()}
    ratio = {k: float(b.system.split("@")[1]) for k, b in best.items()}
    lineup = [
        systems.sync(),
        systems.areal(ratio["areal"]),
        systems.streamrl(ratio["streamrl"]),
        systems.bidirl(),
        systems.tidejax(),
        systems.tidejax_bidirl(),
    ]
    results = run_many([(s, spec, cfg) for s in lineup], n)
    return {
        "spec": spec,
        "results": results,
        "swept": swept,
        "ideal": ideal_bound(spec, cfg.steps, cfg.n_gpus),
        "bound": tight_bound(spec, cfg.steps, cfg.n_gpus, cfg.staleness_bound),
        "stream_floor_s": stream_order_floor(spec, cfg.steps, cfg.staleness_bound),
        "sweep_cost": sweep_cost(swept, cfg.n_gpus),
    }


def stream_ceiling(block: dict) -> float:
    """The most of the tighter bound a schedule admitting in stream order with the quota
    full can reach (``ideal.stream_order_floor``)."""
    return min(1.0, block["bound"].wall_s / block["stream_floor_s"])


def sweep_cost(swept: dict[str, list[RunResult]], n_gpus: int) -> dict:
    """What finding the best fixed splits costs: the sweep's runs and their cluster time (the
    best ratio of each family is then rerun in full, counted apart)."""
    runs = [r for v in swept.values() for r in v]
    return {
        "runs": len(runs),
        "steps_each": runs[0].steps if runs else 0,
        "gpu_h": sum(r.wall_s for r in runs) * n_gpus / 3600,
        "full_reruns": len(swept),
    }


def fixed_baselines(results: Sequence[RunResult]) -> list[RunResult]:
    """The fixed-ratio baseline runs (AReaL-like and StreamRL-like) among ``results``."""
    return [r for r in results if r.system.startswith(("areal@", "streamrl@"))]


def best_fixed(results: Sequence[RunResult]) -> RunResult:
    """The best full run among the fixed-ratio baselines."""
    return max(fixed_baselines(results), key=lambda r: r.goodput)


def _member_row(m, fixed: RunResult) -> dict:
    """The fields every per-member row starts with."""
    return {
        "member": m.spec.name,
        "drift": m.drift,
        "gpus": m.n_gpus,
        "best_fixed": fixed.system,
        "best_fixed_goodput": fixed.goodput,
    }


def e2e_rows(block: dict) -> list[dict]:
    res = {r.system: r for r in block["results"]}
    sync = res["sync"].goodput
    fixed = best_fixed(block["results"]).goodput
    rows = []
    for r in block["results"]:
        rows.append(
            {
                "system": r.system,
                "goodput": r.goodput,
                "trained_tok_s": r.trained_tok_s,
                "x_sync": r.goodput / sync,
                "x_best_fixed": r.goodput / fixed,
                "of_ideal": r.goodput / block["ideal"].goodput,
                "of_bound": r.goodput / block["bound"].goodput,
                "rwt_gpu_h": r.rwt_gpu_s / 3600,
                "twt_gpu_h": r.twt_gpu_s / 3600,
                "kv_hit": r.kv_hit_rate,
                "staleness": r.mean_staleness,
                "max_staleness": r.max_staleness,
                "dropped_groups": r.dropped_groups,
                "step_s": r.wall_s / max(1, r.steps),
                "sim_s": r.extra.get("sim_s", 0.0),
            }
        )
    return rows


# ---------------------------------------------------------------------- robustness
def robustness(members, cfg: SimConfig, sweep_steps: int, n: int) -> list[dict]:
    """Every system of :func:`e2e` on each family member (its own GPU count); one row per
    member with each system's goodput over the best fixed split (``areal`` and ``streamrl``
    at their own best swept ratio)."""
    rows = []
    for m in members:
        block = e2e(m.spec, dataclasses.replace(cfg, n_gpus=m.n_gpus), sweep_steps, n)
        fixed = best_fixed(block["results"])
        rows.append(
            _member_row(m, fixed)
            | {
                # keyed by system family: each member sweeps its own fixed ratios
                "over_best_fixed": {
                    r.system.split("@")[0]: r.goodput / fixed.goodput for r in block["results"]
                },
                "tide_of_bound": _tide(block["results"]).goodput / block["bound"].goodput,
                "bound_binds": block["bound"].binding,
                "stream_ceiling": stream_ceiling(block),
                # what a stream-order schedule could reach over the best fixed split at most
                "cap_over_best_fixed": block["bound"].goodput * stream_ceiling(block)
                / fixed.goodput,
                "sweep_gpu_h": block["sweep_cost"]["gpu_h"],
                "runs": [r.summary() for r in block["results"]],
            }
        )
    return rows


def _tide(results: Sequence[RunResult]) -> RunResult:
    return next(r for r in results if r.system == "tidejax")


def ratio_summary(rows: list[dict], system: str = "tidejax") -> dict:
    """Worst and median of ``system`` / best fixed, overall and on the non-stationary rows."""

    def stats(xs: list[float]) -> tuple[float, float]:
        if not xs:
            return math.nan, math.nan
        xs = sorted(xs)
        mid = len(xs) // 2
        med = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
        return xs[0], med

    every = [r["over_best_fixed"][system] for r in rows]
    drift = [r["over_best_fixed"][system] for r in rows if r["drift"] != "none"]
    worst, median = stats(every)
    d_worst, d_median = stats(drift)
    return {
        "worst": worst,
        "median": median,
        "nonstationary_worst": d_worst,
        "nonstationary_median": d_median,
    }


# ------------------------------------------------------------------------ ablation
def ablation(spec: WorkloadSpec, cfg: SimConfig, start: float, n: int) -> list[RunResult]:
    """StreamRL-like -> +RA2P -> +ERS -> +CTB, all from the same starting split."""
    lineup = [
        systems.streamrl(start),
        SystemSpec("+RA2P", rollout_fraction=start, trainer="ra2p"),
        SystemSpec("+RA2P+ERS", rollout_fraction=start, trainer="ra2p", ers=True),
        SystemSpec(
            "+RA2P+ERS+CTB", rollout_fraction=start, trainer="ra2p", ers=True, rollout="ctb"
        ),
    ]
    return run_many([(s, spec, cfg) for s in lineup], n)


# ----------------------------------------------------------------------------- ctb
def ctb_bench(n_tasks: int = 1312, model: str = "qwen2.5-7b", n: int = 2) -> list[dict]:
    """One rollout step of ``n_tasks`` WebShop tasks on one H100: request level vs CTB."""
    base = workload.text(model)
    webshop = dataclasses.replace(base.types[0], weight=1.0)
    groups = n_tasks // base.group_size
    spec = dataclasses.replace(
        base,
        name=f"webshop-{n_tasks}",
        types=(webshop,),
        batch_groups=groups,
        b_min_groups=groups,
        eval_every=0,
        env_capacity=n_tasks,
    )
    cfg = SimConfig(steps=1, n_gpus=1)
    lineup = [SystemSpec("request-level", sync=True), SystemSpec("ctb", sync=True, rollout="ctb")]
    out = []
    for r in run_many([(s, spec, cfg) for s in lineup], n):
        t = r.extra["rollout_phase_s"]
        out.append(
            {
                "policy": r.system,
                "kv_hit_rate": r.kv_hit_rate,
                "gen_tok_s": r.consumed_response_tokens / t,
                "step_s": t,
                "recompute_gpu_s": r.breakdown.get("recompute", 0.0),
                "pauses": r.extra.get("ctb_pauses", 0),
            }
        )
    return out


# ---------------------------------------------------------------------------- ra2p
def ra2p_bench(
    n_mb: int = 8, mb_tokens: int = 8192, gpus: int = 4, model: str = "qwen2.5-7b"
) -> dict:
    """Eight ready micro-batches on four H100s, data parallel only (replicas: full copies)."""
    m, hw = ModelSpec.preset(model), HardwareSpec.h100()
    seq = 4096  # [A] trajectory length inside a micro-batch (attention term)
    sq = mb_tokens * seq
    from tidejax.sched.perf import ref_time, train_time

    w_act, w_ref = train_time(m, hw, mb_tokens, sq, 1), ref_time(m, hw, mb_tokens, sq, 1)
    rows = {}
    for layout, shards in (("replicated", 1), ("fsdp", gpus)):
        swap = swap_time(m, hw, shards)
        par = gpus if layout == "replicated" else 1  # replicas each take a micro-batch
        # vanilla streaming without offload: both models resident, so activations no longer
        # fit and the actor recomputes them (one more forward: 8N instead of 6N per token) [D]
        vs = ra2p.Ra2pCosts(
            w_act=w_act * 8 / 6, w_ref=w_ref, t_swap=0.0, n_actor=gpus, mb_parallel=par
        )
        vso = ra2p.Ra2pCosts(w_act=w_act, w_ref=w_ref, t_swap=swap, n_actor=gpus, mb_parallel=par)
        col = vso
        n_ref = max(1, round(gpus * w_ref / (w_ref + w_act)))
        dec = ra2p.Ra2pCosts(
            w_act=w_act, w_ref=w_ref, t_swap=swap, n_actor=gpus - n_ref, n_ref=n_ref
        )
        t = {
            "VS": ra2p.alternating_latency(vs, n_mb, 0.0, n_mb),
            "VSO": ra2p.alternating_latency(vso, n_mb, 0.0, n_mb),
            "CM": ra2p.colocated_latency(col, n_mb, 0.0, n_mb),
            "DM": ra2p.decoupled_latency(dec, n_mb, 0.0, n_mb),
        }
        chosen = ra2p.choose_mode(n_mb, 0.0, dec, n_mb)
        rows[layout] = {
            "step_s": t,
            "swap_s": swap,
            "n_ref": n_ref,
            "ra2p_mode": chosen.value,
            "ra2p_over_vso": min(t["CM"], t["DM"]) / t["VSO"],
        }
    return rows


# ----------------------------------------------------------------------------- ers
def ers_bench(cfg: SimConfig, n: int) -> list[RunResult]:
    """WebShop on one 8-GPU node: ERS against every fixed ratio (same CTB + RA2P)."""
    base = workload.text("qwen2.5-7b")
    webshop = dataclasses.replace(base.types[0], weight=1.0)
    scale = 8 / 32
    spec = dataclasses.replace(
        base,
        name="webshop-8gpu",
        types=(webshop,),
        batch_groups=int(base.batch_groups * scale),
        b_min_groups=int(base.b_min_groups * scale),
        eval_tasks=int(base.eval_tasks * scale),
        env_capacity=int(base.env_capacity * scale),
    )
    cfg = dataclasses.replace(cfg, n_gpus=8)
    lineup = [
        SystemSpec(f"fixed@{x:g}", rollout_fraction=x, trainer="ra2p", rollout="ctb")
        for x in systems.RATIOS
    ]
    lineup.append(systems.tidejax())
    return run_many([(s, spec, cfg) for s in lineup], n)


def workload_tails(spec: WorkloadSpec, steps: int = 2) -> dict:
    """Trajectory-time tail statistics of a synchronous run (calibration check)."""
    cl = systems.build(systems.sync(), spec, SimConfig(steps=steps))
    start, dur = {}, []
    new_task, turn_end = cl.new_task, cl._turn_end

    def tracked_new(g, r, t):
        task = new_task(g, r, t)
        start[task.task_id] = t
        return task

    def tracked_end(task, r, t):
        if task.turn + 1 >= task.traj.turns and not task.group.is_eval:
            dur.append(t - start[task.task_id])
        turn_end(task, r, t)

    cl.new_task, cl._turn_end = tracked_new, tracked_end
    res = cl.run()
    d = sorted(dur)
    med = d[len(d) // 2]
    phase = res.extra["rollout_phase_s"]
    return {
        "median_s": med,
        "p99_over_median": d[int(0.99 * len(d))] / med,
        "max_over_median": d[-1] / med,
        "last10pct_share": 1 - d[int(0.9 * len(d))] / d[-1],
        "rollout_share": phase / (res.wall_s / steps),
    }


def save_timelines(results: Sequence[RunResult], folder: Path) -> list[Path]:
    from tidejax.sim.plot import timeline_png

    out = []
    for r in results:
        name = r.system.replace("@", "_at_").replace("+", "plus_")
        out.append(timeline_png(r, folder / f"{name}.png"))
    return out


# ------------------------------------------------------------------------ headroom
def phase_paces(result: RunResult, phases: int) -> list[tuple[int, float]]:
    """(generated tokens consumed, seconds) in each of ``phases`` equal spans of steps."""
    steps = result.steps
    if phases <= 0 or phases > steps:
        raise ValueError(f"phases must be in [1, {steps}], got {phases}")
    t, tok = result.extra["step_marks"], result.extra["consumed_marks"]
    cuts = [round(k * steps / phases) for k in range(phases + 1)]
    return [(tok[b] - tok[a], t[b] - t[a]) for a, b in zip(cuts, cuts[1:])]


def phase_oracle(results: Sequence[RunResult], phases: int) -> tuple[float, tuple[str, ...]]:
    """The goodput of a run that, in each phase, goes at the pace of whichever of ``results``
    makes the whole run best, switching for free, and the systems it picks.

    It estimates what adapting the split at phase granularity could gain over holding the
    best one; it is not a strict bound (a phase's pace carries its run's history, and the
    switch costs nothing).

    Goodput is a ratio of sums, so phases cannot be chosen one by one on pace; Dinkelbach's
    iteration is exact instead: at ratio ``g`` each phase takes the run maximising
    ``tokens - g * seconds``, the choice's ratio becomes the next ``g``, until it stops
    rising (each step is linear in phases x runs)."""
    paces = [phase_paces(r, phases) for r in results]
    ratio, choice = -math.inf, None
    while True:
        g = max(ratio, 0.0)
        nxt = [
            max(range(len(results)), key=lambda i: paces[i][k][0] - g * paces[i][k][1])
            for k in range(phases)
        ]
        tok = sum(paces[i][k][0] for k, i in enumerate(nxt))
        sec = sum(paces[i][k][1] for k, i in enumerate(nxt))
        if sec <= 0 or tok / sec <= ratio:
            break
        ratio, choice = tok / sec, nxt
    if choice is None:
        raise ValueError("phase_oracle needs runs that took time")
    return ratio, tuple(results[i].system for i in choice)


def headroom(members, cfg: SimConfig, phases: int, n: int) -> list[dict]:
    """On each member: every fixed split of the AReaL-like and StreamRL-like baselines and of
    tidejax's own mechanisms (``tidejax-fixed``), all run in full, tidejax with ERS, and the
    phase oracle over each set; every figure over the best fixed baseline."""
    rows = []
    for m in members:
        mcfg = dataclasses.replace(cfg, n_gpus=m.n_gpus)
        lineup = [f(x) for f in (systems.areal, systems.streamrl) for x in systems.RATIOS]
        lineup += [systems.tidejax_fixed(x) for x in systems.RATIOS] + [systems.tidejax()]
        res = run_many([(s, m.spec, mcfg) for s in lineup], n)
        base = fixed_baselines(res)
        mech = [r for r in res if r.system.startswith("tidejax-fixed@")]
        fixed = best_fixed(base)
        best_mech = max(mech, key=lambda r: r.goodput)
        base_oracle, base_pick = phase_oracle(base, phases)
        mech_oracle, mech_pick = phase_oracle(mech, phases)
        rows.append(
            _member_row(m, fixed)
            | {
                "best_tidejax_fixed": best_mech.system,
                "over_best_fixed": {
                    "tidejax": _tide(res).goodput / fixed.goodput,
                    "tidejax_fixed": best_mech.goodput / fixed.goodput,
                    "baseline_oracle": base_oracle / fixed.goodput,
                    "tidejax_fixed_oracle": mech_oracle / fixed.goodput,
                },
                "baseline_oracle_pick": base_pick,
                "tidejax_fixed_oracle_pick": mech_pick,
                "runs": [r.summary() for r in res],
            }
        )
    return rows

"""Turn a finished :class:`~tidejax.sim.cluster.Cluster` into a :class:`RunResult`."""

from __future__ import annotations

from tidejax.sim.metrics import OVERHEAD, USEFUL, RunResult, overlap


def result_of(cl) -> RunResult:
    end = cl.end_t or cl.now
    led = cl.ledger
    for r in cl.ranks.values():
        r.close_idle(end)  # flushes the rank's pending busy time into the ledger
    roles = led.role_seconds(end)
    busy = dict(led.totals)
    # rollout idle: exact intervals kept by the ranks (closed ones included)
    idle_iv: list[tuple[float, float, int]] = list(cl.closed_idle)
    prompt, hits = cl.closed_counters
    for r in cl.ranks.values():
        idle_iv.extend((a, b, len(r.gpus)) for a, b in r.idle)
        c = r.pool.counters()
        prompt += c.prompt_tokens
        hits += c.hit_tokens
    clipped = [(a, min(b, end), n) for a, b, n in idle_iv if a < end]
    rollout_idle = sum((b - a) * n for a, b, n in clipped)
    throttle = list(cl.throttle)
    if cl.throttled_since is not None:
        throttle.append((cl.throttled_since, end))
    rwt = sum(overlap([(a, b)], throttle) * n for a, b, n in clipped)
    total = cl.cfg.n_gpus * end
    accounted = sum(busy.values()) + rollout_idle
    trainer_idle = max(0.0, total - accounted)
    if cl.sys.sync:  # every GPU waits at the phase barrier for the batch's stragglers
        twt, rwt = rollout_idle + trainer_idle, 0.0
    else:
        twt = trainer_idle
    breakdown = dict(busy)
    breakdown["idle_rollout_throttled"] = rwt if not cl.sys.sync else 0.0
    breakdown["idle_rollout_other"] = rollout_idle - (rwt if not cl.sys.sync else 0.0)
    breakdown["idle_trainer"] = trainer_idle
    stale = cl.stale or [0]
    extra = {
        "useful_share": round(sum(busy.get(k, 0.0) for k in USEFUL) / total, 4) if total else 0,
        "overhead_share": round(sum(busy.get(k, 0.0) for k in OVERHEAD) / total, 4) if total else 0,
        "step_marks": [round(x, 2) for x in cl.step_marks],
        "consumed_marks": list(cl.consumed_marks),  # generated tokens consumed by each mark
        "first_step_s": cl.step_marks[1] - cl.step_marks[0] if len(cl.step_marks) > 1 else 0.0,
        "final_partition": _partition(cl),
    }
    if cl.sys.sync:
        extra["rollout_phase_s"] = cl.rollout_phase_s / max(1, cl.steps_done)
    if getattr(cl.driver, "pauses", None) is not None:
        extra["ctb_pauses"] = cl.driver.pauses
    if cl.elastic is not None:
        extra["borrows"] = dict(cl.elastic.borrows)
        if cl.sys.borrowing:
            extra["borrow_checks"] = dict(cl.elastic.borrow_checks)
        if cl.elastic.plan_choice is not None:
            pc = cl.elastic.plan_choice
            extra["planner"] = {
                "rollout_gpus": pc.rollout_gpus,
                "train_gpus": pc.train_gpus,
                "t_rollout": round(pc.t_rollout, 2),
                "t_train": round(pc.t_train, 2),
            }
    if cl.plans:
        extra["ers_plans"] = cl.plans
    return RunResult(
        system=cl.sys.name,
        workload=cl.spec.name,
        steps=cl.steps_done,
        wall_s=end,
        consumed_tokens=cl.consumed_tokens,
        consumed_response_tokens=cl.consumed_resp,
        dropped_tokens=cl.dropped_tokens,
        goodput=cl.consumed_resp / end if end else 0.0,
        rwt_gpu_s=rwt,
        twt_gpu_s=twt,
        kv_hit_rate=hits / prompt if prompt else 0.0,
        mean_staleness=sum(stale) / len(stale),
        max_staleness=max(stale),
        breakdown=breakdown,
        roles=roles,
        extra=extra,
        timeline=led.timeline(end),
        bin_s=led.bin_s,
        dropped_groups=cl.dropped_groups,
    )


def _partition(cl) -> dict:
    tr = cl.trainer
    return {
        "rollout": sum(len(r.gpus) for r in cl.ranks.values()),
        "actor": len(tr.actor),
        "ref": len(tr.ref),
    }

"""Elastic Resource Scaling (TideRL §ERS): one plan per post-update boundary.

:func:`plan` reads readiness :class:`Signals` and the current :class:`Partition` and returns
a :class:`Plan`: the next partition (at most one rank moved), the RA2P mode, the elastic
batch size in ``[B_min, B_ideal]`` and whether the trainer retains a reservoir. Rules, first
match wins:

1. **Preemptive generation** (cold start, or an evaluation phase): generation dominates, so
   move one trainer rank (a Ref rank first) to rollout and run colocated.
2. **Consumption deficit**: ready data outruns the trainer - the oldest ready micro-batch
   has waited more than ``tau * T_step`` (head-of-line latency), a full batch is already
   ready at the boundary, micro-batches arrived faster (TPRM) than the trainer serves one
   while it barely waited (TWT <= ``theta / 2``), rollout idled behind the staleness bound
   (RWT > ``theta``) with at least ``B_min`` groups waiting and the trainer barely waiting
   (throttled by data the trainer has not consumed, not by slow groups), or RAS is past
   the break-even point at which a
   decoupled pipeline on the trainer plus one reclaimed rank costs fewer GPU-seconds than
   colocated on the current trainer.
   Reclaim one rollout rank - as a Ref rank while the decoupled pipeline would be
   Ref-bound, else as an Actor rank.
3. **Generation deficit**: the trainer waited for data (TWT above ``theta`` of the step).
   Run colocated. If rollout was just scaled down, keep the partition and fetch less
   (adaptive retention: the batch moves halfway toward ``B_min``); else, if rollout itself
   did not wait, release one rank to rollout (a Ref rank first). When both sides waited,
   the staleness window (not GPUs) limits supply and moving a rank would not help.
4. Otherwise keep the partition; RA2P picks the mode from RAS and TPRM.

Deliberately conservative (as TideRL describes its plans): a deficit moves a rank only when
the previous boundary showed the same deficit (``Signals.last_pressure``, fed back from
``Plan.pressure``) and ``cooldown`` boundaries have passed since the last move (the buffer
reflects a move only a step or two later), so noise and lag do not swing GPUs back and forth.
Preemptive generation is exempt.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tidejax.sched import ra2p
from tidejax.sched.ra2p import Mode, Ra2pCosts


@dataclass(frozen=True, slots=True)
class Partition:
    """Ranks per role; a rank is the move unit (one rollout instance's GPUs)."""

    rollout: int
    actor: int
    ref: int = 0

    def __post_init__(self) -> None:
        if self.rollout < 0 or self.actor <= 0 or self.ref < 0:
            raise ValueError(f"Partition needs rollout >= 0, actor > 0, ref >= 0: {self}")

    @property
    def total(self) -> int:
        return self.rollout + self.actor + self.ref

    @property
    def trainer(self) -> int:
        return self.actor + self.ref


def moved(a: Partition, b: Partition) -> int:
    """Ranks that change role between two partitions of the same cluster."""
    if a.total != b.total:
        raise ValueError("partitions of different sizes")
    return (abs(a.rollout - b.rollout) + abs(a.actor - b.actor) + abs(a.ref - b.ref)) // 2


@dataclass(frozen=True, slots=True)
class ErsConfig:
    b_min: int  # groups: smallest batch worth an update
    b_ideal: int  # groups: a full batch
    min_rollout: int = 1  # ranks
    min_actor: int = 1  # ranks that hold the sharded train state
    tau: float = 1.0  # head-of-line threshold, in units of the average step time
    theta: float = 0.1  # share of a step spent waiting (TWT or RWT) that counts [A]
    cooldown: int = 2  # boundaries after a move before the next one (the buffer lags) [A]

    def __post_init__(self) -> None:
        if not 0 < self.b_min <= self.b_ideal:
            raise ValueError(
                f"ErsConfig needs 0 < b_min <= b_ideal, got {self.b_min}, {self.b_ideal}"
            )
        if self.min_rollout < 0 or self.min_actor <= 0:
            raise ValueError("ErsConfig.min_rollout must be >= 0 and min_actor > 0")
        if self.tau <= 0:
            raise ValueError("ErsConfig.tau must be positive")
        if not 0 < self.theta < 1:
            raise ValueError("ErsConfig.theta must be in (0, 1)")
        if self.cooldown < 1:
            raise ValueError("ErsConfig.cooldown must be >= 1")


@dataclass(frozen=True, slots=True)
class Signals:
    """Readiness at the post-update boundary, read from the global buffer."""

    ras_mb: int  # ready micro-batches now (RAS of the next step)
    ready_groups: int  # ready volume, groups
    tprm_s: float  # mean seconds between micro-batch arrivals last step (inf: none arrived)
    hol_s: float  # age of the oldest ready micro-batch, s (0 when none is ready)
    t_step_s: float  # average step duration so far, s
    mb_per_step: int  # micro-batches a full batch makes
    costs: Ra2pCosts  # current trainer costs (n_actor, n_ref from the current partition)
    prev_batch: int  # groups the last step consumed
    twt_frac: float = 0.0  # share of the last step trainer GPUs idled waiting for data
    rwt_frac: float = 0.0  # share of the last step rollout GPUs idled behind the bound
    cold_start: bool = False
    eval_phase: bool = False  # evaluation tasks are queued or running
    rollout_scaled_down: bool = False  # the last plan moved a rank from rollout to trainer
    last_pressure: int = 0  # Plan.pressure of the previous boundary (-1, 0, +1)
    since_move: int = 1 << 30  # boundaries since the partition last changed

    def __post_init__(self) -> None:
        if min(self.ras_mb, self.ready_groups, self.mb_per_step, self.prev_batch) < 0:
            raise ValueError("Signals counts must be >= 0")
        if min(self.tprm_s, self.hol_s, self.t_step_s) < 0:
            raise ValueError("Signals times must be >= 0")
        if not (0 <= self.twt_frac <= 1 and 0 <= self.rwt_frac <= 1):
            raise ValueError("Signals.twt_frac and rwt_frac must be in [0, 1]")
        if self.last_pressure not in (-1, 0, 1):
            raise ValueError("Signals.last_pressure must be -1, 0 or 1")
        if self.since_move < 0:
            raise ValueError("Signals.since_move must be >= 0")


@dataclass(frozen=True, slots=True)
class Plan:
    partition: Partition
    mode: Mode
    batch_groups: int
    retain: bool  # adaptive retention: fetch below B_ideal, keep a reservoir
    reason: str
    pressure: int = 0  # this boundary's deficit: +1 consumption, -1 generation, 0 none


def initial(total: int, cfg: ErsConfig) -> Partition:
    """Cold start: the largest rollout the trainer's minimum allows (preemptive generation)."""
    if total < cfg.min_actor + cfg.min_rollout:
        raise ValueError(f"{total} ranks cannot hold min_actor + min_rollout")
    return Partition(rollout=total - cfg.min_actor, actor=cfg.min_actor)


def _to_rollout(p: Partition, cfg: ErsConfig) -> Partition:
    if p.ref > 0:
        return replace(p, rollout=p.rollout + 1, ref=p.ref - 1)
    if p.actor > cfg.min_actor:
        return replace(p, rollout=p.rollout + 1, actor=p.actor - 1)
    return p


def _to_trainer(p: Partition, cfg: ErsConfig, costs: Ra2pCosts, decoupled: bool) -> Partition:
    if p.rollout <= cfg.min_rollout:
        return p
    # A Ref rank while a worthwhile decoupled pipeline would be Ref-bound; else an Actor rank.
    ref_bound = p.ref == 0 or costs.w_ref / p.ref > costs.w_act / p.actor
    if decoupled and ref_bound:
        return replace(p, rollout=p.rollout - 1, ref=p.ref + 1)
    return replace(p, rollout=p.rollout - 1, actor=p.actor + 1)


def balanced(costs: Ra2pCosts, extra: int = 0) -> Ra2pCosts:
    """The trainer's GPUs (plus ``extra``) split for a decoupled pipeline by cost share."""
    gpus = costs.n_actor + costs.n_ref + extra
    n_ref = max(1, round(gpus * costs.w_ref / (costs.w_ref + costs.w_act)))
    if n_ref >= gpus:
        return costs
    return replace(costs, n_actor=gpus - n_ref, n_ref=n_ref)


def service_time(costs: Ra2pCosts) -> float:
    """Seconds the trainer needs per micro-batch when busy (the faster of the two modes)."""
    colocated = (costs.w_ref + costs.w_act) / costs.n_actor
    if costs.n_ref == 0:
        return colocated
    return min(colocated, max(costs.w_ref / costs.n_ref, costs.w_act / costs.n_actor))


def _mode_for(p: Partition, want: Mode) -> Mode:
    return want if (want is Mode.COLOCATED or p.ref > 0) else Mode.COLOCATED


def plan(signals: Signals, partition: Partition, cfg: ErsConfig) -> Plan:
    """The next partition (at most one rank moved), RA2P mode and batch; see module doc."""
    s, p = signals, partition
    if s.cold_start or s.eval_phase:
        nxt = _to_rollout(p, cfg)
        why = "cold start" if s.cold_start else "evaluation phase"
        return Plan(nxt, Mode.COLOCATED, cfg.b_ideal, False, f"preemptive generation: {why}")

    costs = replace(s.costs, n_actor=p.actor, n_ref=p.ref)
    n_mb = max(1, s.mb_per_step)
    even = ra2p.break_even_ras(balanced(costs, extra=1), costs, s.tprm_s, n_mb)
    starved = s.twt_frac > cfg.theta  # the trainer waited for data
    throttled = s.rwt_frac > cfg.theta  # rollout idled behind the staleness bound
    calm = s.twt_frac <= cfg.theta / 2  # the trainer hardly waited for data
    backlog = s.ready_groups >= cfg.b_min  # data is actually waiting in the buffer
    reasons = {
        "head-of-line latency": s.hol_s > cfg.tau * s.t_step_s > 0,
        "RAS past break-even": even is not None and s.ras_mb >= max(1, even),
        "a full batch ready": s.ready_groups >= cfg.b_ideal,
        "TPRM below service time": calm and s.tprm_s < service_time(costs),
        "RWT with a backlog": throttled and calm and backlog,
    }
    why = next((k for k, v in reasons.items() if v), None)
    if why is not None:
        # conservative: a rank moves only when the deficit persists over two boundaries
        nxt = _to_trainer(p, cfg, costs, decoupled=reasons["RAS past break-even"])
        if s.last_pressure != 1 or s.since_move < cfg.cooldown:
            nxt = p
        grown = replace(costs, n_actor=nxt.actor, n_ref=nxt.ref)
        mode = ra2p.choose_mode(s.ras_mb, s.tprm_s, grown, n_mb)
        return Plan(nxt, _mode_for(nxt, mode), cfg.b_ideal, False, f"consumption deficit: {why}", 1)

    if starved and s.rollout_scaled_down:
        batch = max(cfg.b_min, (s.prev_batch + cfg.b_min) // 2)
        return Plan(
            p, Mode.COLOCATED, batch, True, "generation deficit: retain after scale-down", -1
        )
    if starved and s.rwt_frac <= cfg.theta / 2:
        steady = s.last_pressure == -1 and s.since_move >= cfg.cooldown
        nxt = _to_rollout(p, cfg) if steady else p
        return Plan(nxt, Mode.COLOCATED, cfg.b_ideal, False, "generation deficit", -1)

    mode = ra2p.choose_mode(s.ras_mb, s.tprm_s, costs, n_mb)
    return Plan(p, _mode_for(p, mode), cfg.b_ideal, False, "balanced")

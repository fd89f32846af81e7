"""Elastic Resource Scaling (TideRL §ERS): one plan per post-update boundary.

:func:`plan` reads readiness :class:`Signals` and the current :class:`Partition` and returns
a :class:`Plan`: the next partition (one move: a rank, or the ranks the next mesh size the
memory model admits needs, ``ErsConfig.actor_sizes``; a probe or its revert may move
ranks worth up to ``theta`` of the trainer), the RA2P mode, the elastic
batch size in ``[B_min, B_ideal]`` and whether the trainer retains a reservoir.

How it decides. The measured shares of the last steps give each side's busy time: the
trainer was busy ``S * (1 - TWT)``, rollout ``S * (1 - idle)`` of a step of ``S`` seconds.
The perf model predicts the step time of the current partition and of its two neighbours,
``max(T_busy * t / t', R_busy * rollout_scale(r, r'))`` (:func:`predicted_step_s`). A
neighbour is taken when

* its side is the bottleneck by the signals: rollout gains a rank only while the trainer
  waited for data (TWT > ``theta``) and rollout was busy (idle <= ``theta``: more ranks
  make it faster, unlike a latency- or quota-bound rollout); the trainer gains a rank only
  while it did not wait (TWT <= ``theta``) and no group of the last step arrived too stale
  while rollout was busy (a drop with rollout busy means supply is already late; with
  rollout throttled the dropped groups aged waiting for the trainer) - so a rank is never
  taken from rollout while the trainer waits. Rollout's time for another rank count comes from the decode curve
  (:func:`rollout_scale`: the same sequences in flight make bigger or smaller batches);
* the predicted saving per step, over the ``cooldown`` steps a move must last, pays the
  move's cost (switch + reshard, ``Signals.move_cost_s``, from the perf model);
* the same move was wanted at the previous boundary and ``cooldown`` boundaries have
  passed since the last one (hysteresis: the buffer reflects a move a step or two later).

Every move is a *trial*: ``cooldown + 1`` boundaries later (the first step after a move
carries its delay) the measured step time is compared with the one before, per generated
token consumed when the caller reports tokens (``Signals.last_step_tokens``: responses
that grow over training slow every step, whatever the partition). A move the
perf model predicted stays unless the step got slower by more than the move's cost per
step; a probe (below) stays only if the step fell by more than that. A reverted
direction then backs off for ``trial_backoff`` boundaries, doubling with each consecutive
revert. The trial also lets
ERS *probe*: when neither side waited (trainer TWT and rollout idle both <= ``theta``) the
signals cannot tell a trainer-bound step from a rollout that the staleness quota paces
(busy at a small batch, so it would keep up with a rank fewer). A probe gives the trainer a
rank (as many as add at most ``theta`` of the trainer's capacity, so the effect stands
out of the step-to-step noise; after each kept probe twice that share, up to
``probe_doublings`` times, a doubling search) when the perf model says they cost rollout
relatively less time than they save the trainer, and lets the measurement decide. The perf model
predicts; the step time measured on the cluster has the last word.

A rank joining the trainer serves Ref when the perf model says a decoupled pipeline on the
grown trainer pays (RAS past the break-even point, :func:`ra2p.break_even_ras`) and the
pipeline would be Ref-bound; else Actor. The RA2P mode is then chosen by cost for the new
partition (decoupled needs a Ref rank).

Relation to the paper's rules: *preemptive generation* (cold start, evaluation) moves a
trainer rank to rollout at once; here the evaluation's rank is lent once per phase and
returned when the phase is over (``Signals.eval_ranks_out``, handed back from
``Plan.eval_ranks_out``), whether or not the trainer waits then (the evaluation's own tail
is a likely cause). The deficit rules, probes and trials then wait until their window of
signals (the last ``cooldown`` steps) holds neither the evaluation's step nor the next one,
in which the pipeline refills after the anchored evaluation (``Trial.since_eval``); a
trial that straddles an evaluation is judged on the steps after it. At cold start the simulator lends
the trainer's ranks beyond the smallest actor (:func:`initial`) until the first batch is
ready; plans start from the planned split. The paper's *consumption deficit* triggers
(head-of-line latency, a full batch ready, TPRM below the service time, RAS past
break-even) and *generation deficit* (TWT) become evidence for which side is the
bottleneck; the move itself must also be predicted to pay, which keeps a one-step pipeline
(where a full batch is always ready) from walking rollout down. *Adaptive retention*
stays: starved right after a scale-down, the trainer fetches less instead of moving back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tidejax.sched import ra2p
from tidejax.sched.perf import DecodeCurve
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


def since_move_after(since_move: int, current: Partition, plan: "Plan") -> int:
    """The boundaries-since-a-move count once ``plan`` is applied: an evaluation's loan or
    return moves ranks but is not an ERS decision, so it does not restart a trial's clock."""
    return 0 if moved(current, plan.partition) and not plan.loan_move else since_move + 1


@dataclass(frozen=True, slots=True)
class ErsConfig:
    b_min: int  # groups: smallest batch worth an update
    b_ideal: int  # groups: a full batch
    min_rollout: int = 1  # ranks
    min_actor: int = 1  # ranks that hold the sharded train state
    tau: float = 1.0  # head-of-line threshold, in units of the average step time
    theta: float = 0.1  # share of a step spent waiting (TWT or RWT) that counts [A]
    cooldown: int = 2  # boundaries after a move before the next one (the buffer lags) [A]
    # boundaries before a direction whose last trial was reverted is tried again; doubles
    # with each consecutive revert (a failed trial costs two moves and `cooldown + 1`
    # slower steps, so at most about one such loss per `trial_backoff` steps) [A]
    trial_backoff: int = 8
    # a kept probe doubles the share of the trainer the next probe may add, at most this
    # many times (a doubling search: a split far from the best is crossed in a few trials,
    # a wrong probe costs at most theta * 2 ** probe_doublings of the trainer while it is
    # measured) [A]
    probe_doublings: int = 2
    # Mesh sizes the memory model admits (tidejax.sched.memory.JobMemory): an actor or a
    # decoupled reference mesh is only ever one of these sizes; empty: any size. A move
    # to the next admitted size takes as many ranks as it needs.
    actor_sizes: tuple[int, ...] = ()
    ref_sizes: tuple[int, ...] = ()

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
        if self.trial_backoff < 1:
            raise ValueError("ErsConfig.trial_backoff must be >= 1")
        if self.probe_doublings < 0:
            raise ValueError("ErsConfig.probe_doublings must be >= 0")
        if any(n <= 0 for n in (*self.actor_sizes, *self.ref_sizes)):
            raise ValueError("ErsConfig.actor_sizes and ref_sizes must be positive")

    @property
    def smallest_actor(self) -> int:
        admitted = [n for n in self.actor_sizes if n >= self.min_actor]
        return min(admitted) if self.actor_sizes else self.min_actor

    def actor_size(self, current: int, grow: bool) -> int | None:
        """The next admitted actor size above (``grow``) or below ``current``."""
        return _next_size(current, self.actor_sizes, grow, self.min_actor)

    def ref_size(self, current: int, grow: bool) -> int | None:
        """The next admitted reference size; shrinking may reach 0 (no decoupled ref)."""
        if grow:
            return _next_size(current, self.ref_sizes, True, 1)
        if current == 0:
            return None
        smaller = _next_size(current, self.ref_sizes, False, 1)
        return 0 if smaller is None else smaller


def _next_size(current: int, sizes: tuple[int, ...], grow: bool, floor: int) -> int | None:
    if not sizes:
        nxt = current + 1 if grow else current - 1
        return nxt if nxt >= floor else None
    options = [n for n in sizes if n >= floor and (n > current if grow else n < current)]
    if not options:
        return None
    return min(options) if grow else max(options)


@dataclass(frozen=True, slots=True)
class Trial:
    """A move under measurement, and what earlier trials showed. The caller hands the last
    plan's ``Plan.trial`` back in ``Signals.trial``."""

    origin: Partition | None = None  # the partition before the move on trial (None: none)
    direction: int = 0  # +1: the move gave the trainer a rank; -1: gave rollout one
    # what a step cost before the move, measured: seconds per generated token consumed
    # when the signals report tokens (Signals.last_step_tokens), else seconds per step
    base_cost: float = 0.0
    # True: the perf model predicted the move's gain (a deficit rule), so it stays unless
    # the step got clearly slower; False (a probe): it stays only if the step clearly fell
    predicted: bool = False
    refuted_direction: int = 0  # direction of the last reverted trial (0: none)
    refuted: int = 0  # consecutive reverts in that direction
    since_revert: int = 0  # boundaries since that revert
    kept_probes: int = 0  # consecutive probes kept since the last revert or generation move
    since_eval: int = 1 << 30  # boundaries since an evaluation phase was last signalled

    def __post_init__(self) -> None:
        if self.direction not in (-1, 0, 1) or self.refuted_direction not in (-1, 0, 1):
            raise ValueError("Trial.direction and refuted_direction must be -1, 0 or 1")
        if (self.origin is None) != (self.direction == 0):
            raise ValueError("Trial needs an origin exactly when it has a direction")
        if min(self.base_cost, self.refuted, self.since_revert, self.kept_probes,
               self.since_eval) < 0:
            raise ValueError(
                "Trial.base_cost, refuted, since_revert, kept_probes, since_eval must be >= 0")

    def backed_off(self, direction: int, cfg: ErsConfig) -> bool:
        """Whether a move in ``direction`` waits: its last trial was reverted and the
        (doubling) back-off has not passed."""
        if self.refuted_direction != direction or self.refuted == 0:
            return False
        return self.since_revert < cfg.trial_backoff * 2 ** min(self.refuted - 1, 6)

    def aged(self) -> Trial:
        """The same trial one boundary later."""
        return replace(self, since_revert=self.since_revert + 1,
                       since_eval=min(self.since_eval + 1, 1 << 30))

    def started(self, origin: Partition, direction: int, base_cost: float,
                predicted: bool) -> Trial:
        # The record of reverts stays whatever moves: a move the other way agrees with the
        # revert, and clearing the back-off on it let a refuted probe come back every
        # generation-deficit move (m05: four 8-rank probes reverted, each ~5-10% slower
        # over its trial).
        return replace(self, origin=origin, direction=direction, base_cost=base_cost,
                       predicted=predicted,
                       kept_probes=self.kept_probes if direction == 1 else 0)

    def settled(self) -> Trial:
        """The trial is over; the record of reverts stays."""
        probe = self.direction == 1 and not self.predicted
        return replace(self, origin=None, direction=0, base_cost=0.0, predicted=False,
                       kept_probes=self.kept_probes + probe)

    def reverted(self) -> Trial:
        refuted = self.refuted + 1 if self.refuted_direction == self.direction else 1
        return Trial(refuted_direction=self.direction, refuted=refuted,
                     since_eval=self.since_eval)


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
    eval_phase: bool = False  # evaluation tasks are queued or running
    rollout_scaled_down: bool = False  # the last plan moved a rank from rollout to trainer
    last_pressure: int = 0  # Plan.pressure of the previous boundary (-1, 0, +1)
    since_move: int = 1 << 30  # boundaries since the partition last changed
    rollout_idle_frac: float = 0.0  # share of the last step rollout GPUs computed nothing
    last_step_s: float = 0.0  # the last step's duration, s (0: use t_step_s)
    move_cost_s: float = 0.0  # seconds a one-rank move costs (switch + reshard; perf model)
    eval_ranks_out: int = 0  # trainer ranks lent to rollout for an evaluation, not returned
    # rollout's decode as the perf model sees it: mean running sequences per rank while
    # decoding, their mean context, the largest batch a rank holds (KV pool, max_num_seqs)
    # and the decode curve; without a curve rollout time is taken to scale with 1 / ranks
    decode_batch: float = 0.0
    decode_ctx: float = 0.0
    max_batch: float = 0.0
    decode_curve: DecodeCurve | None = None
    dropped_groups: int = 0  # groups the last step dropped as stale (supply came too late)
    trial: Trial = Trial()  # the previous plan's Plan.trial
    # generated tokens the trainer consumed per step over last_step_s's and t_step_s's
    # windows (0: not reported; trials then compare seconds per step)
    last_step_tokens: float = 0.0
    mean_step_tokens: float = 0.0

    def __post_init__(self) -> None:
        if min(self.ras_mb, self.ready_groups, self.mb_per_step, self.prev_batch) < 0:
            raise ValueError("Signals counts must be >= 0")
        if min(self.tprm_s, self.hol_s, self.t_step_s) < 0:
            raise ValueError("Signals times must be >= 0")
        if not (0 <= self.twt_frac <= 1 and 0 <= self.rwt_frac <= 1):
            raise ValueError("Signals.twt_frac and rwt_frac must be in [0, 1]")
        if not 0 <= self.rollout_idle_frac <= 1:
            raise ValueError("Signals.rollout_idle_frac must be in [0, 1]")
        if min(self.last_step_tokens, self.mean_step_tokens) < 0:
            raise ValueError("Signals.last_step_tokens and mean_step_tokens must be >= 0")
        if min(self.last_step_s, self.move_cost_s, self.eval_ranks_out) < 0:
            raise ValueError("Signals.last_step_s, move_cost_s, eval_ranks_out must be >= 0")
        if min(self.decode_batch, self.decode_ctx, self.max_batch, self.dropped_groups) < 0:
            raise ValueError("Signals decode_batch, decode_ctx, max_batch, dropped_groups >= 0")
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
    # this boundary's deficit: +1 consumption, -1 generation, 0 none. Boundaries whose
    # signals an evaluation spoils carry the last one on, so hysteresis compares the
    # boundaries before and after the evaluation instead of never seeing two in a row
    pressure: int = 0
    trial: Trial = Trial()  # hand back in the next Signals.trial
    eval_ranks_out: int = 0  # ranks still lent for an evaluation: next Signals.eval_ranks_out
    # True: the partition changes only to lend an evaluation its rank or to hand it back.
    # Callers leave Signals.since_move running then: the settling window already covers
    # the evaluation's steps, and with evaluations every ``cooldown + 3`` steps or fewer a
    # loan counted as a move kept every trial "measuring" for the whole run (family
    # members m02 and m06: evaluations every 5 steps, ERS froze after its first move).
    loan_move: bool = False


def initial(total: int, cfg: ErsConfig) -> Partition:
    """Cold start: the largest rollout the trainer's minimum allows (preemptive generation)."""
    actor = cfg.smallest_actor
    if total < actor + cfg.min_rollout:
        raise ValueError(f"{total} ranks cannot hold an actor of {actor} and "
                         f"{cfg.min_rollout} rollout rank(s)")
    return Partition(rollout=total - actor, actor=actor)


def _to_rollout(p: Partition, cfg: ErsConfig) -> Partition:
    if p.ref > 0:
        ref = cfg.ref_size(p.ref, grow=False)
        if ref is not None:
            return replace(p, rollout=p.rollout + p.ref - ref, ref=ref)
    actor = cfg.actor_size(p.actor, grow=False)
    if actor is not None:
        return replace(p, rollout=p.rollout + p.actor - actor, actor=actor)
    return p


def _grow_actor(p: Partition, cfg: ErsConfig) -> Partition:
    actor = cfg.actor_size(p.actor, grow=True)
    if actor is None or p.rollout - (actor - p.actor) < cfg.min_rollout:
        return p
    return replace(p, rollout=p.rollout - (actor - p.actor), actor=actor)


def _to_trainer(p: Partition, cfg: ErsConfig, costs: Ra2pCosts, decoupled: bool) -> Partition:
    if p.rollout <= cfg.min_rollout:
        return p
    # A Ref rank while a worthwhile decoupled pipeline would be Ref-bound; else an Actor rank.
    ref_bound = p.ref == 0 or costs.w_ref / p.ref > costs.w_act / p.actor
    if decoupled and ref_bound:
        ref = cfg.ref_size(p.ref, grow=True)
        if ref is not None and p.rollout - (ref - p.ref) >= cfg.min_rollout:
            return replace(p, rollout=p.rollout - (ref - p.ref), ref=ref)
    return _grow_actor(p, cfg)


def balanced(costs: Ra2pCosts, extra: int = 0) -> Ra2pCosts:
    """The trainer's GPUs (plus ``extra``) split for a decoupled pipeline by cost share."""
    gpus = costs.n_actor + costs.n_ref + extra
    n_ref = max(1, round(gpus * costs.w_ref / (costs.w_ref + costs.w_act)))
    if n_ref >= gpus:
        return costs
    return replace(costs, n_actor=gpus - n_ref, n_ref=n_ref)


def _mode_for(p: Partition, want: Mode) -> Mode:
    return want if (want is Mode.COLOCATED or p.ref > 0) else Mode.COLOCATED


def rollout_scale(s: Signals, ranks: int, new_ranks: int) -> float:
    """Factor on rollout's busy time when ``ranks`` become ``new_ranks`` with the same
    sequences in flight. Decode: each rank's batch becomes ``b * ranks / new_ranks`` (capped
    at ``max_batch``); a rank's iterations then take ``t_iter(b')`` for ``b'`` tokens, so
    the busy time scales by ``t_iter(b') * b * ranks / (t_iter(b) * b' * new_ranks)``."""
    if new_ranks <= 0:
        return float("inf")
    c, b = s.decode_curve, s.decode_batch
    if c is None or b < 1:
        return ranks / new_ranks
    b_new = b * ranks / new_ranks
    if s.max_batch >= 1:
        b_new = min(b_new, s.max_batch)

    def t_iter(batch: float) -> float:
        return max(c.a + c.b * batch * s.decode_ctx, c.c * batch) + c.ovh

    return t_iter(b_new) * b * ranks / (t_iter(b) * b_new * new_ranks)


def predicted_step_s(s: Signals, p: Partition, nxt: Partition) -> float:
    """The perf model's step time for ``nxt`` from the last step measured on ``p``: trainer
    work scales with 1 / its ranks, rollout's by :func:`rollout_scale`."""
    step = s.last_step_s or s.t_step_s
    trainer_busy = step * (1 - s.twt_frac) * p.trainer / nxt.trainer
    rollout_busy = step * (1 - s.rollout_idle_frac) * rollout_scale(s, p.rollout, nxt.rollout)
    return max(trainer_busy, rollout_busy)


def _mode_at(s: Signals, costs: Ra2pCosts, part: Partition, n_mb: int) -> Mode:
    """The RA2P mode the perf model picks for the trainer of ``part``."""
    sized = replace(costs, n_actor=part.actor, n_ref=part.ref)
    return _mode_for(part, ra2p.choose_mode(s.ras_mb, s.tprm_s, sized, n_mb))


def _probe_target(p: Partition, cfg: ErsConfig, costs: Ra2pCosts, decoupled: bool,
                  share: float) -> Partition:
    """The partition a probe tries: ranks to the trainer while they add at most ``share``
    of its capacity (``p`` itself when even one rank adds more)."""
    nxt = p
    while True:
        grown = _to_trainer(nxt, cfg, costs, decoupled)
        if grown == nxt or 1 - p.trainer / grown.trainer > share:
            return nxt
        nxt = grown


def plan(signals: Signals, partition: Partition, cfg: ErsConfig) -> Plan:
    """The next partition (one move), RA2P mode and batch; see module doc."""
    s, p = signals, partition
    trial = s.trial.aged()
    if s.eval_phase:
        trial = replace(trial, since_eval=0)
    if s.eval_phase and s.eval_ranks_out == 0:
        nxt = _to_rollout(p, cfg)
        why = "preemptive generation: evaluation phase"
        return Plan(nxt, Mode.COLOCATED, cfg.b_ideal, False, why, s.last_pressure, trial,
                    moved(p, nxt), loan_move=True)
    costs = replace(s.costs, n_actor=p.actor, n_ref=p.ref)
    n_mb = max(1, s.mb_per_step)
    waited = s.twt_frac > cfg.theta  # the trainer waited for data: rollout keeps its ranks
    lent = s.eval_ranks_out
    if not s.eval_phase and lent:
        # The rank returns even if the trainer waits: after an evaluation the wait is
        # likely the evaluation's own tail. Holding the loan until the trainer stopped
        # waiting froze ERS (a trial measuring for 70 steps on a family member, m05);
        # keeping the rank in rollout instead ratcheted rollout up by a rank an evaluation
        # (m07: 8 -> 12 of 16 GPUs, 0.94 of the best fixed split; m06 0.95).
        nxt = _grow_actor(p, cfg)
        if nxt != p:
            return Plan(nxt, _mode_at(s, costs, nxt, n_mb), cfg.b_ideal, False,
                        "evaluation over: its rank returns", s.last_pressure, trial,
                        loan_move=True)
        # The trainer cannot grow: the loan ends where the rank is.
        lent = 0

    step = s.last_step_s or s.t_step_s
    worth = s.move_cost_s / cfg.cooldown  # a move must save this much per step
    # Trials compare the cost of a generated token consumed (the inverse of goodput) when
    # the caller reports tokens: under drift (responses growing over training) every step
    # gets slower whatever the partition, which raw step times would count against a move.
    per_token = s.last_step_tokens > 0 and s.mean_step_tokens > 0
    cost_now = step / s.last_step_tokens if per_token else step
    # The step the evaluation ran in and the next one (the pipeline refills after the
    # anchored evaluation) say nothing about the partition: no rule reads a window of
    # signals (the last `cooldown` steps) that holds either of them. An evaluation phase is
    # always settling (since_eval is 0), and only during one does a loan get past here.
    settling = trial.since_eval <= cfg.cooldown + 1
    if trial.origin is not None:
        if settling or s.since_move <= cfg.cooldown or step <= 0:
            return Plan(p, _mode_at(s, costs, p, n_mb), cfg.b_ideal, False,
                        "trial: measuring", s.last_pressure if settling else 0, trial, lent)
        saved = trial.base_cost - cost_now
        margin = worth * max(1, moved(trial.origin, p)) * (cost_now / step)
        if (saved >= -margin) if trial.predicted else (saved > margin):
            trial = trial.settled()  # the move stands: keep it and plan on from here
        else:
            undo = trial.origin
            if (undo.total != p.total or undo.actor < cfg.smallest_actor
                    or undo.rollout < cfg.min_rollout
                    or (undo.rollout < p.rollout and waited)):  # never from a waiting trainer
                undo = p
            why = (f"trial reverted: {1 / cost_now:,.0f} tok/s against "
                   f"{1 / trial.base_cost:,.0f} before the move" if per_token else
                   f"trial reverted: {step:.1f} s a step against {trial.base_cost:.1f} s "
                   "before the move")
            return Plan(undo, _mode_at(s, costs, undo, n_mb), cfg.b_ideal, False, why,
                        trial=trial.reverted(), eval_ranks_out=lent)

    even = ra2p.break_even_ras(balanced(costs, extra=1), costs, s.tprm_s, n_mb)
    decoupled_pays = even is not None and s.ras_mb >= max(1, even)
    now = predicted_step_s(s, p, p) if step > 0 else 0.0
    # the step a trial is judged against: the better of the short and the longer window, so
    # one slow step (an evaluation, a move's delay) does not make a move look like a gain
    mean_cost = s.t_step_s / s.mean_step_tokens if per_token else s.t_step_s
    base = min(x for x in (cost_now, mean_cost) if x > 0) if step > 0 else 0.0

    # Groups dropped as stale mean supply came late only when rollout had no spare time; a
    # throttled rollout (idle > theta) with a trainer that never waited drops groups that
    # aged waiting for the trainer (measured on a family member, text-7b 32 GPUs with
    # response growth: TWT 0.02, rollout idle 0.10-0.28, ~9 drops a step, and the old
    # reading kept rollout at 22 of 32 GPUs for 30 steps at 0.85 of the best fixed split).
    late = s.dropped_groups > 0 and s.rollout_idle_frac <= cfg.theta
    if settling:
        return Plan(p, _mode_at(s, costs, p, n_mb), cfg.b_ideal, False,
                    "evaluation: signals settling", s.last_pressure, trial, lent)
    may_grow_trainer = (not waited and not late and p.rollout > cfg.min_rollout and step > 0
                        and not trial.backed_off(1, cfg))
    if may_grow_trainer:
        nxt = _to_trainer(p, cfg, costs, decoupled=decoupled_pays)
        gain = now - predicted_step_s(s, p, nxt) if nxt != p else 0.0
        if gain > worth * max(1, moved(p, nxt)):
            if s.last_pressure != 1 or s.since_move < cfg.cooldown:
                nxt = p  # hysteresis: the deficit must persist
            on_trial = trial.started(p, 1, base, predicted=True) if nxt != p else trial
            return Plan(nxt, _mode_at(s, costs, nxt, n_mb), cfg.b_ideal, False,
                        "consumption deficit", 1, on_trial, lent)

    if waited and s.rollout_scaled_down:
        batch = max(cfg.b_min, (s.prev_batch + cfg.b_min) // 2)
        return Plan(p, Mode.COLOCATED, batch, True,
                    "generation deficit: retain after scale-down", -1, trial, lent)
    rollout_busy = s.rollout_idle_frac <= cfg.theta  # more ranks make a busy rollout faster
    if waited and rollout_busy and step > 0 and not trial.backed_off(-1, cfg):
        nxt = _to_rollout(p, cfg)
        gain = now - predicted_step_s(s, p, nxt) if nxt != p else 0.0
        if gain > worth * max(1, moved(p, nxt)):
            if s.last_pressure != -1 or s.since_move < cfg.cooldown:
                nxt = p
            on_trial = trial.started(p, -1, base, predicted=True) if nxt != p else trial
            return Plan(nxt, Mode.COLOCATED, cfg.b_ideal, False, "generation deficit", -1,
                        on_trial, lent)

    # Probe: neither side waited (rollout busy too; an idle rollout is the consumption
    # rule's case), so the signals cannot tell a trainer-bound step from a rollout paced by
    # the staleness quota. Try ranks on the trainer when the perf model says it costs
    # rollout relatively less time than it saves the trainer (a paced rollout decodes at a
    # small batch, where a rank fewer hardly slows it), and let the measured step decide
    # (the trial above reverts it). Stale drops do not stop a probe then: they are
    # stragglers that a rank more or less hardly changes.
    may_probe = (not waited and rollout_busy and p.rollout > cfg.min_rollout and step > 0
                 and s.since_move > cfg.cooldown
                 and not trial.backed_off(1, cfg))
    if may_probe:
        share = cfg.theta * 2 ** min(trial.kept_probes, cfg.probe_doublings)
        nxt = _probe_target(p, cfg, costs, decoupled_pays, share)
        # A probe moves about theta of the trainer's time (doubling after each kept probe,
        # up to probe_doublings times): enough to stand out of the
        # step-to-step noise it is judged against (one GPU of a 40-GPU trainer is 2.4%, less
        # than that noise), and little to lose while it is measured. Where one rank is more
        # than theta (a 5-rank trainer on 8 GPUs) the deficit rules alone decide.
        if nxt != p and (rollout_scale(s, p.rollout, nxt.rollout) - 1
                         < 1 - p.trainer / nxt.trainer):
            what = "a rank" if moved(p, nxt) == 1 else f"{moved(p, nxt)} ranks"
            return Plan(nxt, _mode_at(s, costs, nxt, n_mb), cfg.b_ideal, False,
                        f"probe: {what} to the trainer",
                        trial=trial.started(p, 1, base, predicted=False), eval_ranks_out=lent)
    return Plan(p, _mode_at(s, costs, p, n_mb), cfg.b_ideal, False, "balanced", trial=trial,
                eval_ranks_out=lent)

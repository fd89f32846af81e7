"""Partition, ERS plans and BiDiRL borrowing, applied to the simulated cluster.

:class:`Elastic` owns which GPU plays which role. At start it builds the initial partition
(fixed ratio, the static planner, or ERS's cold-start maximum rollout). At every
post-update boundary :meth:`plan` returns the trainer mode and batch for the next step,
asking :func:`tidejax.sched.ers.plan` when ERS is on and carrying out its (at most one) rank
move: a closing rollout rank's tasks are re-homed by the admission policy, a freed trainer
GPU opens as an empty rollout rank; moving an Actor rank re-shards the train state. With
borrowing on, :meth:`on_tick` asks :func:`tidejax.sched.borrowing.decide` at bubbles.
"""

from __future__ import annotations

import math
from dataclasses import replace

from tidejax.sched import borrowing, ers, planner, ra2p
from tidejax.sched.borrowing import BorrowState, Direction
from tidejax.sched.ers import ErsConfig, Partition, Signals
from tidejax.sim import workload as wl
from tidejax.sim.metrics import overlap


class Elastic:
    def __init__(self, cl) -> None:
        self.cl = cl
        sys, cfg, cost = cl.sys, cl.cfg, cl.cost
        total = cfg.n_gpus
        min_actor = cost.min_train_gpus
        self.ers_cfg = ErsConfig(
            b_min=cl.spec.b_min_groups,
            b_ideal=cl.spec.batch_groups,
            min_rollout=1,
            min_actor=min_actor,
            tau=cfg.ers_tau,
        )
        self.plan_choice = None
        if sys.planner:
            prof = wl.profile(cl.spec, cfg.staleness_bound)
            self.plan_choice = planner.initial_partition(cl.model, cl.hw, prof, total)
            n_roll = self.plan_choice.rollout_gpus
            self.part = Partition(rollout=n_roll, actor=total - n_roll)
        else:
            n_roll = min(total - min_actor, max(1, round(sys.rollout_fraction * total)))
            self.part = Partition(rollout=n_roll, actor=total - n_roll)
        self.fixed_mode = {"batch": "batch", "stream": "stream", "ra2p": "colocated"}[sys.trainer]
        self.to_trainer_last = False
        self.lent: list[tuple[int, ...]] = []  # rollout GPUs lent to the trainer this step
        self.trainer_lent_until: float | None = None
        self.borrows = {"to_train": 0, "to_rollout": 0}
        # what borrowing was offered: bubbles seen per direction, the longest predicted window
        self.borrow_checks = {"to_train": 0, "to_rollout": 0, "max_train_win": 0.0}
        self.borrow_checks["max_rollout_win"] = 0.0
        self.boot: list = []  # ERS cold-start ranks on trainer GPUs
        self._lent_ranks: list = []  # rollout ranks opened on lent trainer GPUs
        self._lend_token = 0
        self._pressure = 0  # ERS plan pressure at the previous boundary
        self._since_move = 1 << 30  # boundaries since ERS last moved a rank
        self._trial = ers.Trial()  # the move ERS is measuring, handed back at each plan
        # (time, trainer busy GPU-seconds) at recent boundaries: ERS reads its wait shares
        # over the last `cooldown` steps, the span a move must pay over (a one-step pipeline
        # alternates full and empty steps, so one step alone reads as noise)
        self._busy_marks: list[tuple[float, float]] = [(0.0, 0.0)]
        self._last_rwt = 0.0
        self._last_idle = 0.0  # rollout idle share (any reason) of the last step
        self.eval_out = 0  # trainer ranks ERS lent to rollout for the current evaluation
        self._dropped_mark = 0  # cl.dropped_groups at the last plan
        self._decode_mark: dict[int, tuple[int, int, float]] = {}  # rank -> counters at plan

    # ------------------------------------------------------------------ start
    def begin(self, t: float) -> None:
        cl, p = self.cl, self.part
        gpus = list(range(cl.cfg.n_gpus))
        for g in gpus[: p.rollout]:
            cl.open_rank((g,), t)
        tr = cl.trainer
        tr.actor = gpus[p.rollout : p.rollout + p.actor]
        tr.ref = gpus[p.rollout + p.actor :]
        cl.ledger.set_role(tr.actor, t, "actor")
        cl.ledger.set_role(tr.ref, t, "ref")
        if cl.sys.ers:
            self._bootstrap(t)
        cl.push(t, cl._start_step, self.fixed_mode, cl.spec.batch_groups)

    def _bootstrap(self, t: float) -> None:
        """ERS cold start: until ``B_min`` groups are ready the trainer has nothing to do, so
        its GPUs beyond the minimum serve rollout (preemptive maximum rollout)."""
        cl, tr = self.cl, self.cl.trainer
        peak = ers.initial(self.part.total, self.ers_cfg)
        spare = tr.actor[peak.actor :]
        self.boot = [cl.open_rank((g,), t) for g in spare]
        if self.boot:
            tr.blocked_until = math.inf

    def on_ready(self, t: float) -> None:
        """A training group became ready: end the cold-start bootstrap once B_min are."""
        cl = self.cl
        if not self.boot or len(cl.trainer.buffer) < self.ers_cfg.b_min:
            return
        cl.push(t, self._end_bootstrap, t)  # not inside a rank's turn-end loop

    def _end_bootstrap(self, t: float) -> None:
        cl = self.cl
        if not self.boot:
            return
        c_out = cl.cfg.switch.c_out
        for r in self.boot:
            cl.close_rank(r, t)
            cl.ledger.add(r.gpus, t, t + c_out, "switch")
            cl.ledger.set_role(r.gpus, t + c_out, "actor")
        self.boot = []
        cl.push(t + c_out, cl.trainer.unblock, t + c_out)

    # -------------------------------------------------------------- boundary
    def plan(self, t: float) -> tuple[str, int, float]:
        """Mode, batch (groups) and extra start delay for the next step; applies moves."""
        cl = self.cl
        delay = self._return_lent(t)
        if not cl.sys.ers:
            if cl.sys.trainer != "ra2p":
                return self.fixed_mode, cl.spec.batch_groups, delay
            s = self._signals(t)  # RA2P alone: pick the mode for the fixed partition
            costs = replace(s.costs, n_actor=self.part.actor, n_ref=self.part.ref)
            mode = ra2p.choose_mode(s.ras_mb, s.tprm_s, costs, s.mb_per_step)
            return mode.value, cl.spec.batch_groups, delay
        signals = self._signals(t)
        plan = ers.plan(signals, self.part, self.ers_cfg)
        self._pressure = plan.pressure
        self._since_move = ers.since_move_after(self._since_move, self.part, plan)
        if self.trainer_lent_until is None:  # no moves while trainer GPUs are lent out
            self._trial, self.eval_out = plan.trial, plan.eval_ranks_out
            delay = max(delay, self._apply(plan.partition, t))
        elif plan.mode.value == "decoupled" and not cl.trainer.ref:
            plan = replace(plan, mode=ers.Mode.COLOCATED)
        cl.plans.append(
            {
                "step": cl.steps_done,
                "t": round(t, 2),
                "reason": plan.reason,
                "mode": plan.mode.value,
                "batch": plan.batch_groups,
                "rollout": self.part.rollout,
                "actor": self.part.actor,
                "ref": self.part.ref,
                "ras": signals.ras_mb,
                "ready": signals.ready_groups,
                "hol": round(signals.hol_s, 1),
                "t_step": round(signals.t_step_s, 1),
                "tprm": round(signals.tprm_s, 2),
                "mb_per_step": signals.mb_per_step,
                "rwt": round(self._last_rwt, 2),
                "idle": round(self._last_idle, 2),
                "twt": round(signals.twt_frac, 2),
            }
        )
        return plan.mode.value, plan.batch_groups, delay

    def _signals(self, t: float) -> Signals:
        cl, tr = self.cl, self.cl.trainer
        too_old = cl.version - cl.cfg.staleness_bound
        ready = [g for g in tr.ready_groups() if g.version >= too_old]
        mb = tr.mb_global
        ready_tokens = sum(g.train_tokens for g in ready)
        per_group = cl.consumed_tokens / max(1, len(cl.stale))
        sq_per_token = sum(g.train_sq for g in tr.step_groups) / max(
            1, sum(g.train_tokens for g in tr.step_groups)
        )
        marks = cl.step_marks
        tail = marks[-6:]  # the last five steps
        recent = [b - a for a, b in zip(tail, tail[1:])]
        rwt, twt, idle = self._waits(t)
        dropped_mark, self._dropped_mark = self._dropped_mark, cl.dropped_groups
        self._last_rwt, self._last_idle = rwt, idle
        cost = cl.cost
        move = cost.ers_switch(to_rollout=False) + cost.reshard(len(tr.actor) + 1)
        return Signals(
            twt_frac=twt,
            rwt_frac=rwt,
            ras_mb=int(ready_tokens // mb),
            ready_groups=len(ready),
            tprm_s=tr.tprm(),
            hol_s=(t - min(g.ready_t for g in ready)) if ready else 0.0,
            t_step_s=sum(recent) / len(recent) if recent else 0.0,
            mb_per_step=max(1, math.ceil(cl.spec.batch_groups * per_group / mb)),
            costs=tr.ra2p_costs(mb, mb * sq_per_token),
            prev_batch=len(tr.step_groups),
            eval_phase=cl.eval_left > 0 or cl._eval_due(),
            rollout_scaled_down=self.to_trainer_last,
            last_pressure=self._pressure,
            since_move=self._since_move,
            rollout_idle_frac=idle,
            last_step_s=self._window_step_s(),
            last_step_tokens=self._window_tokens(min(self.ers_cfg.cooldown, len(marks) - 1)),
            mean_step_tokens=self._window_tokens(len(recent)),
            move_cost_s=move,
            eval_ranks_out=self.eval_out,
            dropped_groups=cl.dropped_groups - dropped_mark,
            trial=self._trial,
            **self._decode_signals(),
        )

    def _window_step_s(self) -> float:
        """Mean step time over the span the wait shares are read on."""
        marks = self.cl.step_marks
        n = min(self.ers_cfg.cooldown, len(marks) - 1)
        return (marks[-1] - marks[-1 - n]) / n if n > 0 else 0.0

    def _window_tokens(self, n: int) -> float:
        """Mean generated tokens consumed per step over the last ``n`` steps."""
        marks = self.cl.consumed_marks
        return (marks[-1] - marks[-1 - n]) / n if n > 0 else 0.0

    def _decode_signals(self) -> dict:
        """Mean decode batch per rank and mean context over the last step (perf model)."""
        cl = self.cl
        iters = tokens = 0
        ctx = 0.0
        marks = {}
        for r in cl.ranks.values():
            i0, n0, c0 = self._decode_mark.get(r.rid, (0, 0, 0.0))
            iters += r.dec_iters - i0
            tokens += r.dec_tokens - n0
            ctx += r.dec_ctx - c0
            marks[r.rid] = (r.dec_iters, r.dec_tokens, r.dec_ctx)
        self._decode_mark = marks
        if not iters or not tokens:
            return {}
        mean_ctx = ctx / tokens
        cost = cl.cost
        cap = cost.kv_pages * cost.page_size
        return {
            "decode_batch": tokens / iters,
            "decode_ctx": mean_ctx,
            "max_batch": min(cost.max_running, cap / max(mean_ctx, 1.0)),
            "decode_curve": cost.curve,
        }

    def _waits(self, t: float) -> tuple[float, float, float]:
        """Shares of the last step that rollout idled throttled (RWT), trainer idled (TWT),
        rollout idled for any reason."""
        cl, tr = self.cl, self.cl.trainer
        busy = sum(cl.ledger.totals.get(k, 0.0) for k in ("ref", "actor", "swap"))
        marks = self._busy_marks
        a, busy_a = marks[max(0, len(marks) - self.ers_cfg.cooldown)]
        marks.append((t, busy))
        del marks[: -self.ers_cfg.cooldown - 1]
        dt = t - a
        if dt <= 0:
            return 0.0, 0.0, 0.0
        n_tr = len(tr.actor) + len(tr.ref)
        twt = 1.0 - (busy - busy_a) / (n_tr * dt) if n_tr else 0.0
        windows = [(max(x, a), min(y, t)) for x, y in cl.throttle if y > a]
        if cl.throttled_since is not None:
            windows.append((max(cl.throttled_since, a), t))
        idle = throttled = 0.0
        for r in cl.ranks.values():
            ivs = [(max(x, a), y) for x, y in reversed(r.idle[-64:]) if y > a]
            if r.idle_since is not None:
                ivs.append((max(r.idle_since, a), t))
            throttled += overlap(ivs, windows) * len(r.gpus)
            idle += sum(y - x for x, y in ivs) * len(r.gpus)
        n_roll = sum(len(r.gpus) for r in cl.ranks.values())
        rwt = throttled / (n_roll * dt) if n_roll else 0.0
        idle = idle / (n_roll * dt) if n_roll else 0.0

        def clip(x: float) -> float:
            return min(1.0, max(0.0, x))

        return clip(rwt), clip(twt), clip(idle)

    def _apply(self, nxt: Partition, t: float) -> float:
        """Carry out a plan's move (one rank, or several for a probe and its revert); the
        ranks switch together, and the actor re-shards once."""
        cl, tr, cost, led = self.cl, self.cl.trainer, self.cl.cost, self.cl.ledger
        old, self.part = self.part, nxt
        self.to_trainer_last = nxt.rollout < old.rollout
        if ers.moved(old, nxt) == 0:
            return 0.0
        if nxt.rollout < old.rollout:  # rollout ranks join the trainer
            sw = cost.ers_switch(to_rollout=False)
            to_ref = nxt.ref - old.ref
            for i in range(old.rollout - nxt.rollout):
                r = min(cl.ranks.values(),
                        key=lambda r: (len(r.resident) + r.assigned, r.used, r.rid))
                cl.close_rank(r, t)
                led.add(r.gpus, t, t + sw, "switch")
                role = "ref" if i < to_ref else "actor"
                (tr.ref if role == "ref" else tr.actor).extend(r.gpus)
                led.set_role(r.gpus, t, role)
            return sw + (self._reshard(t + sw) if nxt.actor > old.actor else 0.0)
        sw = cost.ers_switch(to_rollout=True)  # trainer ranks go to rollout
        from_ref = old.ref - nxt.ref
        for i in range(nxt.rollout - old.rollout):
            gpu = tr.ref.pop() if i < from_ref else tr.actor.pop()
            led.add((gpu,), t, t + sw, "switch")
            r = cl.open_rank((gpu,), t)
            r.t0 = t + sw
            r.idle_since = r.t0
        return self._reshard(t) if nxt.actor < old.actor else 0.0

    def _reshard(self, t: float) -> float:
        tr = self.cl.trainer
        dt = self.cl.cost.reshard(len(tr.actor))
        self.cl.ledger.add(tr.actor, t, t + dt, "switch")
        return dt

    # -------------------------------------------------------------- borrowing
    def on_tick(self, t: float) -> None:
        cl = self.cl
        if not cl.sys.borrowing or cl.finished or self.trainer_lent_until is not None:
            return
        if self.boot:  # the cold-start bootstrap already gives trainer GPUs to rollout
            return
        tr = cl.trainer
        sw = cl.cfg.switch.borrowing()
        busy = tr.in_step and (tr.free_at > t or bool(tr.mbs))
        waiting = (tr.in_step and not busy and tr.taken < tr.need) or (
            cl.waiting_eval_since is not None
        )
        idle_r = []
        if busy and not self.lent and cl.outstanding >= cl.quota:
            idle_r = [
                r
                for r in cl.ranks.values()
                if r.open
                and r.B == 0
                and not r.queue
                and not r.resident
                and not r.assigned
                and r.t0 <= t
            ]
            idle_r = idle_r[: max(0, len(cl.ranks) - 1)]
        n_train = len(tr.actor) + len(tr.ref)
        state = BorrowState(
            n_rollout=len(cl.ranks),
            n_train=n_train,
            idle_train=n_train if waiting else 0,
            idle_rollout=len(idle_r),
            rollout_window_s=self._rollout_window(t) if waiting else 0.0,
            train_window_s=self._train_window(t) if idle_r else 0.0,
            # more rollout ranks help only if there is work to admit: quota left, or evals
            rollout_scalable=cl.outstanding < cl.quota or cl.eval_left > 0,
            rollout_utilisation=self._rollout_utilisation(),
        )
        chk = self.borrow_checks
        if state.idle_train:
            chk["to_rollout"] += 1
            chk["max_rollout_win"] = max(chk["max_rollout_win"], round(state.rollout_window_s, 1))
        if state.idle_rollout:
            chk["to_train"] += 1
            chk["max_train_win"] = max(chk["max_train_win"], round(state.train_window_s, 1))
        b = borrowing.decide(state, sw)
        if b is None:
            return
        if b.direction is Direction.TO_TRAIN:
            self._lend_to_trainer(idle_r[: b.ranks], t)
        else:
            self._lend_to_rollout(t, b.window_s)

    def _rollout_utilisation(self) -> float:
        cl = self.cl
        if not cl.ranks:
            return 0.0
        cap = cl.cost.max_running
        paused = len(getattr(cl.driver, "paused", ()))
        load = sum(min(cap, r.B + len(r.queue)) for r in cl.ranks.values()) + paused
        return min(1.0, load / (cap * len(cl.ranks)))

    def _rollout_window(self, t: float) -> float:
        cl, tr = self.cl, self.cl.trainer
        times = cl.done_times
        if len(times) < 4 or times[-1] <= times[0]:
            return 0.0
        rate = (len(times) - 1) / (times[-1] - times[0])
        if cl.waiting_eval_since is not None:
            return cl.eval_left / max(rate, 1e-9)
        need = tr.need - tr.taken if tr.mode == "batch" else 1
        return need / max(rate, 1e-9)

    def _train_window(self, t: float) -> float:
        cl, tr = self.cl, self.cl.trainer
        per_group = cl.consumed_tokens / max(1, len(cl.stale)) or 1.0
        left = (tr.need - tr.taken) * per_group + sum(m[0] for m in tr.mbs)
        n = max(1, len(tr.actor))
        work = cl.cost.train(left, left * 4096, n) + cl.cost.ref(left, left * 4096, n)
        return max(0.0, tr.free_at - t) + work

    def _lend_to_trainer(self, ranks, t: float) -> None:
        cl, sw = self.cl, self.cl.cfg.switch
        for r in ranks:
            cl.close_rank(r, t)
            cl.ledger.add(r.gpus, t, t + sw.c_in, "switch")
            cl.ledger.set_role(r.gpus, t, "actor")
            cl.trainer.borrowed.append((t + sw.c_in, r.gpus))
            self.lent.append(r.gpus)
        self.borrows["to_train"] += 1

    def _return_lent(self, t: float) -> float:
        """At the boundary: lent rollout GPUs go back (c_out); the step paid c_grad."""
        if not self.lent:
            return 0.0
        cl, sw = self.cl, self.cl.cfg.switch
        for gpus in self.lent:
            cl.ledger.add(gpus, t, t + sw.c_out, "switch")
            r = cl.open_rank(gpus, t)
            r.t0 = t + sw.c_out
            r.idle_since = r.t0
        self.lent = []
        cl.trainer.borrowed = []
        return sw.c_grad

    def _lend_to_rollout(self, t: float, window: float) -> None:
        cl, tr, sw = self.cl, self.cl.trainer, self.cl.cfg.switch
        gpus = list(tr.actor) + list(tr.ref)
        until = t + window
        self.trainer_lent_until = until
        tr.blocked_until = until
        tr.on_blocked_work = self.recall_early
        self._lent_ranks = []
        for g in gpus:
            cl.ledger.add((g,), t, t + sw.c_in, "switch")
            r = cl.open_rank((g,), t)
            r.t0 = t + sw.c_in
            r.idle_since = r.t0
            self._lent_ranks.append(r)
        self._lend_token += 1
        cl.push(until - sw.c_out, self._recall, self._lend_token)
        self.borrows["to_rollout"] += 1

    def recall_early(self, t: float) -> None:
        """The trainer has work before the predicted window ended: take the GPUs back now."""
        if self.trainer_lent_until is None:
            return
        self._lend_token += 1
        self._recall(self._lend_token)

    def _recall(self, token: int) -> None:
        if token != self._lend_token or self.trainer_lent_until is None:
            return
        cl, tr = self.cl, self.cl.trainer
        t = cl.now
        until = t + cl.cfg.switch.c_out
        for r in self._lent_ranks:
            if cl.ranks.get(r.rid) is r:
                cl.close_rank(r, t)
            cl.ledger.add(r.gpus, t, until, "switch")
        cl.ledger.set_role(tr.actor, until, "actor")
        cl.ledger.set_role(tr.ref, until, "ref")
        self._lent_ranks = []
        self.trainer_lent_until = None
        tr.blocked_until = until
        tr.on_blocked_work = None
        cl.push(until, tr.unblock, until)

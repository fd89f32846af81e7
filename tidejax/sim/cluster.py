"""The discrete-event cluster: a virtual clock, an event heap, tasks, groups, steps.

One event per turn end, per environment answer, per trainer burst and per scheduling tick;
decode is advanced in closed form between them (:mod:`tidejax.sim.rollout`). Admission is
delegated to a driver that calls the pure policies (:mod:`tidejax.sim.admission`), the
trainer runs its mode (:mod:`tidejax.sim.trainer`), and ERS / BiDiRL decisions are applied
at the post-update boundary or at bubbles (:mod:`tidejax.sim.elastic`).

Asynchronous systems: after each update the trainer broadcasts weights (``t_sync``); every
rollout rank stalls for it and flushes its KV cache (new weights invalidate it); running
sequences re-prefill their context. Evaluation tasks for version ``v`` start after the sync
of ``v`` and must finish before the next sync (anchored weights; ``SimConfig.anchored_eval``
lets the sync go ahead instead). A group more than the
staleness bound behind the trainer when the trainer takes it is dropped and counted, as the
runtime's ``GlobalBuffer`` does (in-flight groups are not aborted early). The admission
quota counts the weights rollout holds (:attr:`Cluster.quota`): while an evaluation delays
the sync, the slots the update returned are not refilled with groups on the old weights.
Synchronous systems (veRL-like) run the batch to its last trajectory on all GPUs, then
train on all GPUs.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from tidejax.sched import perf, staleness
from tidejax.sched.perf import HardwareSpec, ModelSpec
from tidejax.sim import workload as wl
from tidejax.sim.admission import CtbDriver, RequestDriver
from tidejax.sim.config import SimConfig, SystemSpec
from tidejax.sim.costs import CostModel
from tidejax.sim.metrics import Ledger
from tidejax.sim.rollout import Rank, SimTask
from tidejax.sim.sync import SyncPhases
from tidejax.sim.trainer import Trainer


class SimGroup:
    __slots__ = (
        "admitted",
        "dead",
        "done",
        "draw",
        "is_eval",
        "probe_tokens",
        "ready_t",
        "resp_tokens",
        "size",
        "started",
        "tasks",
        "train_sq",
        "train_tokens",
        "ttype",
        "uid",
        "version",
    )

    def __init__(self, uid: int, draw: wl.GroupDraw, ttype: wl.TaskType) -> None:
        self.uid = uid
        self.draw = draw
        self.ttype = ttype
        self.is_eval = draw.is_eval
        self.size = len(draw.trajectories)
        self.admitted = self.done = 0
        self.version = 0
        self.tasks: list[SimTask] = []
        self.probe_tokens: int | None = None
        self.started = self.dead = False
        self.ready_t = 0.0
        self.train_tokens = self.train_sq = self.resp_tokens = 0
        for tr in draw.trajectories:
            tok, sq = wl.train_tokens(ttype, draw.prompt, tr)
            self.train_tokens += tok
            self.train_sq += sq
            self.resp_tokens += sum(tr.responses)


class Cluster(SyncPhases):
    """One run of one system on one workload. ``run()`` returns a :class:`RunResult`."""

    def __init__(self, system: SystemSpec, spec: wl.WorkloadSpec, cfg: SimConfig) -> None:
        self.sys, self.spec, self.cfg = system, spec, cfg
        self.model = ModelSpec.preset(spec.model)
        self.hw = HardwareSpec.h100()
        self.cost = CostModel(self.model, self.hw, page_size=cfg.page_size, switch=cfg.switch)
        self._pf = perf.prefill_coeffs(self.model, self.hw, self.cost.tp)  # start_turn's prefill
        self.ledger = Ledger(cfg.n_gpus, cfg.bin_s)
        self.stream = wl.TaskStream(spec)
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.ranks: dict[int, Rank] = {}
        self._dirty: set[Rank] = set()  # ranks whose next event must be (re)scheduled
        self._next_rid = 0
        self.trainer = Trainer(self.cost, self.ledger, self._step_end, cfg.consume_order)
        self.trainer.events = self.push
        self.version = self.rollout_version = 0
        self.pending: deque[SimGroup] = deque()
        self.groups: dict[int, SimGroup] = {}
        self._next_group = self._next_eval = 0
        self.tasks: dict[int, SimTask] = {}
        self._next_task = 0
        self.batch_groups = spec.batch_groups
        self._full_quota = (
            spec.batch_groups
            if system.sync
            else staleness.max_outstanding(cfg.staleness_bound, spec.batch_groups)
        )
        self.outstanding = 0
        self.env_in_use = 0
        self.eval_left = 0
        self.eval_barrier = False  # sync systems: training admission waits for evaluation
        self.training_phase = False  # sync systems: no admission while the GPUs train
        self.phase_start = 0.0
        self.rollout_phase_s = 0.0  # sync systems: total time of rollout phases
        self.waiting_eval_since: float | None = None
        self.tick_pending = False
        self.last_tick = -math.inf
        self.throttled_since: float | None = None
        self.throttle: list[tuple[float, float]] = []
        self.finished = False
        self.end_t = 0.0
        self.steps_done = 0
        self.step_marks = [0.0]
        self.consumed_marks = [0]  # consumed_resp at each step mark
        self.consumed_tokens = self.consumed_resp = self.dropped_tokens = 0
        self.dropped_groups = 0
        if cfg.drop_stale and not system.sync:
            self.trainer.is_stale = self.is_stale
            self.trainer.is_due = self.is_due
            self.trainer.on_drop = self._drop
        self.stale: list[int] = []
        self.closed_counters = [0, 0]  # prompt tokens, hit tokens of ranks no longer open
        self.closed_idle: list[tuple[float, float, int]] = []  # idle intervals of closed ranks
        self.done_times: deque[float] = deque(maxlen=64)  # recent group completions
        self.plans: list[dict] = []
        self.driver = CtbDriver(self) if system.rollout == "ctb" else RequestDriver(self)
        self.elastic = None  # set by systems.build for ERS / borrowing

    @property
    def quota(self) -> int:
        """Training groups that may be outstanding now: AReaL's rule (calibration
        stale.areal_eta), ``N_submitted <= (i + eta + 1) * B`` with ``i`` the version of the
        weights rollout generates with. While rollout still holds weights older than the
        trainer's (an anchored evaluation delays the sync), every version it lags takes one
        batch off the quota: the update already returned those slots, but a group started on
        the old weights could only be consumed by fewer updates, which the groups already
        outstanding fill (measured on text-7b, 25 steps: 251 of 282 stale drops were groups
        admitted during that wait)."""
        lag = self.version - self.rollout_version
        if self.sys.sync or lag <= 0:
            return self._full_quota
        if lag > self.cfg.staleness_bound:
            return 0
        return staleness.max_outstanding(self.cfg.staleness_bound - lag, self.batch_groups)

    # ----------------------------------------------------------------- events
    def push(self, t: float, fn, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def run(self):
        from tidejax.sim.report import result_of

        self._begin()
        heap, dirty, pop, flush = self._heap, self._dirty, heapq.heappop, self._flush_dirty
        limit = self.cfg.max_sim_s
        while heap and not self.finished:
            t, _, fn, args = pop(heap)
            if t > limit:
                break
            self.now = t
            fn(*args)
            if dirty:
                flush()
        if not self.finished and self.now <= self.cfg.max_sim_s:
            raise RuntimeError(
                f"{self.sys.name}: simulation stalled at t={self.now:.1f}s after "
                f"{self.steps_done} steps (no pending events)"
            )
        if not self.finished:
            self.end_t = self.now
        return result_of(self)

    # --------------------------------------------------------------- topology
    def open_rank(self, gpus: tuple[int, ...], t: float) -> Rank:
        r = Rank(self._next_rid, gpus, self.cost, t, self.ledger)
        self._next_rid += 1
        self.ranks[r.rid] = r
        self.ledger.set_role(gpus, t, "colocated" if self.sys.sync else "rollout")
        self._want_tick(t)
        return r

    def close_rank(self, r: Rank, t: float) -> None:
        """Take a rank out of rollout: its tasks are re-homed, its cache is dropped."""
        r.open = False
        self.driver.close_rank(r, t)
        r.catch_up(t)
        r.close_idle(t)
        c = r.pool.counters()
        self.closed_counters[0] += c.prompt_tokens
        self.closed_counters[1] += c.hit_tokens
        self.closed_idle.extend((a, b, len(r.gpus)) for a, b in r.idle)
        del self.ranks[r.rid]
        self._want_tick(t)

    # ------------------------------------------------------------------- tasks
    def _fill_pending(self) -> None:
        fresh = sum(1 for g in self.pending if not g.started and not g.is_eval)
        want = max(0, self.quota - self.outstanding) + 4
        while fresh < want:
            draw = self.stream.group(self._next_group)
            self._next_group += 1
            self._add_group(draw, front=False)
            fresh += 1

    def _add_group(self, draw: wl.GroupDraw, front: bool) -> SimGroup:
        uid = len(self.groups)
        g = SimGroup(uid, draw, self.spec.types[draw.type_index])
        self.groups[uid] = g
        (self.pending.appendleft if front else self.pending.append)(g)
        return g

    def new_task(self, g: SimGroup, r: Rank, t: float) -> SimTask:
        task = SimTask(self._next_task, g, g.admitted)
        self._next_task += 1
        self.tasks[task.task_id] = task
        g.tasks.append(task)
        if g.admitted == 0:
            g.started = True
            g.version = self.rollout_version
            if not g.is_eval:
                self._outstanding(+1, t)
                if not self.sys.sync:
                    self.trainer.admit(g)
        g.admitted += 1
        if g.admitted == g.size:
            self.pending.remove(g)
        task.rank = r
        self.env_in_use += 1
        return task

    def start_turn(self, task: SimTask, r: Rank, t: float) -> None:
        """Prefill what the cache misses, reserve the response, join the decode batch."""
        keys = task.keys(task.ctx + task.resp_left, self.cost.page_size)
        cached = r.pool.allocate(task, task.ctx, keys, reserve=task.resp_left)
        n = task.ctx - cached
        recompute = max(0, n - task.new_tokens)
        if n > 0:  # = self.cost.prefill(n, cached), bit for bit (perf.prefill_coeffs)
            lin, attn, rate = self._pf
            t_pf = (lin * n + attn * n * (cached + n / 2)) / rate
            t_re = t_pf * recompute / n
        else:
            t_pf = t_re = 0.0
        task.new_tokens = 0
        r.join(task, t, t_pf, t_re)
        self.resched(r)

    def resched(self, r: Rank) -> None:
        """Mark ``r``'s next turn end for (re)scheduling once the current event is done."""
        self._dirty.add(r)

    def _flush_dirty(self) -> None:
        heap, on_rank, push = self._heap, self._on_rank, heapq.heappush
        for r in self._dirty:
            nt = r.next_event()
            if nt is not None:  # = self.push(nt, self._on_rank, r, r.stamp)
                self._seq += 1
                push(heap, (nt, self._seq, on_rank, (r, r.stamp)))
        self._dirty.clear()

    def _on_rank(self, r: Rank, stamp: int) -> None:
        if stamp != r.stamp or self.ranks.get(r.rid) is not r:
            return
        done = r.finish()
        t = r.t0
        for task in done:
            self._turn_end(task, r, t)
        self.driver.drain(r, t)
        self.resched(r)

    def _turn_end(self, task: SimTask, r: Rank, t: float) -> None:
        task.turn += 1
        g = task.group
        if g.probe_tokens is None:  # the probe's first turn measured the group's footprint
            g.probe_tokens = r.pool.pages_for(task.ctx) * self.cost.page_size
            self._want_tick(t)
        if task.turn >= task.traj.turns:
            self.driver.on_done(task, r, t)
            del self.tasks[task.task_id]
            task.rank = None
            self.env_in_use -= 1
            g.done += 1
            if g.done == g.size:
                self._group_done(g, t)
            self._want_tick(t)
            return
        self.driver.on_wait(task, r, t)
        task.ready = False
        self.push(t + task.traj.env[task.turn - 1], self._env_return, task)

    def _env_return(self, task: SimTask) -> None:
        if task.dead:
            return
        k = task.turn
        tt = task.group.ttype
        prompt = task.group.draw.prompt
        if tt.history_turns and k > tt.history_turns:
            task.ctx = wl.context_after(tt, prompt, task.traj, k)
            task.rewrite_history(self.cost.page_size)
            task.new_tokens = task.ctx - prompt  # the shifted window is new content
        else:
            obs = task.traj.obs[k - 1]
            task.ctx += obs
            task.new_tokens = obs
        task.resp_left = task.traj.responses[k]
        task.ready = True
        self.driver.on_ready(task, self.now)

    def _group_done(self, g: SimGroup, t: float) -> None:
        if g.is_eval:
            self.eval_left -= 1
            if self.eval_left == 0:
                self.eval_barrier = False
                self._want_tick(t)
                if self.waiting_eval_since is not None:
                    self.waiting_eval_since = None
                    self.push(t, self._after_update, t)  # not inside a rank's turn-end loop
            return
        g.ready_t = t
        self.done_times.append(t)
        if self.sys.sync:
            if all(x.done == x.size for x in self._step_groups()):
                self.push(t, self._sync_train_phase, t)
            return
        self.trainer.offer(g, t)
        if self.elastic is not None:
            self.elastic.on_ready(t)

    # ---------------------------------------------------------------- admission
    def _outstanding(self, delta: int, t: float) -> None:
        self.outstanding += delta
        full = self.outstanding >= self.quota
        if full and self.throttled_since is None:
            self.throttled_since = t
        elif not full and self.throttled_since is not None:
            self.throttle.append((self.throttled_since, t))
            self.throttled_since = None

    def _want_tick(self, t: float) -> None:
        if self.tick_pending:
            return
        self.tick_pending = True
        self.push(max(t, self.last_tick + self.cfg.tick_s), self._tick)

    def _tick(self) -> None:
        self.tick_pending = False
        self.last_tick = self.now
        self._fill_pending()
        self.driver.tick(self.now)
        if self.elastic is not None:
            self.elastic.on_tick(self.now)

    def admissible(self) -> list[SimGroup]:
        """Pending groups in dispatch order (eval first; training not during an eval barrier)."""
        if self.training_phase:
            return []
        return [g for g in self.pending if g.is_eval or not self.eval_barrier]

    def _start_eval(self, t: float) -> None:
        n = self.spec.eval_tasks
        for _ in range(n):
            self._add_group(self.stream.eval_group(self._next_eval), front=True)
            self._next_eval += 1
        self.eval_left += n
        self._want_tick(t)

    def _eval_due(self) -> bool:
        every = self.spec.eval_every
        return bool(every) and self.version > 0 and self.version % every == 0

    # ------------------------------------------------------------- async steps
    def _begin(self) -> None:
        if self.sys.sync:
            self._begin_sync()
            return
        self.elastic.begin(0.0)
        self._fill_pending()
        self._want_tick(0.0)

    def _step_end(self, t: float) -> None:
        """The trainer finished an update (async systems)."""
        for g in self.trainer.step_groups:
            self._consume(g)
        self.version += 1
        self._outstanding(0, t)  # the quota shrinks until the weights reach rollout
        self.steps_done += 1
        self.step_marks.append(t)
        self.consumed_marks.append(self.consumed_resp)
        self._want_tick(t)
        if self.steps_done >= self.cfg.steps:
            self.finished, self.end_t = True, t
            return
        if self.eval_left > 0 and self.cfg.anchored_eval:
            self.waiting_eval_since = t  # anchored evaluation must finish before the sync
            return
        self._after_update(t)

    def _consume(self, g: SimGroup) -> None:
        self.consumed_tokens += g.train_tokens
        self.consumed_resp += g.resp_tokens
        self.stale.append(self.version - g.version)
        self._outstanding(-1, self.now)

    def is_stale(self, g: SimGroup) -> bool:
        """The runtime's rule: more than the bound behind the trainer's version."""
        return self.version - g.version > self.cfg.staleness_bound

    def is_due(self, g: SimGroup) -> bool:
        """Stale by the next update unless this one takes it."""
        return staleness.is_due(self.version, g.version, self.cfg.staleness_bound)

    def _drop(self, g: SimGroup, t: float) -> None:
        self.dropped_groups += 1
        self.dropped_tokens += g.resp_tokens
        self._outstanding(-1, t)

    def _after_update(self, t: float) -> None:
        mode, batch, delay = self.elastic.plan(t)
        t_sync = self.cost.sync()
        self.ledger.add(self.trainer.actor + self.trainer.ref, t, t + t_sync, "sync")
        self.sync_rollout(t, t_sync)
        start = t + t_sync + delay
        if self._eval_due():
            self._start_eval(t + t_sync)
        self.push(start, self._start_step, mode, batch)

    def _start_step(self, mode: str, batch: int) -> None:
        self.trainer.start_step(self.now, mode, batch)
        if self.elastic is not None:
            self.elastic.on_tick(self.now)

    def sync_rollout(self, t: float, t_sync: float) -> None:
        """Weights v+1 reach rollout: stall, flush every cache, re-prefill running sequences."""
        self.rollout_version = self.version
        self._outstanding(0, t)  # the full quota is back: admit into it
        self._want_tick(t)
        ps = self.cost.page_size
        for r in list(self.ranks.values()):
            r.stall(t, t_sync, "sync")
            running = r.running()
            made = {task: r.generated(task) for task in running}
            r.pool.flush()
            total = 0.0
            for task in running:
                ctx_now = task.ctx + made[task]
                keys = task.keys(task.ctx + task.resp_left, ps)
                rest = task.resp_left - made[task]
                cached = r.pool.allocate(task, ctx_now, keys, reserve=rest)
                total += self.cost.prefill(ctx_now - cached, cached)
            if total:
                r.stall(r.t0, total, "recompute")
            self.driver.on_flush(r)
            self.resched(r)

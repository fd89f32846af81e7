"""Drivers that turn simulator state into policy snapshots and apply the decisions.

:class:`CtbDriver` calls :func:`tidejax.sched.ctb.decide`; :class:`RequestDriver` calls
:mod:`tidejax.sched.request_level`. Both own the per-rank bookkeeping their policy needs
(CTB: resident tasks and token footprints; request level: routed tasks and FIFO queues)
and use the ranks' page pools the same way the engine will: CTB pins a task's pages across
its environment wait, request-level serving releases them (cached, LRU-evictable).
"""

from __future__ import annotations

from tidejax.sched import ctb, request_level
from tidejax.serving.page_pool import PoolFull
from tidejax.sim.rollout import Rank, SimTask


class _Driver:
    def __init__(self, cl) -> None:
        self.cl = cl
        self.ps = cl.cost.page_size
        self.max_running = cl.cost.max_running

    def fp(self, tokens: int) -> int:
        """Token footprint rounded up to whole pages."""
        return -(-tokens // self.ps) * self.ps

    def _dequeue(self, task: SimTask, r: Rank) -> None:
        if task in r.queue:
            r.queue.remove(task)

    def _stop(self, task: SimTask, r: Rank, t: float, evict: bool) -> None:
        """Take a task off ``r``: out of the batch (mid-turn) or queue, pages dropped."""
        if task.active_entry is not None:
            r.remove(task, t)
            task.ready = True  # it was mid-turn: ready to continue elsewhere
            self.cl.resched(r)
        self._dequeue(task, r)
        if r.pool.has(task):
            (r.pool.evict if evict else r.pool.release)(task)


class CtbDriver(_Driver):
    """Task-level batching: token budgets, pinning, priority pauses, resume before admit."""

    def __init__(self, cl) -> None:
        super().__init__(cl)
        self.paused: dict[int, SimTask] = {}  # paused and ready to run
        self.cfg = ctb.CtbConfig()
        longest = max(t.prompt_tokens.p99 for t in cl.spec.types)
        self.probe_default = self.fp(int(longest) + 512)  # prompt + response cap
        self.pauses = 0

    # ----------------------------------------------------------- bookkeeping
    def _hold(self, task: SimTask, r: Rank, tokens: int) -> None:
        task.rank = r
        task.footprint = self.fp(tokens)
        r.resident.add(task)
        r.used += task.footprint
        name, uid = task.group.ttype.name, task.group.uid
        r.type_counts[name] = r.type_counts.get(name, 0) + 1
        r.group_counts[uid] = r.group_counts.get(uid, 0) + 1
        r.ctb_version += 1
        task.paused = False
        self.paused.pop(task.task_id, None)

    def _unhold(self, task: SimTask, r: Rank) -> None:
        if task not in r.resident:
            return
        r.resident.discard(task)
        r.used -= task.footprint
        task.footprint = 0
        name, uid = task.group.ttype.name, task.group.uid
        r.type_counts[name] -= 1
        r.group_counts[uid] -= 1
        if not r.group_counts[uid]:
            del r.group_counts[uid]
        r.ctb_version += 1

    def _rank_state(self, r: Rank) -> ctb.RankState:
        """The rank's snapshot, rebuilt only when its residents, usage or state changed."""
        key = (r.ctb_version, r.used, r.open, r.budget)
        cached = r.ctb_state
        if cached is not None and cached[0] == key:
            return cached[1]
        state = ctb.RankState(
            r.rid,
            r.budget,
            r.used,
            r.open,
            tuple(sorted(r.type_counts.items())),
            frozenset(r.group_counts),
        )
        r.ctb_state = (key, state)
        return state

    def _task_state(self, x: SimTask, need: int = 0) -> ctb.TaskState:
        g = x.group
        return ctb.TaskState(
            task_id=x.task_id,
            group_id=g.uid,
            rank=None if x.rank is None else x.rank.rid,
            tokens=x.footprint if x.rank is not None else self.fp(x.ctx + x.resp_left),
            need_tokens=need,
            active=x.active_entry is not None,
            is_eval=g.is_eval,
            group_completion=g.done / g.size,
            task_type=g.ttype.name,
            home=x.home,
        )

    def _start(self, task: SimTask, r: Rank, t: float) -> None:
        """Run the task's turn on ``r``: pause victims first if the rank is over budget (its
        admission used the probed estimate), and pause the task itself if the pool still
        cannot hold it."""
        if r.used > r.budget:
            self._overflow(r, t)
            if task.paused:
                return
        if r.B >= self.max_running:
            r.queue.append(task)
            return
        try:
            self.cl.start_turn(task, r, t)
        except PoolFull:
            self._pause(task, t)

    def _overflow(self, r: Rank, t: float, task: SimTask | None = None, need: int = 0) -> None:
        """CTB's pause decision for one rank whose residents (plus ``need``) exceed its budget."""
        states = [self._task_state(x, need if x is task else 0) for x in r.resident]
        self.apply(ctb.decide(self._snapshot([r], states)), t)

    # ------------------------------------------------------------- decisions
    def _snapshot(self, ranks, resident=(), paused=(), pending=()) -> ctb.CtbSnapshot:
        cl = self.cl
        return ctb.CtbSnapshot(
            ranks=tuple(self._rank_state(r) for r in ranks),
            resident=tuple(resident),
            paused=tuple(paused),
            pending=tuple(pending),
            env_capacity=cl.spec.env_capacity,
            env_in_use=cl.env_in_use,
            outstanding_groups=cl.outstanding,
            quota_groups=cl.quota,
            probe_default_tokens=self.probe_default,
            config=self.cfg,
        )

    def tick(self, t: float) -> None:
        cl = self.cl
        pending = []
        for g in cl.admissible()[:48]:
            pending.append(
                ctb.PendingGroup(
                    g.uid, g.size - g.admitted, g.probe_tokens, g.started, g.ttype.name, g.is_eval
                )
            )
        paused = [self._task_state(x) for x in self.paused.values()]
        if not pending and not paused:
            return
        self.apply(ctb.decide(self._snapshot(cl.ranks.values(), (), paused, pending)), t)

    def apply(self, d: ctb.Decisions, t: float) -> None:
        cl = self.cl
        for tid in d.pause:
            self._pause(cl.tasks[tid], t)
        for tid, rid in d.resume:
            task = cl.tasks[tid]
            if task.rank is not None:  # re-homed from a closing rank
                old = task.rank
                self._stop(task, old, t, evict=True)
                self._unhold(task, old)
            r = cl.ranks[rid]
            self._hold(task, r, task.ctx + task.resp_left if task.ready else task.ctx)
            if task.ready:
                self._start(task, r, t)
        for a in d.admit:
            g, r = cl.groups[a.group_id], cl.ranks[a.rank]
            for _ in range(a.count):
                task = cl.new_task(g, r, t)
                self._hold(task, r, task.ctx + task.resp_left)
                self._start(task, r, t)

    def _pause(self, task: SimTask, t: float) -> None:
        r = task.rank
        self._stop(task, r, t, evict=False)  # unpinned: cached, reusable if it comes back
        self._unhold(task, r)
        task.rank = None
        task.home = r.rid
        task.paused = True
        self.pauses += 1
        if task.ready:
            self.paused[task.task_id] = task
        self.cl._want_tick(t)

    # ---------------------------------------------------------------- events
    def on_ready(self, task: SimTask, t: float) -> None:
        if task.paused:
            self.paused[task.task_id] = task
            self.cl._want_tick(t)
            return
        r = task.rank
        need = self.fp(task.ctx + task.resp_left) - task.footprint
        if r.used + need > r.budget:
            self._overflow(r, t, task, need)
            if task.paused:
                return
        r.used += need
        task.footprint += need
        self._start(task, r, t)

    def on_wait(self, task: SimTask, r: Rank, t: float) -> None:
        r.pool.pin(task)

    def on_done(self, task: SimTask, r: Rank, t: float) -> None:
        r.pool.release(task)
        self._unhold(task, r)

    def on_flush(self, r: Rank) -> None:
        pass  # residents keep their budget; their next turn re-prefills on this rank

    def drain(self, r: Rank, t: float) -> None:
        while r.queue and r.B < self.max_running:
            task = r.queue.pop(0)
            try:
                self.cl.start_turn(task, r, t)
            except PoolFull:
                self._pause(task, t)

    def close_rank(self, r: Rank, t: float) -> None:
        """Re-home the tasks of a closing rank (CTB decides where)."""
        ranks = list(self.cl.ranks.values())
        residents = [self._task_state(x) for x in r.resident]
        self.apply(ctb.decide(self._snapshot(ranks, residents)), t)
        for task in list(r.resident):  # anything the decision left behind is paused
            self._pause(task, t)


class RequestDriver(_Driver):
    """Request-level continuous batching with LRU cache eviction (the baseline)."""

    def tick(self, t: float) -> None:
        cl = self.cl
        groups = [
            request_level.NewGroup(g.uid, g.size - g.admitted, g.is_eval)
            for g in cl.admissible()[:48]
            if not g.started
        ]
        if not groups:
            return
        engines = tuple(
            request_level.EngineState(
                rank=r.rid,
                available_tokens=0,
                running=r.B,
                max_running=self.max_running,
                assigned_tasks=r.assigned,
                open=r.open,
            )
            for r in cl.ranks.values()
        )
        snap = request_level.RequestSnapshot(
            engines, tuple(groups), cl.spec.env_capacity, cl.env_in_use, cl.outstanding, cl.quota
        )
        for gid, rid in request_level.decide(snap).route:
            g, r = cl.groups[gid], cl.ranks[rid]
            for _ in range(g.size - g.admitted):
                task = cl.new_task(g, r, t)
                r.assigned += 1
                r.queue.append(task)
            self.drain(r, t)

    def drain(self, r: Rank, t: float) -> None:
        pool, ps = r.pool, self.ps
        while r.queue:
            task = r.queue[0]
            total = task.ctx + task.resp_left
            need, avail = pool.pages_for(total), pool.free_pages()  # fits even uncached?
            if need > avail:  # tight: exact count with what the prefix cache serves
                keys = task.keys(total, ps)
                need, avail = pool.admission_need(task, task.ctx, keys, task.resp_left)
            if request_level.admit_fifo(avail * ps, (need * ps,), r.B, self.max_running) == 0:
                break
            r.queue.pop(0)
            self.cl.start_turn(task, r, t)

    def on_ready(self, task: SimTask, t: float) -> None:
        r = task.rank
        r.queue.append(task)
        self.drain(r, t)

    def on_wait(self, task: SimTask, r: Rank, t: float) -> None:
        r.pool.release(task)
        self.drain(r, t)

    def on_done(self, task: SimTask, r: Rank, t: float) -> None:
        r.pool.release(task)
        r.assigned -= 1

    def on_flush(self, r: Rank) -> None:
        pass

    def close_rank(self, r: Rank, t: float) -> None:
        """Route the closing rank's tasks to the least-loaded open rank (cache lost)."""
        others = [x for x in self.cl.ranks.values() if x is not r and x.open]
        moving = [x for x in self.cl.tasks.values() if x.rank is r and not x.dead]
        for task in moving:
            self._stop(task, r, t, evict=True)
            r.assigned -= 1
            dest = min(others, key=lambda x: (x.assigned, x.rid))
            task.rank = dest
            dest.assigned += 1
            if task.ready:
                dest.queue.append(task)
        for dest in others:
            self.drain(dest, t)

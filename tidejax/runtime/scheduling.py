"""The rollout manager's two admission policies, as adapters between its records and the
pure deciders in `tidejax.sched`: CTB (`sched.ctb.decide`) and the request-level baseline
(`sched.request_level.decide`, the one the simulator's baseline also calls).

Both run synchronously on the controller's asyncio loop, inside `RolloutManager.schedule`,
and carry the decisions out on the manager's records: CTB pins, pauses (unpins), resumes
and admits; request-level routes whole groups to the least-loaded open rank and pins
nothing, so a task's KV between turns is the engine's LRU cache's to evict.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from tidejax.runtime.config import RolloutConfig
from tidejax.runtime.records import GroupRecord, TaskRecord, TaskState
from tidejax.runtime.rollout import RolloutWorker
from tidejax.sched import ctb, request_level, staleness


class AdmissionHost(Protocol):
    """The manager's state the policies read and change (`RolloutManager` is one)."""

    config: RolloutConfig
    workers: dict[int, RolloutWorker]
    closing: set[int]  # ranks taking no new work
    tasks: dict[int, TaskRecord]
    groups: dict[int, GroupRecord]
    pending: deque[GroupRecord]  # groups with members not yet admitted, in order
    outstanding_groups: int
    counters: dict[str, int]
    max_pinned_fraction: float

    def start_next_task(self, group: GroupRecord, rank: int) -> TaskRecord: ...


def quota_groups(manager: AdmissionHost) -> int:
    """Training groups the staleness bound lets be outstanding at once."""
    config = manager.config
    return staleness.max_outstanding(config.staleness_bound, config.batch_groups)


class CtbScheduler:
    """Continuous Task Batching: task-level KV pinning, pause and resume."""

    def schedule(self, manager: AdmissionHost) -> None:
        snap = self.snapshot(manager)
        for rank in snap.ranks:  # cheap run-time invariant: what CTB planned fits the rank
            usage = manager.workers[rank.rank].usage()
            if rank.budget_tokens:
                manager.max_pinned_fraction = max(
                    manager.max_pinned_fraction,
                    usage.pinned_tokens / (rank.budget_tokens / manager.config.budget_fraction))
        decisions = ctb.decide(snap)
        for uid in decisions.pause:
            rec = manager.tasks[uid]
            if rec.rank is not None and rec.rank in manager.workers:
                manager.workers[rec.rank].unpin(uid)
            rec.rank = None
            rec.can_run.clear()
            if rec.state == TaskState.READY:
                rec.state = TaskState.PAUSED
            manager.counters["pauses"] += 1
        for uid, rank in decisions.resume:
            rec = manager.tasks[uid]
            if rec.home is not None and rec.home != rank and rec.home in manager.workers:
                manager.workers[rec.home].evict(uid)  # its KV there is no longer wanted
                manager.counters["rehomed"] += 1
            rec.rank = rank
            manager.workers[rank].pin(uid)
            if rec.state == TaskState.PAUSED:
                rec.state = TaskState.READY
            rec.can_run.set()
            manager.counters["resumes"] += 1
        for adm in decisions.admit:
            group = manager.groups[adm.group_id]
            for _ in range(adm.count):
                rec = manager.start_next_task(group, adm.rank)
                rec.charge_tokens = adm.tokens_each
                manager.workers[adm.rank].pin(rec.uid)
        # Resident tasks that were not paused may run their next turn.
        for rec in manager.tasks.values():
            if rec.state == TaskState.READY and rec.rank is not None:
                rec.can_run.set()

    @staticmethod
    def rank_budget(manager: AdmissionHost, rank: int) -> int:
        ec = manager.workers[rank].engine.engine_config
        return int(ec.num_pages * ec.page_size * manager.config.budget_fraction)

    @staticmethod
    def footprint(rec: TaskRecord, max_new_tokens: int) -> tuple[int, int]:
        """(KV tokens the task holds or has been charged, growth its next turn requests).

        The episode already holds a waiting observation, so a ready task's turn adds only
        its response; a generating task holds its response's room. Before the episode
        exists (env reset pending) the task stands at its admission's charge: without it a
        freshly admitted task weighs nothing and CTB would admit past the budget."""
        if rec.episode is None:
            return rec.charge_tokens, 0
        held = len(rec.episode)
        if rec.state == TaskState.GENERATING:
            return held + max_new_tokens, 0
        return held, max_new_tokens if rec.state == TaskState.READY else 0

    def snapshot(self, manager: AdmissionHost) -> ctb.CtbSnapshot:
        live = [t for t in manager.tasks.values() if t.active]
        max_new = manager.config.max_new_tokens
        footprints = {t.uid: self.footprint(t, max_new) for t in live}
        ranks = []
        for r in sorted(manager.workers):
            on = [t for t in live if t.rank == r]
            types: dict[str, int] = {}
            for t in on:
                types[t.task.kind] = types.get(t.task.kind, 0) + 1
            ranks.append(ctb.RankState(
                rank=r, budget_tokens=self.rank_budget(manager, r),
                used_tokens=sum(footprints[t.uid][0] for t in on), open=r not in manager.closing,
                type_counts=tuple(sorted(types.items())),
                groups=frozenset(t.group.uid for t in on)))
        resident, paused = [], []
        for t in live:
            tokens, need = footprints[t.uid]
            state = ctb.TaskState(
                task_id=t.uid, group_id=t.group.uid,
                rank=t.rank if t.rank in manager.workers else None,
                tokens=tokens, need_tokens=need,
                active=t.state == TaskState.GENERATING, is_eval=t.group.is_eval,
                group_completion=t.group.finished / len(t.group.tasks), task_type=t.task.kind,
                home=t.home if t.home in manager.workers else None)
            (resident if state.rank is not None else paused).append(state)
        pending = []
        for g in manager.pending:
            pending.append(ctb.PendingGroup(
                group_id=g.uid, remaining=len(g.tasks) - g.admitted, probe_tokens=g.probe_tokens,
                started=g.admitted > 0, task_type=g.tasks[0].task.kind, is_eval=g.is_eval))
        config = manager.config
        return ctb.CtbSnapshot(
            ranks=tuple(ranks), resident=tuple(resident), paused=tuple(paused),
            pending=tuple(pending), env_capacity=config.env_capacity,
            env_in_use=len(live), outstanding_groups=manager.outstanding_groups,
            quota_groups=quota_groups(manager),
            probe_default_tokens=config.probe_default_tokens)


class RequestLevelScheduler:
    """The baseline: every turn an independent request; groups go whole to the
    least-loaded open rank, under the env capacity and the staleness quota."""

    def schedule(self, manager: AdmissionHost) -> None:
        open_ranks = [r for r in sorted(manager.workers) if r not in manager.closing]
        if not open_ranks:
            return
        live = [t for t in manager.tasks.values() if t.active]
        load = {r: sum(t.rank == r for t in live) for r in open_ranks}
        for rec in live:  # tasks of closed (or lost) ranks move to the least-loaded open one
            if rec.rank is None or rec.rank not in load:
                rec.rank = min(load, key=lambda r: (load[r], r))
                load[rec.rank] += 1
            if rec.state in (TaskState.READY, TaskState.PAUSED):
                rec.state = TaskState.READY
                rec.can_run.set()
        engines = tuple(request_level.EngineState(rank=r, available_tokens=0,
                                                  assigned_tasks=load[r])
                        for r in open_ranks)
        # The engines admit their own queues (first come, first served); only routing is
        # decided here, so a request's `start` decision is not used.
        new_groups = tuple(request_level.NewGroup(g.uid, len(g.tasks) - g.admitted, g.is_eval)
                           for g in manager.pending)
        snap = request_level.RequestSnapshot(
            engines, new_groups, env_capacity=manager.config.env_capacity,
            env_in_use=len(live), outstanding_groups=manager.outstanding_groups,
            quota_groups=quota_groups(manager))
        for group_uid, rank in request_level.decide(snap).route:
            group = manager.groups[group_uid]
            group.route = rank  # a group's tasks share a rank (their common prompt prefix)
            while group.admitted < len(group.tasks):
                manager.start_next_task(group, rank)

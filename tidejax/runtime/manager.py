"""Rollout manager: admits GRPO groups' tasks onto rollout ranks, runs them, and hands
finished groups to the trainer's buffer or to the evaluation tally.

Concurrency (all on one asyncio loop, the controller's):
- one coroutine per admitted task (`_run_task`) runs episode attempts
  (`runtime.episode_loop.EpisodeLoop`: env reset -> [generate on its rank -> env step]*
  -> return) and retries a failed attempt with backoff, up to `max_task_attempts`.
  Generation runs on the task's `RolloutWorker` thread, env calls on the `EnvPool`.
- `schedule()` is called synchronously after every event that changes footprints (a turn
  ends, an observation arrives, a task finishes, a rank opens or closes) and hands the
  records to the admission policy (`runtime.scheduling`): CTB (pin, pause, resume,
  admit) or the request-level baseline (route whole groups, pin nothing, so the engine's
  LRU cache may evict a task's KV during its env waits).
- When all G tasks of a group end, rewards become GRPO advantages and the group goes to the
  `GlobalBuffer` (training) or to the evaluation tally (evaluation). A group with a task
  that failed for good is dropped whole, with its reason: never trained half-done. With
  dynamic sampling a group whose rewards are all equal is dropped too (`zero_variance`)
  and its quota slot goes back, so the controller's top-up admits a new group.
- Sampling is reproducible (`episode_loop.sampling_seed`): a turn's seed is a hash of
  (run seed, task id, turn, attempt), never drawn in completion order, so the same tasks
  give the same tokens whatever the timing, the rank or the batch they share. Training
  task ids carry the data cursor, so no two training turns share a seed. Evaluation
  deliberately reuses seeds: sample k of goal g gets the same seeds at every version
  (common random numbers), so a change in eval success between versions comes from the
  policy, not from the dice.
- If every rollout rank has been quarantined, `failure` is set, `wait_idle` and
  `raise_if_failed` raise `AllRanksFailed`: the run stops instead of waiting forever.
  Both also quarantine ranks whose thread has died, since a rank can die with no turn of
  its own left to report it; `wait_idle` looks every 0.5 s.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Sequence

import numpy as np

from tidejax.envs import Task
from tidejax.models.tokenizer import Tokenizer
from tidejax.rl.advantages import compute_advantages
from tidejax.rl.batch import Trajectory
from tidejax.rl.config import AdvantageConfig
from tidejax.runtime.buffer import GlobalBuffer, ReadyGroup
from tidejax.runtime.config import RolloutConfig
from tidejax.runtime.episode_loop import EpisodeLoop
from tidejax.runtime.records import (
    ENDED,
    EvalTally,
    GroupPayload,
    GroupRecord,
    TaskRecord,
    TaskState,
)
from tidejax.runtime.rollout import RolloutWorker
from tidejax.runtime.scheduling import CtbScheduler, RequestLevelScheduler

log = logging.getLogger(__name__)


class AllRanksFailed(RuntimeError):
    """Every rollout rank is quarantined: no task can make progress."""


class RolloutManager:
    """Runs tasks on rollout ranks; see the module docstring."""

    def __init__(self, config: RolloutConfig, workers: dict[int, RolloutWorker], pool,
                 tokenizer: Tokenizer, buffer: GlobalBuffer, env_type: str,
                 advantage_config: AdvantageConfig = AdvantageConfig(), seed: int = 0,
                 max_seq_len: int = 4096):
        self.config = config
        self.workers = dict(workers)
        self.closing: set[int] = set()
        self.pool = pool
        self.tokenizer = tokenizer
        self.buffer = buffer
        self.env_type = env_type
        self.advantage_config = advantage_config
        self.max_seq_len = max_seq_len
        self.episode_loop = EpisodeLoop(self, config, tokenizer, pool, env_type, seed,
                                        max_seq_len)
        self.scheduler = CtbScheduler() if config.scheduler == "ctb" else RequestLevelScheduler()
        self._uids = itertools.count()
        self.pending: deque[GroupRecord] = deque()
        self.groups: dict[int, GroupRecord] = {}
        self.tasks: dict[int, TaskRecord] = {}
        self._running: set[asyncio.Task] = set()
        self.outstanding_groups = 0  # training groups admitted and not yet consumed/dropped
        self.eval_tallies: dict[int, EvalTally] = {}
        self.counters = dict(turns=0, prompt_tokens=0, cached_tokens=0, generated_tokens=0,
                             task_failures=0, task_retries=0, groups_dropped=0, groups_ready=0,
                             groups_filtered=0, pauses=0, resumes=0, rehomed=0)
        self.filtered_since_consumed = 0  # dynamic sampling's drops in the current step
        self.dropped_tasks: list[tuple[str, str]] = []  # (task_id, reason)
        self._idle = asyncio.Event()
        self._idle.set()
        self.max_pinned_fraction = 0.0  # invariant check: pinned KV tokens / rank budget
        self.quarantined: set[int] = set()  # failed ranks: never placed on or synced again
        self.failure: AllRanksFailed | None = None

    # ------------------------------------------------------------------ inputs
    def add_groups(self, tasks: Sequence[Task], group_size: int, is_eval: bool = False,
                   eval_version: int = -1) -> None:
        """Queue tasks (consecutive runs of `group_size` share a group) for admission."""
        if len(tasks) % group_size:
            raise ValueError(f"{len(tasks)} tasks do not split into groups of {group_size}")
        for start in range(0, len(tasks), group_size):
            members = tasks[start:start + group_size]
            group = GroupRecord(members[0].group_id, next(self._uids), [], is_eval, eval_version)
            for task in members:
                rec = TaskRecord(task, next(self._uids), group)
                group.tasks.append(rec)
                self.tasks[rec.uid] = rec
            self.groups[group.uid] = group
            self.pending.append(group)
        self._idle.clear()
        self.schedule()

    def consumed(self, n_groups: int) -> None:
        """The trainer took `n_groups` training groups: they leave the staleness quota."""
        self.outstanding_groups = max(0, self.outstanding_groups - n_groups)
        self.filtered_since_consumed = 0
        self.schedule()

    def inflight_training_groups(self) -> list[tuple[list[Task], bool]]:
        """Unfinished training groups in admission order, each with whether it had started
        (for checkpoints: a resumed run restarts them)."""
        return [([t.task for t in g.tasks], g.admitted > 0)
                for g in sorted(self.groups.values(), key=lambda g: g.uid) if not g.is_eval]

    @property
    def pending_groups(self) -> int:
        return len(self.pending)

    @property
    def active_tasks(self) -> int:
        return sum(t.active for t in self.tasks.values())

    async def wait_idle(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=0.5)
                break
            except asyncio.TimeoutError:
                self.raise_if_failed()  # a rank can die with no turn left to report it
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raise `AllRanksFailed` once no rank is left; quarantines ranks found dead first."""
        for rank, worker in list(self.workers.items()):
            if worker.failed is not None:
                self.quarantine(rank)
        if self.failure is not None:
            raise self.failure

    # ------------------------------------------------------------------ ranks
    def open_rank(self, rank: int, worker: RolloutWorker) -> None:
        self.workers[rank] = worker
        self.closing.discard(rank)
        self.schedule()

    def close_rank(self, rank: int) -> None:
        """Stop placing work on `rank`; its tasks are re-homed as their turns end."""
        self.closing.add(rank)
        self.schedule()

    def quarantine(self, rank: int) -> None:
        """Take a failed rank out of service; its tasks resume elsewhere with a fresh prefill."""
        if rank in self.quarantined:
            return
        self.quarantined.add(rank)
        log.warning("quarantining rollout rank %d", rank)
        if rank in self.workers:
            self.workers.pop(rank).stop(timeout=1.0)
        self.closing.discard(rank)
        for rec in self.tasks.values():
            if rec.home == rank:
                rec.home = None
            if rec.rank == rank:
                rec.rank = None
                rec.can_run.clear()
                if rec.state == TaskState.READY:
                    rec.state = TaskState.PAUSED
        self.counters["ranks_quarantined"] = len(self.quarantined)
        if not self.workers:
            stuck = sum(t.state not in ENDED for t in self.tasks.values())
            self.failure = AllRanksFailed(
                f"every rollout rank has failed (quarantined: {sorted(self.quarantined)}); "
                f"{stuck} tasks cannot run")
            log.error("%s", self.failure)
            self._idle.set()  # wake the controller so it stops instead of waiting forever
            return
        self.schedule()

    def rank_drained(self, rank: int) -> bool:
        return not any(t.rank == rank and t.state == TaskState.GENERATING
                       for t in self.tasks.values())

    def remove_rank(self, rank: int) -> RolloutWorker:
        worker = self.workers.pop(rank)
        self.closing.discard(rank)
        for rec in self.tasks.values():
            if rec.rank == rank:
                rec.rank = None
            if rec.home == rank:
                rec.home = None
        self.schedule()
        return worker

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> None:
        if self.failure is not None:
            self._idle.set()  # nothing will run again: let waiters see the failure
            return
        if not self.workers:
            return
        self.scheduler.schedule(self)
        if not self.pending and self.active_tasks == 0:
            self._idle.set()

    def start_next_task(self, group: GroupRecord, rank: int) -> TaskRecord:
        """Admit the group's next member onto `rank` and start its coroutine."""
        rec = group.tasks[group.admitted]
        if group.admitted == 0 and not group.is_eval:
            self.outstanding_groups += 1
            self.buffer.admit(group.group_id, self.workers[rank].version)
        group.admitted += 1
        if group.admitted == len(group.tasks):
            self.pending.remove(group)
        rec.rank = rec.home = rank
        rec.state = TaskState.READY
        rec.can_run.set()
        task = asyncio.get_running_loop().create_task(self._run_task(rec))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return rec

    async def _run_task(self, rec: TaskRecord) -> None:
        while True:
            rec.attempts += 1
            try:
                outcome = await self.episode_loop.run(rec)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # an engine or env failure ends this attempt only
                log.warning("task %s attempt %d failed: %r", rec.task.task_id, rec.attempts, e)
                outcome = f"exception:{type(e).__name__}"
            if outcome is None:
                rec.state = TaskState.DONE
                break
            self.counters["task_failures"] += 1
            if rec.rank is not None and rec.rank in self.workers:
                self.workers[rec.rank].evict(rec.uid)
            if rec.group.probe_tokens is None:  # the probe died: unblock its siblings
                rec.group.probe_tokens = max(rec.tokens, self.config.probe_default_tokens)
            if rec.attempts >= self.config.max_task_attempts:
                rec.state, rec.error = TaskState.FAILED, outcome
                self.dropped_tasks.append((rec.task.task_id, outcome))
                self._fail_unstarted_siblings(rec.group)
                break
            self.counters["task_retries"] += 1
            rec.episode = None
            await asyncio.sleep(self.config.retry_backoff_s * 2 ** (rec.attempts - 1))
            if rec.rank is None or rec.rank not in self.workers:
                rec.state = TaskState.PAUSED
                self.schedule()
        await self.pool.release(rec.task.task_id)  # no-op for a task the pool already forgot
        if rec.rank is not None and rec.rank in self.workers:
            self.workers[rec.rank].evict(rec.uid)
        rec.rank = None
        self._maybe_finish_group(rec.group)
        self.schedule()

    # ------------------------------------------------------------------ groups
    def _fail_unstarted_siblings(self, group: GroupRecord) -> None:
        """The group will be dropped anyway: do not start the members still waiting."""
        for rec in group.tasks[group.admitted:]:
            rec.state, rec.error = TaskState.FAILED, "group_failed"
            self.dropped_tasks.append((rec.task.task_id, "group_failed"))
        if group.admitted < len(group.tasks):  # >= 1: a started member failed
            group.admitted = len(group.tasks)
            if group in self.pending:
                self.pending.remove(group)

    def _maybe_finish_group(self, group: GroupRecord) -> None:
        if group.finished < len(group.tasks):
            return
        del self.groups[group.uid]
        for rec in group.tasks:
            self.tasks.pop(rec.uid, None)
        failed = [t for t in group.tasks if t.state == TaskState.FAILED]
        generated = sum(t.episode.generated_tokens for t in group.tasks if t.episode)
        if group.is_eval:
            tally = self.eval_tallies.setdefault(group.eval_version, EvalTally(group.eval_version))
            tally.groups += 1
            for t in group.tasks:
                if t.state == TaskState.DONE:
                    tally.episodes += 1
                    tally.reward_sum += t.reward
                    tally.reward_sq_sum += t.reward * t.reward
                    tally.wins += int(t.won)
                    tally.transcripts.append({"task_id": t.task.task_id, "reward": t.reward,
                                              "won": t.won, "end": t.end,
                                              "actions": list(t.actions)})
            return
        if failed:
            self.counters["groups_dropped"] += 1
            self.outstanding_groups = max(0, self.outstanding_groups - 1)
            self.buffer.drop(group.group_id, f"task_failed:{failed[0].error}", generated)
            return
        trajectories = [
            Trajectory(tokens=np.asarray(t.episode.tokens, np.int32),
                       loss_mask=np.asarray(t.episode.loss_mask, np.float32),
                       behaviour_logp=np.asarray(t.episode.behaviour_logp, np.float32),
                       policy_version=np.asarray(t.episode.versions, np.int32),
                       reward=t.reward, group_id=group.uid)
            for t in group.tasks]
        rewards = np.asarray([t.reward for t in trajectories], np.float32)
        if self._filters_out(rewards):
            self.counters["groups_filtered"] += 1
            self.filtered_since_consumed += 1
            self.outstanding_groups = max(0, self.outstanding_groups - 1)  # a new group refills
            self.buffer.drop(group.group_id, "zero_variance", generated)
            self.schedule()
            return
        adv, keep = compute_advantages(rewards, np.zeros(len(rewards), np.int32),
                                       self.advantage_config)
        payload = GroupPayload(trajectories, np.asarray(adv, np.float32).tolist(),
                               np.asarray(keep).tolist(),
                               [t.task.task_id for t in group.tasks])
        self.counters["groups_ready"] += 1
        self.buffer.put(ReadyGroup(
            group_id=group.group_id, payload=payload,
            generated_tokens=generated,
            total_tokens=sum(len(t) for t in trajectories),
            min_version=min(t.episode.min_generated_version() for t in group.tasks)))

    def _filters_out(self, rewards: np.ndarray) -> bool:
        """Dynamic sampling: drop this all-equal-reward group, within the step's budget."""
        cfg = self.config
        # the same test as the advantage's zero-variance filter (rl.advantages)
        tol = self.advantage_config.zero_variance_tol
        if not cfg.dynamic_sampling or float(np.std(rewards)) > tol:
            return False
        budget = (cfg.dynamic_sampling_rounds - 1) * cfg.batch_groups
        return self.filtered_since_consumed < budget

    def hit_rate(self) -> float:
        c = self.counters
        return c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0

    async def aclose(self) -> None:
        """Cancel every task and wait until none is left. A cancellation can be lost (in
        Python 3.11 `asyncio.wait_for` returns the result instead when its future completes
        in the same loop turn, as an env call's can), and a task ending can start another,
        so the tasks still running are cancelled again every second rather than awaited
        once: a CI run hung here for 10 minutes with every rank dead."""
        while self._running:
            pending = list(self._running)
            for task in pending:
                task.cancel()
            done, _ = await asyncio.wait(pending, timeout=1.0)
            for task in done:  # retrieved, as gather(return_exceptions=True) did
                if not task.cancelled():
                    task.exception()

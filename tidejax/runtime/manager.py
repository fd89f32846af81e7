"""Rollout manager: the multi-turn task loop, CTB (or request-level) scheduling, GRPO groups.

Concurrency (all on one asyncio loop, the controller's):
- one coroutine per admitted task runs its episode: env reset -> [generate on its rank ->
  env step]* -> reward. Generation is handed to the task's `RolloutWorker` thread and
  awaited through a future; env calls are awaited on the `EnvPool`.
- `schedule()` is called synchronously after every event that changes footprints (a turn
  ends, an observation arrives, a task finishes, a rank opens or closes). It builds a
  `CtbSnapshot`, calls the pure `tidejax.sched.ctb.decide`, and carries the decisions out:
  pause = unpin the task's KV and hold its next turn; resume = give it a rank (evicting a
  stale copy elsewhere) and release its next turn; admit = start new task coroutines.
  In request-level mode it admits FIFO up to the env and staleness limits and every turn's
  KV is released to the engine's LRU cache, which is what loses it during env waits.
- When all G tasks of a group end, rewards become GRPO advantages and the group goes to the
  `GlobalBuffer` (training) or to the evaluation tally (evaluation). A group with a task
  that failed for good is dropped whole, with its reason: never trained half-done. With
  dynamic sampling a group whose rewards are all equal is dropped too (`zero_variance`)
  and its quota slot goes back, so the controller's top-up admits a new group.
- Sampling is reproducible: a turn's seed is a hash of (run seed, task id, turn, attempt),
  never drawn in completion order, so the same tasks give the same tokens whatever the
  timing, the rank or the batch they share. Training task ids carry the data cursor, so
  no two training turns share a seed. Evaluation deliberately reuses seeds: sample k of
  goal g gets the same seeds at every version (common random numbers), so a change in
  eval success between versions comes from the policy, not from the dice.
- If every rollout rank has been quarantined, `failure` is set, `wait_idle` and
  `raise_if_failed` raise `AllRanksFailed`: the run stops instead of waiting forever.
  Both also quarantine ranks whose thread has died, since a rank can die with no turn of
  its own left to report it; `wait_idle` looks every 0.5 s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from tidejax.envs import Task
from tidejax.envs.policies import action_format
from tidejax.models.tokenizer import Tokenizer
from tidejax.rl.advantages import compute_advantages
from tidejax.rl.batch import Trajectory
from tidejax.rl.config import AdvantageConfig
from tidejax.runtime.buffer import GlobalBuffer, ReadyGroup
from tidejax.runtime.config import RolloutConfig
from tidejax.runtime.episode import (
    EpisodeTokens,
    action_text,
    close_action,
    observation_ids,
    open_episode,
)
from tidejax.runtime.rollout import RankFailed, RolloutWorker, TurnResult
from tidejax.sched import ctb, staleness
from tidejax.serving.config import SamplingParams
from tidejax.serving.loop import Request

log = logging.getLogger(__name__)


class AllRanksFailed(RuntimeError):
    """Every rollout rank is quarantined: no task can make progress."""


def sampling_seed(run_seed: int, task_id: str, turn: int, attempt: int) -> int:
    """A turn's sampling seed from what identifies it, not from when it ran (31 bits)."""
    digest = hashlib.blake2b(f"{run_seed}/{task_id}/{turn}/{attempt}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


def _seed_key(rec: TaskRecord) -> str:
    if rec.group.is_eval:  # the same at every version: split, goal and sample index
        sample = rec.task.task_id.rsplit("-", 1)[-1]
        return f"eval/{rec.task.split}/{rec.task.goal_index}/{sample}"
    return rec.task.task_id


@dataclasses.dataclass
class TaskRecord:
    task: Task
    uid: int
    group: GroupRecord
    rank: int | None = None  # rank holding (or about to hold) its KV; None while paused
    home: int | None = None
    state: str = "pending"  # pending|generating|env|ready|paused|done|failed
    episode: EpisodeTokens | None = None
    need_tokens: int = 0
    reward: float = 0.0
    won: bool = False
    error: str | None = None
    attempts: int = 0
    actions: list[str] = dataclasses.field(default_factory=list)  # as the env received them
    end: str = ""  # how the episode ended: env_done | context_cap
    can_run: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def tokens(self) -> int:
        return len(self.episode) if self.episode is not None else 0


@dataclasses.dataclass
class GroupRecord:
    group_id: str
    uid: int
    tasks: list[TaskRecord]
    is_eval: bool
    eval_version: int = -1  # evaluation groups: the policy version they measure
    probe_tokens: int | None = None
    admitted: int = 0
    route: int | None = None  # request-level: the rank its tasks are sent to

    @property
    def finished(self) -> int:
        return sum(t.state in ("done", "failed") for t in self.tasks)


@dataclasses.dataclass
class EvalTally:
    version: int
    groups: int = 0
    episodes: int = 0
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    wins: int = 0
    transcripts: list[dict] = dataclasses.field(default_factory=list)

    @property
    def reward(self) -> float:
        return self.reward_sum / self.episodes if self.episodes else float("nan")

    @property
    def reward_se(self) -> float:
        """Standard error of the mean episode reward (sample std / sqrt(episodes))."""
        return reward_standard_error(self.reward_sum, self.reward_sq_sum, self.episodes)


def reward_standard_error(total: float, total_sq: float, n: int) -> float:
    """Standard error of a mean from the sum and the sum of squares of `n` samples."""
    if n < 2:
        return float("nan")
    variance = max(0.0, (total_sq - total * total / n) / (n - 1))
    return math.sqrt(variance / n)


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
        self.system_prompt = action_format(env_type)
        self._seed = seed
        self._uids = itertools.count()
        self._pending: deque[GroupRecord] = deque()
        self._groups: dict[int, GroupRecord] = {}
        self._tasks: dict[int, TaskRecord] = {}
        self._running: set[asyncio.Task] = set()
        self.outstanding_groups = 0  # training groups admitted and not yet consumed/dropped
        self.eval_tallies: dict[int, EvalTally] = {}
        self.counters = dict(turns=0, prompt_tokens=0, cached_tokens=0, generated_tokens=0,
                             task_failures=0, task_retries=0, groups_dropped=0, groups_ready=0,
                             groups_filtered=0, pauses=0, resumes=0, rehomed=0)
        self.filtered_since_consumed = 0  # dynamic sampling's drops in the current step
        self.dropped_tasks: list[tuple[str, str]] = []  # (task_id, reason)
        self._round_robin = itertools.count()
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
                self._tasks[rec.uid] = rec
            self._groups[group.uid] = group
            self._pending.append(group)
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
                for g in sorted(self._groups.values(), key=lambda g: g.uid) if not g.is_eval]

    @property
    def pending_groups(self) -> int:
        return len(self._pending)

    @property
    def active_tasks(self) -> int:
        return sum(t.state not in ("pending", "done", "failed") for t in self._tasks.values())

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
        for rec in self._tasks.values():
            if rec.home == rank:
                rec.home = None
            if rec.rank == rank:
                rec.rank = None
                rec.can_run.clear()
                if rec.state == "ready":
                    rec.state = "paused"
        self.counters["ranks_quarantined"] = len(self.quarantined)
        if not self.workers:
            stuck = sum(t.state not in ("done", "failed") for t in self._tasks.values())
            self.failure = AllRanksFailed(
                f"every rollout rank has failed (quarantined: {sorted(self.quarantined)}); "
                f"{stuck} tasks cannot run")
            log.error("%s", self.failure)
            self._idle.set()  # wake the controller so it stops instead of waiting forever
            return
        self.schedule()

    def rank_drained(self, rank: int) -> bool:
        return not any(t.rank == rank and t.state == "generating" for t in self._tasks.values())

    def remove_rank(self, rank: int) -> RolloutWorker:
        worker = self.workers.pop(rank)
        self.closing.discard(rank)
        for rec in self._tasks.values():
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
        if self.config.scheduler == "ctb":
            self._schedule_ctb()
        else:
            self._schedule_request_level()
        if not self._pending and self.active_tasks == 0:
            self._idle.set()

    def _quota(self) -> int:
        return staleness.max_outstanding(self.config.staleness_bound, self.config.batch_groups)

    def _rank_budget(self, rank: int) -> int:
        ec = self.workers[rank].engine.engine_config
        return int(ec.num_pages * ec.page_size * self.config.budget_fraction)

    def _snapshot(self) -> ctb.CtbSnapshot:
        live = [t for t in self._tasks.values() if t.state not in ("pending", "done", "failed")]
        ranks = []
        for r in sorted(self.workers):
            on = [t for t in live if t.rank == r]
            types: dict[str, int] = {}
            for t in on:
                types[t.task.kind] = types.get(t.task.kind, 0) + 1
            ranks.append(ctb.RankState(
                rank=r, budget_tokens=self._rank_budget(r),
                used_tokens=sum(t.tokens for t in on), open=r not in self.closing,
                type_counts=tuple(sorted(types.items())),
                groups=frozenset(t.group.uid for t in on)))
        resident, paused = [], []
        for t in live:
            state = ctb.TaskState(
                task_id=t.uid, group_id=t.group.uid, rank=t.rank if t.rank in self.workers else None,
                tokens=t.tokens, need_tokens=t.need_tokens if t.state == "ready" else 0,
                active=t.state == "generating", is_eval=t.group.is_eval,
                group_completion=t.group.finished / len(t.group.tasks), task_type=t.task.kind,
                home=t.home if t.home in self.workers else None)
            (resident if state.rank is not None else paused).append(state)
        pending = []
        for g in self._pending:
            remaining = len(g.tasks) - g.admitted
            pending.append(ctb.PendingGroup(
                group_id=g.uid, remaining=remaining, probe_tokens=g.probe_tokens,
                started=g.admitted > 0, task_type=g.tasks[0].task.kind, is_eval=g.is_eval))
        return ctb.CtbSnapshot(
            ranks=tuple(ranks), resident=tuple(resident), paused=tuple(paused),
            pending=tuple(pending), env_capacity=self.config.env_capacity,
            env_in_use=len(live), outstanding_groups=self.outstanding_groups,
            quota_groups=self._quota(), probe_default_tokens=self.config.probe_default_tokens)

    def _schedule_ctb(self) -> None:
        snap = self._snapshot()
        for rank in snap.ranks:  # cheap run-time invariant: what CTB planned fits the rank
            usage = self.workers[rank.rank].usage()
            if rank.budget_tokens:
                self.max_pinned_fraction = max(self.max_pinned_fraction,
                                               usage.pinned_tokens / (rank.budget_tokens /
                                                                     self.config.budget_fraction))
        decisions = ctb.decide(snap)
        for uid in decisions.pause:
            rec = self._tasks[uid]
            if rec.rank is not None and rec.rank in self.workers:
                self.workers[rec.rank].unpin(uid)
            rec.rank = None
            rec.can_run.clear()
            if rec.state == "ready":
                rec.state = "paused"
            self.counters["pauses"] += 1
        for uid, rank in decisions.resume:
            rec = self._tasks[uid]
            if rec.home is not None and rec.home != rank and rec.home in self.workers:
                self.workers[rec.home].evict(uid)  # its KV there is no longer wanted
                self.counters["rehomed"] += 1
            rec.rank = rank
            self.workers[rank].pin(uid)
            if rec.state == "paused":
                rec.state = "ready"
            rec.can_run.set()
            self.counters["resumes"] += 1
        for adm in decisions.admit:
            group = self._groups[adm.group_id]
            for _ in range(adm.count):
                self._start_next_task(group, adm.rank)
        # Resident tasks that were not paused may run their next turn.
        for rec in self._tasks.values():
            if rec.state == "ready" and rec.rank is not None:
                rec.can_run.set()

    def _schedule_request_level(self) -> None:
        live = sum(t.state not in ("pending", "done", "failed") for t in self._tasks.values())
        open_ranks = [r for r in sorted(self.workers) if r not in self.closing]
        for rec in self._tasks.values():  # tasks of closed ranks move round-robin
            if rec.state not in ("pending", "done", "failed") and (
                    rec.rank is None or rec.rank not in open_ranks) and open_ranks:
                rec.rank = open_ranks[next(self._round_robin) % len(open_ranks)]
            if rec.state in ("ready", "paused") and rec.rank is not None:
                rec.state = "ready"
                rec.can_run.set()
        while self._pending and open_ranks:
            group = self._pending[0]
            if live >= self.config.env_capacity:
                break
            if not group.is_eval and group.admitted == 0 and (
                    self.outstanding_groups >= self._quota()):
                break
            if group.admitted == 0 or group.route not in open_ranks:  # groups round-robin;
                group.route = open_ranks[next(self._round_robin) % len(open_ranks)]
            rank = group.route  # a group's tasks share a rank (their common prompt prefix)
            self._start_next_task(group, rank)
            live += 1

    def _start_next_task(self, group: GroupRecord, rank: int) -> None:
        rec = group.tasks[group.admitted]
        if group.admitted == 0:
            if not group.is_eval:
                self.outstanding_groups += 1
        group.admitted += 1
        if group.admitted == len(group.tasks):
            self._pending.remove(group)
        rec.rank = rec.home = rank
        rec.state = "ready"
        rec.can_run.set()
        if self.config.scheduler == "ctb":
            self.workers[rank].pin(rec.uid)
        task = asyncio.get_running_loop().create_task(self._run_task(rec))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    # ------------------------------------------------------------------ task loop
    def _sampling(self, rec: TaskRecord) -> SamplingParams:
        seed = sampling_seed(self._seed, _seed_key(rec), rec.episode.turns, rec.attempts)
        temperature = (self.config.evaluation_temperature if rec.group.is_eval
                       else self.config.temperature)
        return SamplingParams(temperature=temperature, max_new_tokens=self.config.max_new_tokens,
                              stop_token_ids=self.tokenizer.eos_ids[:4], seed=seed)

    async def _generate(self, rec: TaskRecord) -> TurnResult:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def on_done(result):
            def resolve():
                if future.done():
                    return
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            loop.call_soon_threadsafe(resolve)

        worker = self.workers[rec.rank]
        request = Request(request_id=(rec.uid, rec.episode.turns, rec.attempts), task_id=rec.uid,
                          prompt_token_ids=tuple(rec.episode.tokens),
                          max_new_tokens=self.config.max_new_tokens, sampling=self._sampling(rec))
        worker.submit(request, on_done)
        return await future

    async def _run_task(self, rec: TaskRecord) -> None:
        while True:
            rec.attempts += 1
            try:
                outcome = await self._episode(rec)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # an engine or env failure ends this attempt only
                log.warning("task %s attempt %d failed: %r", rec.task.task_id, rec.attempts, e)
                outcome = f"exception:{type(e).__name__}"
            if outcome is None:
                rec.state = "done"
                break
            self.counters["task_failures"] += 1
            if rec.rank is not None and rec.rank in self.workers:
                self.workers[rec.rank].evict(rec.uid)
            if rec.group.probe_tokens is None:  # the probe died: unblock its siblings
                rec.group.probe_tokens = max(rec.tokens, self.config.probe_default_tokens)
            if rec.attempts >= self.config.max_task_attempts:
                rec.state, rec.error = "failed", outcome
                self.dropped_tasks.append((rec.task.task_id, outcome))
                self._fail_unstarted_siblings(rec.group)
                break
            self.counters["task_retries"] += 1
            rec.episode, rec.need_tokens = None, 0
            await asyncio.sleep(self.config.retry_backoff_s * 2 ** (rec.attempts - 1))
            if rec.rank is None or rec.rank not in self.workers:
                rec.state = "paused"
                self.schedule()
        await self.pool.release(rec.task.task_id)  # no-op for a task the pool already forgot
        if rec.rank is not None and rec.rank in self.workers:
            self.workers[rec.rank].evict(rec.uid)
        rec.rank = None
        self._maybe_finish_group(rec.group)
        self.schedule()

    async def _episode(self, rec: TaskRecord) -> str | None:
        """One attempt at the episode; returns None on success or a failure reason."""
        start = await self.pool.reset(rec.task)
        if not start.ok:
            return f"env_{start.error}"
        rec.episode = open_episode(self.tokenizer, self.system_prompt, start.obs)
        rec.actions, rec.end = [], ""
        rec.need_tokens = len(rec.episode) + self.config.max_new_tokens
        rec.state = "ready"
        self.schedule()
        while True:
            await rec.can_run.wait()
            if rec.rank is None or rec.rank not in self.workers:
                rec.can_run.clear()
                self.schedule()
                continue
            rec.state = "generating"
            rec.home = rec.rank
            try:
                turn = await self._generate(rec)
            except RankFailed as failure:
                # The turn is lost with its rank, the episode is not: resume it elsewhere.
                rec.state = "ready"
                self.quarantine(failure.rank)
                self.counters["turns_reissued"] = self.counters.get("turns_reissued", 0) + 1
                continue
            comp = turn.completion
            self.counters["turns"] += 1
            self.counters["prompt_tokens"] += len(comp.prompt_token_ids)
            self.counters["cached_tokens"] += comp.cached_tokens
            self.counters["generated_tokens"] += len(comp.token_ids)
            rec.episode.extend_generated(list(comp.token_ids), list(comp.logprobs), turn.version)
            close_action(self.tokenizer, rec.episode, list(comp.token_ids))
            if rec.group.probe_tokens is None:
                rec.group.probe_tokens = len(rec.episode)
            rec.state, rec.need_tokens = "env", 0
            self.schedule()
            action = action_text(self.tokenizer, list(comp.token_ids))
            rec.actions.append(action)
            result = await self.pool.step(rec.task.task_id, action)
            if not result.ok:
                return f"env_{result.error}"
            if result.done:
                rec.reward = float(result.reward)
                rec.won = bool(result.info.get("won", rec.reward >= 1.0))
                rec.end = "env_done"
                return None
            new_ids = observation_ids(self.tokenizer, result.obs)
            if len(rec.episode) + len(new_ids) + self.config.max_new_tokens > self.max_seq_len:
                # Context cap: the episode ends unrewarded, without the observation that
                # would not fit, so every trajectory fits one training row.
                rec.reward, rec.won, rec.end = 0.0, False, "context_cap"
                return None
            rec.episode.extend_context(new_ids)
            rec.need_tokens = len(new_ids) + self.config.max_new_tokens
            rec.state = "ready"
            self.schedule()

    # ------------------------------------------------------------------ groups
    def _fail_unstarted_siblings(self, group: GroupRecord) -> None:
        """The group will be dropped anyway: do not start the members still waiting."""
        for rec in group.tasks[group.admitted:]:
            rec.state, rec.error = "failed", "group_failed"
            self.dropped_tasks.append((rec.task.task_id, "group_failed"))
        if group.admitted < len(group.tasks):
            if group.admitted == 0 and not group.is_eval:
                self.outstanding_groups += 1  # balanced by the drop in _maybe_finish_group
            group.admitted = len(group.tasks)
            if group in self._pending:
                self._pending.remove(group)

    def _maybe_finish_group(self, group: GroupRecord) -> None:
        if group.finished < len(group.tasks):
            return
        del self._groups[group.uid]
        for rec in group.tasks:
            self._tasks.pop(rec.uid, None)
        failed = [t for t in group.tasks if t.state == "failed"]
        generated = sum(t.episode.generated_tokens for t in group.tasks if t.episode)
        if group.is_eval:
            tally = self.eval_tallies.setdefault(group.eval_version, EvalTally(group.eval_version))
            tally.groups += 1
            for t in group.tasks:
                if t.state == "done":
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
        for task in list(self._running):
            task.cancel()
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)


@dataclasses.dataclass
class GroupPayload:
    """A finished training group as the trainer consumes it."""

    trajectories: list[Trajectory]
    advantages: list[float]
    keep: list[bool]
    task_ids: list[str]

"""EnvPool: env resets and steps off the decode path, behind an asyncio API.

    pool = EnvPool(PoolConfig(capacity=64), latency=LatencyModel.default())
    first = await pool.reset(task)               # StepResult with the first observation
    result = await pool.step(task.task_id, act)  # StepResult; result.error None or a reason

Concurrency
-----------
Three parties meet here (and a fourth limit: with `max_open_episodes` set, a reset
waits for one of that many episode slots, held until the task ends or is released, so
an env that is expensive to keep open is never opened more often than that at once).

1. The caller's event loop (the rollout runtime). Many coroutines, one per live task,
   await `reset` / `step` at once. All pool bookkeeping (task records, counters) runs
   on this loop, so it needs no locks; a per-task asyncio.Lock keeps each task's calls
   in order. Use the pool from one loop; other threads reach it with
   `asyncio.run_coroutine_threadsafe`.
2. An asyncio.Semaphore of `capacity` slots stands for the external env cluster's
   capacity. A call holds a slot while its simulated latency elapses (an asyncio
   sleep, which holds no thread) and while the env computes; calls past capacity queue.
3. A few daemon worker threads (`_Workers`) run env code: a local env's Python, or the
   blocking HTTP request of a remote one. So env compute never blocks the loop, and a
   hung env only holds a thread. The loop waits on each call with a deadline, counted
   from when a thread takes the call (time queued behind busy threads is not the env's);
   past it the call is abandoned: a replacement thread starts so capacity does not leak, the
   env instance is never used again, and the stuck thread closes it and exits when (if)
   its call returns.

Faults
------
An exception, a timeout or a malformed observation is counted in `pool.stats` and
isolated to its task. The task's env is dropped; with `max_retries` > 0 the pool builds
a fresh env (possibly on another server) and replays the task's reset and accepted
actions, which reproduces its state because envs are deterministic given the task,
then retries the step (`max_retries`, default 1, bounds the rebuilds per call). Every
reset gets the task's seed (`Task.reset_seed`), replays included. A replay is checked
against what the caller saw: a fingerprint of each observation (and end flags) is kept,
and a rebuilt env that answers differently ends the task with error "replay_diverged"
(counted) instead of carrying on from a state the model never saw; the caller restarts
the task from scratch. When retries run out the caller gets a final StepResult with
`error` set and `truncated` True. An action over `max_action_chars` ends its task with
"action_too_long" before reaching the env, local or remote alike. Nothing an env does
raises out of the pool.

Latency is simulated here, in the pool, for local and remote envs alike; pass
`latency=None` when a remote cluster's real latency is the one wanted.

A caller may cancel a pending `step` (asyncio cancellation): the env is dropped, since
the action may or may not have landed, and the task's next step rebuilds it from the
actions that did return.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Self

from tidejax.envs.actions import ACTION_ERRORS
from tidejax.envs.client import RemoteEnvFactory
from tidejax.envs.latency import LatencyModel
from tidejax.envs.protocol import (
    MAX_ACTION_CHARS,
    MAX_OBS_CHARS,
    MalformedObservation,
    StepResult,
    Task,
    TextEnv,
    validate_reset,
    validate_step,
)
from tidejax.envs.registry import make_env

EnvFactory = Callable[[Task], TextEnv]
FAULTS = ("exception", "timeout", "malformed_observation")
CLOSE_WAIT_S = 10.0  # how long closing the pool waits for its envs' close calls


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    capacity: int = 64  # env calls in flight at once (the env cluster's slots)
    step_timeout_s: float = 30.0
    reset_timeout_s: float = 60.0
    max_retries: int = 1  # fresh-env replays per failed call; 0 fails the task at once
    workers: int = 8  # threads running env code (more start when calls hang)
    max_obs_chars: int = MAX_OBS_CHARS
    max_action_chars: int = MAX_ACTION_CHARS
    # Episodes open at once (reset to finish or release); None: only `capacity` limits.
    max_open_episodes: int | None = None
    # Keep envs whose episode ended normally in a free list per env type and reset them for
    # later tasks and replays, instead of building one per reset (for envs slow to build,
    # e.g. JVM-backed ones). The contract: `reset` must fully re-initialise the env. An env
    # that faulted is closed, never reused. `workers=1` runs all env code on one thread
    # (plus a replacement only when a call hangs), for libraries that are not thread-safe.
    reuse_envs: bool = False

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        if not self.reset_timeout_s > 0:
            raise ValueError(f"reset_timeout_s must be > 0, got {self.reset_timeout_s}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.max_obs_chars < 1:
            raise ValueError(f"max_obs_chars must be >= 1, got {self.max_obs_chars}")
        if self.max_action_chars < 1:
            raise ValueError(f"max_action_chars must be >= 1, got {self.max_action_chars}")
        if self.max_open_episodes is not None and self.max_open_episodes < 1:
            raise ValueError(f"max_open_episodes must be >= 1 or None, "
                             f"got {self.max_open_episodes}")


@dataclasses.dataclass(frozen=True)
class PoolStats:
    resets: int = 0  # reset() calls
    steps: int = 0  # step() calls
    env_calls: int = 0  # calls sent to envs, replays included
    ok_calls: int = 0
    exception: int = 0
    timeout: int = 0
    malformed_observation: int = 0
    retries: int = 0  # fresh-env replays started
    recovered: int = 0  # reset/step calls that succeeded after a fault
    failed_tasks: int = 0  # tasks ended by a fault
    unknown_task: int = 0
    replay_diverged: int = 0  # rebuilt envs whose replay disagreed with what was seen
    action_too_long: int = 0  # actions refused for length (their tasks ended)
    # Actions an env's parser could not read (the model got an error observation).
    malformed: int = 0
    unknown_tool: int = 0
    bad_arguments: int = 0
    finished_tasks: int = 0  # tasks whose episode ended normally
    latency_s: float = 0.0  # simulated latency waited, summed over calls
    peak_in_flight: int = 0
    peak_open_episodes: int = 0
    reused_envs: int = 0  # resets served by an env from the free list (reuse_envs)

    @property
    def faults(self) -> int:
        return self.exception + self.timeout + self.malformed_observation

    def as_dict(self) -> dict[str, float | int]:
        return {**dataclasses.asdict(self), "faults": self.faults}


class _Job:
    __slots__ = ("abandoned", "finished", "fn", "future", "lock", "on_abandoned", "started_at")

    def __init__(self, fn: Callable[[], Any], on_abandoned: Callable[[], None] | None):
        self.fn = fn
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.lock = threading.Lock()
        self.finished = False
        self.abandoned = False
        self.on_abandoned = on_abandoned
        self.started_at: float | None = None  # time.monotonic() when a thread took it


async def _answer(job: _Job, budget_s: float) -> Any:
    """``job``'s result, given at most ``budget_s`` of the env's own time: the clock starts
    when a worker thread takes the job, so a call queued behind threads that other tasks'
    hung envs hold is not timed out for their hang (those threads are replaced at their own
    deadlines, so the queue moves)."""
    answer = asyncio.wrap_future(job.future)
    wait = budget_s
    try:
        while True:
            done, _ = await asyncio.wait({answer}, timeout=max(0.0, wait))
            if done:
                return answer.result()  # the env's exceptions, its own TimeoutError included
            started = job.started_at
            wait = budget_s if started is None else budget_s - (time.monotonic() - started)
            if started is not None and wait <= 0:
                raise TimeoutError(f"the env ran {time.monotonic() - started:.3f}s")
    finally:
        if not answer.done():  # given up on: a late result is dropped, not left unread
            answer.cancel()


class _Workers:
    """Daemon threads that run env calls; an abandoned (hung) call gets a replacement."""

    def __init__(self, n: int):
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = 0
        self._started = 0
        for _ in range(n):
            self._spawn()

    def _spawn(self) -> None:
        with self._lock:
            self._live += 1
            self._started += 1
            name = f"env-worker-{self._started}"
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    @property
    def live(self) -> int:
        return self._live

    def submit(self, fn: Callable[[], Any], on_abandoned: Callable[[], None] | None = None) -> _Job:
        job = _Job(fn, on_abandoned)
        self._queue.put(job)
        return job

    def abandon(self, job: _Job) -> bool:
        """The caller stopped waiting: a queued job is cancelled (it never runs); if a thread
        is stuck in the job, replace it.

        Returns whether the job was left running (its on_abandoned will run later).
        """
        with job.lock:
            if job.finished or job.future.cancel():  # cancel() is True once cancelled
                return False
            job.abandoned = True
        self._spawn()
        return True

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                with self._lock:
                    self._live -= 1
                return
            if job.future.set_running_or_notify_cancel():
                job.started_at = time.monotonic()
                try:
                    job.future.set_result(job.fn())
                except BaseException as e:  # noqa: BLE001 (envs may raise anything)
                    job.future.set_exception(e)
            # else: cancelled while queued, so nothing ran; it may still have been
            # abandoned first (the cancel reaches the future a moment after the deadline).
            with job.lock:
                job.finished = True
                abandoned = job.abandoned
            if abandoned:
                if job.on_abandoned is not None:
                    try:
                        job.on_abandoned()
                    except Exception:  # noqa: BLE001, S110 (cleanup of an env already given up on)
                        pass
                with self._lock:
                    self._live -= 1
                return  # a replacement took this thread's place when the job was abandoned

    def shutdown(self) -> None:
        for _ in range(self._live):
            self._queue.put(None)


@dataclasses.dataclass
class _TaskRecord:
    task: Task
    lock: asyncio.Lock
    env: TextEnv | None = None
    actions: list[str] = dataclasses.field(default_factory=list)
    # A fingerprint of each answer the caller saw (reset, then each step): replays must match.
    seen: list[bytes] = dataclasses.field(default_factory=list)
    holds_episode_slot: bool = False
    calls: int = 0  # numbers latency draws
    abandoned: bool = False  # the last call was left to a stuck thread, which closes its env


def local_env_factory(env_kwargs: dict[str, dict[str, Any]] | None = None) -> EnvFactory:
    """Envs in this process, built from the registry (kwargs per env type)."""
    kwargs = env_kwargs or {}
    return lambda task: make_env(task.env_type, **kwargs.get(task.env_type, {}))


class EnvPool:
    """Runs many tasks' envs concurrently with a cap, latency, timeouts and fault isolation.

    Envs come from `env_factory` (default: local envs from the registry) or, given
    `addresses`, from env servers chosen least-loaded first. The same API serves both.
    """

    def __init__(
        self,
        config: PoolConfig | None = None,
        *,
        env_factory: EnvFactory | None = None,
        addresses: Sequence[str] | None = None,
        latency: LatencyModel | None = None,
    ):
        self.config = config or PoolConfig()
        if env_factory is not None and addresses:
            raise ValueError("give env_factory or addresses, not both")
        if addresses:
            # The pool enforces its own deadlines; the socket timeout is only a backstop.
            backstop = max(self.config.step_timeout_s, self.config.reset_timeout_s)
            env_factory = RemoteEnvFactory(addresses, timeout_s=backstop)
        self.env_factory = env_factory or local_env_factory()
        self.latency = latency
        self._workers = _Workers(self.config.workers)
        self._closing: list[_Job] = []  # env closes submitted to the workers
        self._slots = asyncio.Semaphore(self.config.capacity)
        episodes = self.config.max_open_episodes
        self._episode_slots = asyncio.Semaphore(episodes) if episodes is not None else None
        self._open_episodes = 0
        self._free_envs: dict[str, list[TextEnv]] = {}  # reuse_envs: idle envs per env type
        self._tasks: dict[str, _TaskRecord] = {}
        self._counts: dict[str, float] = dataclasses.asdict(PoolStats())
        self._in_flight = 0
        self._closed = False

    # -- public API ---------------------------------------------------------------------

    @property
    def stats(self) -> PoolStats:
        return PoolStats(**self._counts)  # type: ignore[arg-type]

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def active_tasks(self) -> int:
        return len(self._tasks)

    async def reset(self, task: Task) -> StepResult:
        """Starts (or restarts) `task`; the result carries the first observation."""
        self._count("resets")
        if self._closed:
            raise RuntimeError("the pool is closed")
        if task.task_id in self._tasks:
            await self.release(task.task_id)
        rec = _TaskRecord(task, asyncio.Lock())
        self._tasks[task.task_id] = rec
        async with rec.lock:
            with self._forget_if_cancelled(rec):
                await self._take_episode_slot(rec)
                return await self._reset_locked(rec)

    async def _reset_locked(self, rec: _TaskRecord) -> StepResult:
        faults: list[str] = []
        latency = 0.0
        detail: Any = ""
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                self._count("retries")
            err, value, lat = await self._open(rec)
            latency += lat
            if err is None:
                if faults:
                    self._count("recovered")
                obs, info = value
                rec.seen = [_fingerprint(obs)]
                return StepResult(
                    rec.task.task_id, obs, info=info, latency_s=latency,
                    attempts=attempt + 1, faults=tuple(faults),
                )  # fmt: skip
            faults.append(err)
            detail = value
        return self._fail(rec, faults, detail, latency)

    async def step(self, task_id: str, action: str) -> StepResult:
        """Sends one action to the task's env; never raises for env faults."""
        self._count("steps")
        rec = self._tasks.get(task_id)
        if rec is None:
            self._count("unknown_task")
            return StepResult(
                task_id, "", truncated=True, error="unknown_task",
                info={"detail": "task was never reset, has finished, or was released"},
            )  # fmt: skip
        if len(action) > self.config.max_action_chars:
            async with rec.lock:
                self._count("action_too_long")
                detail = f"action of {len(action)} chars > {self.config.max_action_chars}"
                return self._fail(rec, ["action_too_long"], detail, 0.0)
        async with rec.lock:
            with self._drop_env_if_cancelled(rec):
                return await self._step_locked(rec, action)

    async def _step_locked(self, rec: _TaskRecord, action: str) -> StepResult:
        faults: list[str] = []
        latency = 0.0
        detail: Any = ""
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                self._count("retries")
            if rec.env is None:  # a previous attempt failed (or was cancelled): replay
                err, detail, lat = await self._rebuild(rec)
                latency += lat
                if err == "replay_diverged":  # another replay would not mend it
                    faults.append(err)
                    break
                if err is not None:
                    faults.append(err)
                    continue
            env = rec.env
            assert env is not None
            err, value, lat = await self._call(
                rec,
                lambda env=env: validate_step(env.step(action), self.config.max_obs_chars),
                reset=False,
                on_abandoned=env.close,
            )
            latency += lat
            if err is None:
                if faults:
                    self._count("recovered")
                obs, reward, terminated, truncated, info = value
                rec.actions.append(action)
                rec.seen.append(_fingerprint(obs, terminated, truncated))
                if info.get("action_error") in ACTION_ERRORS:
                    self._count(info["action_error"])
                if terminated or truncated:
                    self._count("finished_tasks")
                    self._forget(rec, close=not self._keep_env(rec))
                return StepResult(
                    rec.task.task_id, obs, reward, terminated, truncated, info,
                    latency_s=latency, attempts=attempt + 1, faults=tuple(faults),
                )  # fmt: skip
            faults.append(err)
            detail = value
            self._drop_env(rec)
        return self._fail(rec, faults, detail, latency)

    async def release(self, task_id: str) -> None:
        """Forgets a task and closes its env (e.g. a task the runtime cancels)."""
        rec = self._tasks.get(task_id)
        if rec is not None:
            async with rec.lock:
                if self._tasks.get(task_id) is rec:
                    self._forget(rec, close=True)

    async def aclose(self) -> None:
        """Releases every task and stops the worker threads."""
        for task_id in list(self._tasks):
            await self.release(task_id)
        self._closed = True
        for envs in self._free_envs.values():
            for env in envs:
                self._close_later(env)
        self._free_envs.clear()
        # Wait (bounded: an env may hang in close) for the closes still queued or running,
        # so an env the pool opened is closed by the time the pool is.
        pending = [asyncio.wrap_future(job.future) for job in self._closing
                   if not job.future.done()]
        self._closing.clear()
        if pending:
            await asyncio.wait(pending, timeout=CLOSE_WAIT_S)
        self._workers.shutdown()

    def _close_later(self, env: TextEnv) -> None:
        """Close an env on a worker (closing may be a request to a server): never waited
        for here, but `aclose` waits for every one still pending."""
        self._closing = [job for job in self._closing if not job.future.done()]
        self._closing.append(self._workers.submit(_quiet(env.close)))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- internals ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _forget_if_cancelled(self, rec: _TaskRecord) -> Iterator[None]:
        try:
            yield
        except asyncio.CancelledError:  # a reset the caller gave up on leaves no task
            self._forget(rec, close=True)
            raise

    @contextlib.contextmanager
    def _drop_env_if_cancelled(self, rec: _TaskRecord) -> Iterator[None]:
        try:
            yield
        except asyncio.CancelledError:
            # Whether the action was applied is unknown, so the env cannot be trusted;
            # the next step rebuilds it from the actions that did return.
            self._drop_env(rec)
            raise

    def _count(self, key: str, n: float = 1) -> None:
        self._counts[key] += n

    def _fail(self, rec: _TaskRecord, faults: list[str], detail: Any, latency: float) -> StepResult:
        self._count("failed_tasks")
        self._forget(rec, close=True)
        return StepResult(
            rec.task.task_id, "", truncated=True, error=faults[-1],
            info={"detail": str(detail)[:500]}, latency_s=latency,
            attempts=len(faults), faults=tuple(faults),
        )  # fmt: skip

    async def _take_episode_slot(self, rec: _TaskRecord) -> None:
        """Waits for an episode slot (with max_open_episodes); the task holds it until
        it is forgotten."""
        if self._episode_slots is not None:
            await self._episode_slots.acquire()
        rec.holds_episode_slot = True
        self._open_episodes += 1
        self._counts["peak_open_episodes"] = max(self._counts["peak_open_episodes"],
                                                 self._open_episodes)

    def _keep_env(self, rec: _TaskRecord) -> bool:
        """With reuse_envs, a cleanly finished task's env goes to the free list."""
        env = rec.env
        if not self.config.reuse_envs or env is None or rec.abandoned or self._closed:
            return False
        self._free_envs.setdefault(rec.task.env_type, []).append(env)
        rec.env = None
        return True

    def _forget(self, rec: _TaskRecord, close: bool) -> None:
        if self._tasks.get(rec.task.task_id) is rec:
            del self._tasks[rec.task.task_id]
        if rec.holds_episode_slot:
            rec.holds_episode_slot = False
            self._open_episodes -= 1
            if self._episode_slots is not None:
                self._episode_slots.release()
        if close:
            self._drop_env(rec)

    def _drop_env(self, rec: _TaskRecord) -> None:
        env, rec.env = rec.env, None
        # An env left to a stuck thread is closed by that thread when its call returns.
        if env is not None and not rec.abandoned:
            # Closing may mean a request to a server: do it on a worker, don't wait.
            self._close_later(env)
        rec.abandoned = False

    async def _open(self, rec: _TaskRecord) -> tuple[str | None, Any, float]:
        """Makes a fresh env (or, with reuse_envs, takes an idle one) for the task and
        resets it; sets rec.env on success."""
        holder: list[TextEnv] = []
        task, max_chars = rec.task, self.config.max_obs_chars

        free = self._free_envs.get(task.env_type)
        reused = free.pop() if free else None
        if reused is not None:
            self._count("reused_envs")

        def open_env() -> tuple[str, dict[str, Any]]:
            env = reused if reused is not None else self.env_factory(task)
            holder.append(env)
            return validate_reset(env.reset(seed=task.reset_seed, options={"task": task}),
                                  max_chars)

        def close_late() -> None:
            for env in holder:
                env.close()

        try:
            err, value, lat = await self._call(rec, open_env, reset=True,
                                               on_abandoned=close_late)
        except asyncio.CancelledError:
            if reused is not None and not holder:  # it never ran: close the idle env here
                self._close_later(reused)
            raise
        if err is None:
            rec.env = holder[0]
        elif holder and not rec.abandoned:
            self._close_later(holder[0])
        rec.abandoned = False
        return err, value, lat

    async def _rebuild(self, rec: _TaskRecord) -> tuple[str | None, Any, float]:
        """A fresh env brought to the task's current state by replaying its actions, each
        answer checked against the one the caller saw ("replay_diverged" if not)."""
        err, value, latency = await self._open(rec)
        if err is not None:
            return err, value, latency
        if _fingerprint(value[0]) != rec.seen[0]:
            return self._diverged(rec, "reset", latency)
        for i, action in enumerate(rec.actions, start=1):
            env = rec.env
            assert env is not None
            err, value, lat = await self._call(
                rec,
                lambda env=env, action=action: validate_step(
                    env.step(action), self.config.max_obs_chars
                ),
                reset=False,
                on_abandoned=env.close,
            )
            latency += lat
            if err is not None:
                self._drop_env(rec)
                return err, value, latency
            obs, _, terminated, truncated, _ = value
            if _fingerprint(obs, terminated, truncated) != rec.seen[i]:
                return self._diverged(rec, f"step {i}", latency)
        return None, None, latency

    def _diverged(self, rec: _TaskRecord, where: str, latency: float) -> tuple[str, str, float]:
        self._drop_env(rec)
        self._count("replay_diverged")
        detail = (f"replaying {len(rec.actions)} actions on a fresh env gave a different "
                  f"answer at {where} than the one seen: the env is not deterministic given "
                  f"the task and seed; restart the task")
        return "replay_diverged", detail, latency

    async def _call(
        self,
        rec: _TaskRecord,
        fn: Callable[[], Any],
        *,
        reset: bool,
        on_abandoned: Callable[[], None] | None,
    ) -> tuple[str | None, Any, float]:
        """Runs fn on a worker inside a capacity slot, after the simulated latency.

        Returns (None, value, latency) or (fault reason, detail, latency).
        """
        task = rec.task
        timeout = self.config.reset_timeout_s if reset else self.config.step_timeout_s
        latency = 0.0
        if self.latency is not None:
            latency = self.latency.sample(task.env_type, task.kind, task.task_id, rec.calls, reset)
        rec.calls += 1
        rec.abandoned = False
        async with self._slots:
            self._in_flight += 1
            self._counts["peak_in_flight"] = max(self._counts["peak_in_flight"], self._in_flight)
            self._count("env_calls")
            try:
                if latency >= timeout:  # the simulated cluster itself is too slow
                    await asyncio.sleep(timeout)
                    self._count("latency_s", timeout)
                    return self._fault("timeout", f"latency {latency:.3f}s > {timeout}s", timeout)
                if latency > 0:
                    await asyncio.sleep(latency)
                self._count("latency_s", latency)
                job = self._workers.submit(fn, on_abandoned)
                try:
                    value = await _answer(job, timeout - latency)
                except TimeoutError as e:  # ours (deadline) or the env's (e.g. a socket)
                    if not job.future.done():
                        rec.abandoned = self._workers.abandon(job)
                    return self._fault("timeout", f"no answer within {timeout}s {e}", latency)
                except asyncio.CancelledError:  # the caller gave up on this task
                    if not job.future.done():
                        rec.abandoned = self._workers.abandon(job)
                    raise
                except MalformedObservation as e:
                    return self._fault("malformed_observation", str(e), latency)
                except Exception as e:  # noqa: BLE001 (isolating env faults is the point)
                    return self._fault("exception", f"{type(e).__name__}: {e}", latency)
                self._count("ok_calls")
                return None, value, latency
            finally:
                self._in_flight -= 1

    def _fault(self, reason: str, detail: str, latency: float) -> tuple[str, str, float]:
        self._count(reason)
        return reason, detail, latency


def _fingerprint(obs: str, terminated: bool = False, truncated: bool = False) -> bytes:
    """What a replay must reproduce of one answer, kept small (observations can be long)."""
    data = f"{int(terminated)}{int(truncated)}".encode() + obs.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16).digest()


def _quiet(fn: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001, S110 (closing a discarded env is best effort)
            pass

    return run

"""EnvPool: equivalence with direct envs, the concurrency cap, latency, fault isolation."""

import asyncio
import threading
import time

import pytest

from tidejax.envs import (
    EnvPool,
    FaultConfig,
    FaultInjector,
    LatencyModel,
    LatencySpec,
    PoolConfig,
    Task,
    get_catalogue,
    local_env_factory,
    make_env,
    make_expert,
    make_tasks,
)
from tidejax.envs.pool import FAULTS


@pytest.fixture(scope="module", autouse=True)
def warm_catalogue():
    get_catalogue()  # so no env call pays for the first build inside a timeout


def mixed_tasks(seed: int, ws_groups: int, hh_groups: int) -> list[Task]:
    return make_tasks("webshop", "eval", ws_groups, 4, seed=seed) + make_tasks(
        "household", "eval", hh_groups, 2, seed=seed
    )


async def drive_with_expert(pool: EnvPool, tasks: list[Task]) -> dict:
    """Runs each task with its expert, which reads a local shadow env fed the same
    actions; every observation the pool returns must equal the shadow's."""

    async def one(task: Task):
        shadow = make_env(task.env_type)
        expert = make_expert(shadow, task.env_type)
        obs, info = shadow.reset(options={"task": task})
        result = await pool.reset(task)
        while result.error is None and not result.done:
            assert result.obs == obs
            action = expert.act(obs, info)
            obs, reward, terminated, _truncated, info = shadow.step(action)
            result = await pool.step(task.task_id, action)
        if result.error is None:
            assert (result.obs, result.reward, result.terminated) == (obs, reward, terminated)
        return result

    results = await asyncio.gather(*(one(t) for t in tasks))
    return {t.task_id: r for t, r in zip(tasks, results)}


def test_pool_reproduces_direct_episodes():
    tasks = mixed_tasks(seed=0, ws_groups=3, hh_groups=2)

    async def main():
        latency = LatencyModel.default(time_scale=1e-3)
        async with EnvPool(PoolConfig(capacity=8), latency=latency) as pool:
            results = await drive_with_expert(pool, tasks)
            return results, pool.stats, pool.active_tasks

    results, stats, active = asyncio.run(main())
    assert all(r.ok and r.terminated and r.reward == 1.0 for r in results.values())
    assert stats.finished_tasks == len(tasks) and stats.faults == 0
    assert stats.ok_calls == stats.env_calls == stats.resets + stats.steps
    assert stats.latency_s > 0 and active == 0


class CountingEnv:
    """Sleeps in every step and records how many steps run at once."""

    lock = threading.Lock()

    def __init__(self, tracker: dict, delay: float, turns: int = 3):
        self.tracker, self.delay, self.turns, self.n = tracker, delay, turns, 0

    def reset(self, seed=None, options=None):
        self.n = 0
        return "start", {}

    def step(self, action):
        with self.lock:
            self.tracker["now"] += 1
            self.tracker["max"] = max(self.tracker["max"], self.tracker["now"])
        time.sleep(self.delay)
        with self.lock:
            self.tracker["now"] -= 1
        self.n += 1
        return f"step {self.n}", 0.0, self.n >= self.turns, False, {}

    def close(self):
        pass


def run_all(pool: EnvPool, tasks: list[Task], action="go") -> list:
    async def one(task):
        r = await pool.reset(task)
        while r.ok and not r.done:
            r = await pool.step(task.task_id, action)
        return r

    return asyncio.gather(*(one(t) for t in tasks))


def test_concurrency_cap_bounds_env_calls():
    tracker = {"now": 0, "max": 0}
    tasks = make_tasks("webshop", "train", 12, 1, seed=0)

    async def main():
        config = PoolConfig(capacity=3, workers=8)
        async with EnvPool(config, env_factory=lambda t: CountingEnv(tracker, 0.01)) as pool:
            results = await run_all(pool, tasks)
            return results, pool.stats

    results, stats = asyncio.run(main())
    assert all(r.ok and r.terminated for r in results)
    assert tracker["max"] == 3 and stats.peak_in_flight == 3


def test_env_calls_run_off_the_event_loop():
    tracker = {"now": 0, "max": 0}
    task = make_tasks("webshop", "train", 1, 1, seed=0)[0]

    async def main():
        async with EnvPool(env_factory=lambda t: CountingEnv(tracker, 0.3, turns=1)) as pool:
            await pool.reset(task)
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            tick = asyncio.create_task(ticker())
            result = await pool.step(task.task_id, "go")
            tick.cancel()
            return result, ticks

    result, ticks = asyncio.run(main())
    assert result.terminated and ticks >= 10  # the loop kept running during the 0.3 s step


def test_simulated_latency_is_waited_and_can_time_out():
    task = make_tasks("webshop", "test", 1, 1, seed=0)[0]
    latency = LatencyModel({"webshop": LatencySpec(median_s=0.03, p99_s=0.06)}, time_scale=1.0)

    async def main():
        async with EnvPool(latency=latency) as pool:
            t0 = time.perf_counter()
            first = await pool.reset(task)
            second = await pool.step(task.task_id, "search[tea]")
            wall = time.perf_counter() - t0
        slow = LatencyModel({"webshop": LatencySpec(median_s=5.0, p99_s=6.0)})
        config = PoolConfig(reset_timeout_s=0.05, max_retries=0)
        async with EnvPool(config, latency=slow) as pool:
            t0 = time.perf_counter()
            timed_out = await pool.reset(task)
            return first, second, wall, timed_out, time.perf_counter() - t0, pool.stats

    first, second, wall, timed_out, timeout_wall, stats = asyncio.run(main())
    assert first.latency_s > 0.005 and second.latency_s > 0.005
    assert wall >= first.latency_s + second.latency_s
    assert timed_out.error == "timeout" and timed_out.truncated
    assert timeout_wall < 1.0 and stats.timeout == 1 and stats.failed_tasks == 1


def test_faults_are_isolated_counted_and_every_task_ends():
    """20% of env calls fail (exception, hang past the timeout, or garbage)."""
    tasks = mixed_tasks(seed=1, ws_groups=10, hh_groups=4)
    injector = FaultInjector(local_env_factory(), FaultConfig.uniform(0.2, hang_s=1.0, seed=7))
    config = PoolConfig(capacity=32, step_timeout_s=0.3, reset_timeout_s=0.3, max_retries=0)

    async def main():
        latency = LatencyModel.default(time_scale=1e-3)
        async with EnvPool(config, env_factory=injector, latency=latency) as pool:
            results = await drive_with_expert(pool, tasks)
            return results, pool.stats

    results, stats = asyncio.run(main())
    injected = injector.injected
    assert len(results) == len(tasks) and all(r.done for r in results.values())
    assert all(injected[k] > 0 for k in FAULTS)
    for kind in FAULTS:  # every injected fault was seen, under its own name
        assert getattr(stats, kind) == injected[kind], kind
    failed = [r for r in results.values() if not r.ok]
    assert {r.error for r in failed} <= set(FAULTS) and all(r.truncated for r in failed)
    assert stats.failed_tasks == len(failed) == stats.faults  # fail-fast: one fault, one task
    assert stats.finished_tasks + stats.failed_tasks == len(tasks)
    assert all(r.reward == 1.0 for r in results.values() if r.ok)


def test_retries_rebuild_state_by_replay():
    tasks = mixed_tasks(seed=2, ws_groups=8, hh_groups=3)
    injector = FaultInjector(local_env_factory(), FaultConfig.uniform(0.2, hang_s=4.0, seed=3))
    # Timeouts well above a real step even on a loaded 2-core machine (an injected exception
    # may first run the env's step; at 0.3 s two of them were counted as timeouts there),
    # and hangs well above the timeouts, so every fault is seen as the kind injected.
    config = PoolConfig(capacity=32, step_timeout_s=1.5, reset_timeout_s=1.5, max_retries=6)

    async def main():
        async with EnvPool(config, env_factory=injector) as pool:
            results = await drive_with_expert(pool, tasks)  # asserts replayed obs are exact
            return results, pool.stats

    results, stats = asyncio.run(main())
    for kind in FAULTS:
        assert getattr(stats, kind) == injector.injected[kind], kind
    won = sum(r.ok and r.reward == 1.0 for r in results.values())
    assert won >= 0.75 * len(tasks)
    assert stats.recovered > 0 and stats.retries >= stats.recovered
    assert any(r.ok and r.faults for r in results.values())  # faults met and survived


def test_a_hung_env_does_not_hold_up_others():
    tracker = {"now": 0, "max": 0}
    tasks = make_tasks("webshop", "train", 6, 1, seed=0)
    stuck = tasks[0].task_id

    def factory(task):
        return CountingEnv(tracker, 2.0 if task.task_id == stuck else 0.001)

    async def main():
        async with EnvPool(
            PoolConfig(workers=2, step_timeout_s=0.2, max_retries=0), env_factory=factory
        ) as pool:
            t0 = time.perf_counter()
            results = await run_all(pool, tasks)
            return results, time.perf_counter() - t0, pool._workers.live

    results, wall, live = asyncio.run(main())
    assert results[0].error == "timeout" and all(r.ok and r.terminated for r in results[1:])
    assert wall < 1.5 and live >= 3  # a replacement worker took the stuck thread's place


def test_unknown_tasks_and_factory_errors_are_reported():
    def broken(task):
        raise OSError("env cluster unreachable")

    task = make_tasks("webshop", "train", 1, 1, seed=0)[0]

    async def main():
        async with EnvPool(PoolConfig(max_retries=0), env_factory=broken) as pool:
            unknown = await pool.step("nope", "click[x]")
            failed = await pool.reset(task)
            after = await pool.step(task.task_id, "click[x]")
            return unknown, failed, after, pool.stats

    unknown, failed, after, stats = asyncio.run(main())
    assert unknown.error == "unknown_task" and after.error == "unknown_task"
    assert failed.error == "exception" and "unreachable" in failed.info["detail"]
    assert stats.exception == 1 and stats.unknown_task == 2


def test_release_and_restart_a_task():
    task = make_tasks("household", "train", 1, 1, seed=0)[0]

    async def main():
        async with EnvPool() as pool:
            a = await pool.reset(task)
            await pool.step(task.task_id, "look")
            b = await pool.reset(task)  # restarting replaces the old env
            await pool.release(task.task_id)
            return a, b, pool.active_tasks, await pool.step(task.task_id, "look")

    a, b, active, gone = asyncio.run(main())
    assert a.obs == b.obs and active == 0 and gone.error == "unknown_task"


def test_cancelled_step_drops_the_env_and_the_task_goes_on():
    tracker = {"now": 0, "max": 0}
    task = make_tasks("webshop", "train", 1, 1, seed=0)[0]
    made = []

    def factory(t):
        made.append(CountingEnv(tracker, 0.2, turns=3))
        return made[-1]

    async def main():
        async with EnvPool(env_factory=factory) as pool:
            await pool.reset(task)
            first = await pool.step(task.task_id, "go")
            pending = asyncio.create_task(pool.step(task.task_id, "go"))
            await asyncio.sleep(0.05)
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            second = await pool.step(task.task_id, "go")  # rebuilt: reset + 1 replayed step
            return first, second

    first, second = asyncio.run(main())
    assert first.obs == "step 1" and second.obs == "step 2" and len(made) == 2


def test_a_hung_env_does_not_time_out_the_calls_queued_behind_it():
    """One worker thread: task A's reset hangs past its deadline; task B's reset, queued
    behind it, still answers, since its clock starts when a thread takes it."""
    first, second = make_tasks("webshop", "test", 2, 1, seed=0)
    base = local_env_factory()

    class HangingReset:
        def __init__(self, env):
            self.env = env

        def reset(self, *args, **kwargs):
            time.sleep(1.0)
            return self.env.reset(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.env, name)

    def factory(task):
        env = base(task)
        return HangingReset(env) if task.task_id == first.task_id else env

    config = PoolConfig(capacity=4, workers=1, reset_timeout_s=0.3, max_retries=0)

    async def main():
        async with EnvPool(config, env_factory=factory) as pool:
            a, b = await asyncio.gather(pool.reset(first), pool.reset(second))
            return a, b, pool.stats

    a, b, stats = asyncio.run(main())
    assert a.error == "timeout" and a.truncated
    assert b.error is None and b.obs and not b.truncated
    assert stats.timeout == 1 and stats.ok_calls == 1

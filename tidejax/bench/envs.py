"""Env benchmark: steps/s in process and through an env server, expert success rates.

    python -m tidejax.bench.envs [--episodes N] [--quick] [--env NAME ...]

Prints one line per measurement and ends with
`expert_success=<fraction> local_steps_per_s=<n> server_steps_per_s=<n>`, where
expert_success is the WebShop expert on the WebShop test split (goals 0-499, as in
WebShop), local steps/s is the random policy on WebShop envs in this process, and
server steps/s is the same workload through an EnvPool (16 in flight, no simulated
latency) against a server in a child process. Each `--env NAME` (a built-in, a plugin
or "package.module:Class") adds the same lines for that env, before the last one.
A benchmark, not a timed test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

from tidejax.envs import (
    EnvPool,
    FaultConfig,
    FaultInjector,
    LatencyModel,
    PoolConfig,
    RandomPolicy,
    Task,
    get_catalogue,
    get_spec,
    local_env_factory,
    make_env,
    make_expert,
    make_tasks,
    run_episode,
)
from tidejax.envs.protocol import Split


def expert_success(env_type: str, split: Split, n: int) -> tuple[float, float]:
    env = make_env(env_type)
    expert = make_expert(env, env_type)
    spec = get_spec(env_type)
    episodes = [
        run_episode(
            env,
            expert,
            Task(f"x{i}", f"x{i}", split, env_type, i, spec.default_max_turns),
        )
        for i in range(min(n, spec.split_sizes[split]))
    ]
    won = sum(e.won for e in episodes) / len(episodes)
    turns = sum(len(e.turns) for e in episodes) / len(episodes)
    return won, turns


def local_steps_per_s(env_type: str, n_episodes: int) -> float:
    env = make_env(env_type)
    policy = RandomPolicy(seed=0)
    tasks = make_tasks(env_type, "train", n_episodes, 1, seed=1)
    steps = 0
    t0 = time.perf_counter()
    for task in tasks:
        steps += 1 + len(run_episode(env, policy, task).turns)  # the reset counts as a call
    return steps / (time.perf_counter() - t0)


async def _pool_run(pool: EnvPool, tasks: list[Task]) -> int:
    async def one(task: Task, seed: int) -> int:
        policy = RandomPolicy(seed)
        result = await pool.reset(task)
        calls = 1
        while not result.done and result.error is None:
            result = await pool.step(task.task_id, policy.act(result.obs, result.info))
            calls += 1
        return calls

    counts = await asyncio.gather(*(one(t, i) for i, t in enumerate(tasks)))
    return sum(counts)


def server_steps_per_s(env_type: str, n_episodes: int, concurrency: int = 16) -> float:
    cmd = [sys.executable, "-m", "tidejax.envs.server", "--host", "127.0.0.1", "--port", "0",
           "--env", env_type]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"server did not start: {line!r}")
        address = line.rsplit(" ", 1)[-1].strip()
        tasks = make_tasks(env_type, "train", n_episodes, 1, seed=2)

        async def run() -> float:
            async with EnvPool(PoolConfig(capacity=concurrency), addresses=[address]) as pool:
                t0 = time.perf_counter()
                calls = await _pool_run(pool, tasks)
                return calls / (time.perf_counter() - t0)

        return asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def faulty_pool(n_groups: int) -> dict[str, int]:
    """20% of env calls fail; every task must end with a result and every fault be counted.

    Counted timeouts can exceed injected hangs: with the long-tail latency some calls
    run past the 0.5 s deadline on their own.
    """
    tasks = make_tasks("webshop", "eval", n_groups, 4, seed=3, long_tail_fraction=0.25)
    injector = FaultInjector(local_env_factory(), FaultConfig.uniform(0.2, hang_s=2.0, seed=3))
    config = PoolConfig(capacity=32, step_timeout_s=0.5, reset_timeout_s=0.5, max_retries=3)

    async def run() -> dict[str, int]:
        latency = LatencyModel.default(time_scale=0.01, seed=3)
        async with EnvPool(config, env_factory=injector, latency=latency) as pool:
            await _pool_run(pool, tasks)
            s = pool.stats
        injected = injector.injected
        return {
            "tasks": len(tasks),
            "ended": s.finished_tasks + s.failed_tasks,
            "finished": s.finished_tasks,
            "failed": s.failed_tasks,
            "recovered_calls": s.recovered,
            **{f"{k}_injected": v for k, v in injected.items()},
            **{f"{k}_counted": getattr(s, k) for k in injected},
        }

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=300, help="random episodes per throughput run")
    p.add_argument("--quick", action="store_true", help="fewer episodes (a smoke run)")
    p.add_argument("--env", action="append", default=[], dest="envs", metavar="NAME",
                   help="also measure this env type (built-in, plugin or 'module:Class')")
    args = p.parse_args(argv)
    n = 40 if args.quick else args.episodes
    for name in args.envs:  # an unknown name fails before any measurement
        get_spec(name)

    t0 = time.perf_counter()
    get_catalogue()
    print(f"webshop catalogue + BM25 index: {time.perf_counter() - t0:.2f} s")

    ws_success, ws_turns = expert_success("webshop", "test", 500)
    print(f"webshop expert: success={ws_success:.3f} mean_turns={ws_turns:.1f} (500 test goals)")
    hh_success, hh_turns = expert_success("household", "test", 200)
    print(f"household expert: success={hh_success:.3f} mean_turns={hh_turns:.1f} (200 test goals)")

    local = local_steps_per_s("webshop", n)
    print(f"webshop local: {local:.0f} steps/s (random policy, {n} episodes, one thread)")
    hh_local = local_steps_per_s("household", n)
    print(f"household local: {hh_local:.0f} steps/s (random policy, {n} episodes, one thread)")

    server = server_steps_per_s("webshop", n)
    print(f"webshop via server: {server:.0f} steps/s (EnvPool, 16 in flight, one server process)")

    faults = faulty_pool(8 if args.quick else 16)
    print(
        "faulty pool (20% faults, max_retries=3): "
        + " ".join(f"{k}={v}" for k, v in faults.items())
    )

    for name in args.envs:
        if get_spec(name).expert is not None:
            won, turns = expert_success(name, "test", 200)
            print(f"{name} expert: success={won:.3f} mean_turns={turns:.1f}")
        print(f"{name} local: {local_steps_per_s(name, n):.0f} steps/s (random policy)")
        print(f"{name} via server: {server_steps_per_s(name, n):.0f} steps/s (EnvPool)")

    last = f"expert_success={ws_success:.3f} local_steps_per_s={local:.0f}"
    print(f"{last} server_steps_per_s={server:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The TextWorld-Express adapter (optional extra): its gold-path expert wins through the
pool, unreadable actions do not crash a task, resets are deterministic given the task,
and the JVM-backed library instances are reused, not started per episode."""

import asyncio
import shutil

import pytest

pytest.importorskip("textworld_express")
if shutil.which("java") is None:
    pytest.skip("TextWorld-Express needs a Java runtime", allow_module_level=True)

from tidejax.config import run_config_from_dict  # noqa: E402
from tidejax.envs import (EnvPool, PoolConfig, get_spec, make_env, make_expert,  # noqa: E402
                          make_tasks)
from tidejax.envs import textworld_express as twx  # noqa: E402

NAME = "tidejax.envs.textworld_express:TextWorldExpressEnv"


def test_settings_are_checked_at_load():
    cfg = run_config_from_dict({"env_type": NAME, "env": {"game": "coin"}})
    assert cfg.env_kwargs() == {"game": "coin"}
    with pytest.raises(ValueError, match=r"env\.step_limit"):
        run_config_from_dict({"env_type": NAME, "env": {"step_limit": 0}})


def test_expert_wins_through_the_pool_and_instances_are_reused():
    spec = get_spec(NAME)
    tasks = make_tasks(NAME, "train", 3, 1, seed=0)

    async def run():
        results = []
        async with EnvPool(PoolConfig(max_retries=0, reset_timeout_s=120)) as pool:
            for task in tasks:  # one after another: one JVM serves them all
                env = make_env(NAME)  # a scripted expert reads a local twin's gold path
                first = await pool.reset(task)
                env.reset(seed=task.reset_seed, options={"task": task})
                expert = make_expert(env, NAME)
                result = first
                while not result.done and result.ok:
                    action = expert.act(result.obs, result.info)
                    result = await pool.step(task.task_id, action)
                    twin_obs = env.step(action)[0]  # the expert's turn counter follows
                    assert twin_obs == result.obs  # two JVMs, one game: deterministic
                env.close()
                results.append((first, result))
            bad = await pool.reset(tasks[0])
            junk = await pool.step(tasks[0].task_id, "fly to the moon")
            return results, bad, junk, pool.stats

    results, bad, junk, stats = asyncio.run(run())
    assert spec.expert is not None
    for first, last in results:
        assert first.ok and first.info["admissible_actions"]
        assert last.ok and last.terminated and last.info["won"] and last.reward == 1.0
    assert bad.obs == results[0][0].obs  # the same task resets to the same game
    assert junk.ok and not junk.done  # an unknown command is an observation, not a crash
    assert stats.failed_tasks == 0
    # Two live episodes at most (the pool's and the twin): at most two JVMs started.
    assert sum(len(v) for v in twx._FREE.values()) <= 2

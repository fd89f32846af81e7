"""Task, registry, GRPO task groups and the latency model."""

import math
import subprocess
import sys

import numpy as np
import pytest

from tidejax.envs import (
    LatencyModel,
    LatencySpec,
    Task,
    env_types,
    expert_demonstrations,
    get_catalogue,
    get_spec,
    make_env,
    make_tasks,
)
from tidejax.envs.latency_spec import Z99


def test_task_validation_names_the_field():
    ok = {"task_id": "a", "group_id": "g", "split": "train", "env_type": "webshop", "goal_index": 0,
              "max_turns": 5}  # fmt: skip
    Task(**ok)
    for field, bad in [("split", "dev"), ("goal_index", -1), ("max_turns", 0), ("task_id", "")]:
        with pytest.raises(ValueError, match=field):
            Task(**{**ok, field: bad})
    assert Task.from_dict(Task(**ok).to_dict()) == Task(**ok)
    with pytest.raises(ValueError, match="unknown"):
        Task.from_dict({**ok, "extra": 1})
    with pytest.raises(ValueError, match="missing"):
        Task.from_dict({"task_id": "a"})


def test_registry():
    assert {"webshop", "household"} <= set(env_types())
    with pytest.raises(ValueError, match="unknown env type"):
        get_spec("nope")
    assert get_spec("webshop").split_sizes == {k: len(v) for k, v in get_catalogue().splits.items()}
    assert get_spec("webshop").default_max_turns == 20
    assert get_spec("household").default_max_turns > get_spec("webshop").default_max_turns
    assert hasattr(make_env("household"), "step")


def test_make_tasks_builds_grpo_groups():
    tasks = make_tasks("webshop", "train", n_groups=6, group_size=4, seed=1)
    assert len(tasks) == 24 and len({t.task_id for t in tasks}) == 24
    groups: dict[str, list[Task]] = {}
    for t in tasks:
        groups.setdefault(t.group_id, []).append(t)
    assert len(groups) == 6 and all(len(g) == 4 for g in groups.values())
    assert all(len({t.goal_index for t in g}) == 1 for g in groups.values())
    assert len({g[0].goal_index for g in groups.values()}) == 6  # distinct goals
    assert make_tasks("webshop", "train", 6, 4, seed=1) == tasks
    assert make_tasks("webshop", "train", 6, 4, seed=2) != tasks
    assert all(t.max_turns == 20 and t.kind == "normal" for t in tasks)
    tail = make_tasks("household", "eval", 3, 2, seed=0, long_tail_fraction=1.0, max_turns=9)
    assert all(t.kind == "long_tail" and t.max_turns == 9 for t in tail)
    with pytest.raises(ValueError, match="group_size"):
        make_tasks("webshop", "train", 1, 0, seed=0)


def test_latency_spec_fits_median_and_p99():
    spec = LatencySpec(median_s=0.2, p99_s=2.0)
    assert spec.sigma() == pytest.approx(math.log(10) / Z99)
    model = LatencyModel({"webshop": spec}, time_scale=1.0, seed=0)
    draws = np.array([model.sample("webshop", "normal", f"t{i}", 0, False) for i in range(20000)])
    assert np.median(draws) == pytest.approx(0.2, rel=0.05)
    assert np.quantile(draws, 0.99) == pytest.approx(2.0, rel=0.15)
    tail = np.array([model.sample("webshop", "long_tail", f"t{i}", 0, False) for i in range(20000)])
    assert np.median(tail) == pytest.approx(0.2, rel=0.05)
    assert np.quantile(tail, 0.99) > 3 * np.quantile(draws, 0.99)  # heavier tail
    assert draws.max() <= 2.0 * spec.max_over_p99


def test_latency_time_scale_and_determinism():
    fast = LatencyModel.default(time_scale=1e-3, seed=4)
    slow = LatencyModel.default(time_scale=1.0, seed=4)
    a = fast.sample("webshop", "normal", "task-1", 3, False)
    assert a == pytest.approx(slow.sample("webshop", "normal", "task-1", 3, False) * 1e-3)
    assert a == fast.sample("webshop", "normal", "task-1", 3, False)
    assert a != fast.sample("webshop", "normal", "task-1", 4, False)
    assert LatencyModel.default(time_scale=0).sample("webshop", "normal", "x", 0, True) == 0
    with pytest.raises(ValueError, match="p99_s"):
        LatencySpec(median_s=1.0, p99_s=0.5)
    with pytest.raises(ValueError, match="time_scale"):
        LatencyModel({}, time_scale=-1)


def test_envs_never_import_jax():
    # bm25s would initialise a JAX backend at import (and grab GPU memory in an env
    # server); the envs must stay off JAX entirely.
    code = (
        "import sys, tidejax.envs as e; e.get_catalogue(); e.make_env('webshop').reset(seed=0); "
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_smaller_shop_draws_goals_and_demos_from_its_own_splits():
    """env kwargs that shrink the catalogue shrink the splits tasks and demos draw from."""
    small = {"catalogue": {"n_products": 60, "seed": 3}}
    sizes = get_spec("webshop").sizes(small)
    assert sizes == {k: len(v) for k, v in make_env("webshop", **small).catalogue.splits.items()}
    assert sizes["eval"] < get_spec("webshop").split_sizes["eval"]
    assert get_spec("webshop").sizes(None) == get_spec("webshop").split_sizes
    tasks = make_tasks("webshop", "eval", sizes["eval"], group_size=1, seed=0, env_kwargs=small)
    assert sorted(t.goal_index for t in tasks) == list(range(sizes["eval"]))  # the small split
    env = make_env("webshop", **small)
    demos = expert_demonstrations("webshop", 5, seed=0, env_kwargs=small)
    assert len(demos) == 5 and all(d.won for d in demos)
    asins = {p.asin for p in env.catalogue.products}
    clicked = {a[len("click["):-1] for d in demos for _, a in d.turns if a.startswith("click[")}
    assert clicked & asins  # the demos bought from the small shop's products
    with pytest.raises(ValueError, match="n_products"):
        make_env("webshop", catalogue={"n_products": 10})

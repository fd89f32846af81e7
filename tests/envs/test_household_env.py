"""The household (ALFWorld-like) env: scenes, mechanics, goals, determinism."""

import pytest

from tidejax.envs import HouseholdEnv, Task
from tidejax.envs.household import SPLIT_SIZES, TASK_TYPES, _kind, make_scene


def reset(env: HouseholdEnv, index: int, split="train", max_turns=30):
    return env.reset(options={"task": Task("h", "h", split, "household", index, max_turns)})


def find_index(pred, split="train") -> int:
    return next(i for i in range(SPLIT_SIZES[split]) if pred(make_scene(0, split, i)))


def test_scenes_are_deterministic_and_cover_all_task_types():
    assert make_scene(0, "train", 7) == make_scene(0, "train", 7)
    assert make_scene(0, "train", 7) != make_scene(0, "eval", 7)
    kinds = {make_scene(0, "train", i).goal.task_type for i in range(200)}
    assert kinds == set(TASK_TYPES)
    for i in range(300):  # never solved at the start
        env = HouseholdEnv()
        reset(env, i)
        assert not env.goal_reached()


def test_reset_observation_and_admissible_actions():
    env = HouseholdEnv()
    obs, info = reset(env, 0)
    assert obs.startswith("You are in the middle of a ") and "Your task is to: " in obs
    assert info["instruction"] in obs
    assert all(a.startswith("go to ") for a in info["admissible_actions"][:-2])
    assert info["admissible_actions"][-2:] == ["inventory", "look"]


def test_closed_receptacles_hide_contents_until_opened():
    i = find_index(lambda s: any(s.contents[r] for r in s.receptacles if _kind(r) == "drawer"))
    env = HouseholdEnv()
    reset(env, i)
    drawer = next(
        r for r in env.scene.receptacles if _kind(r) == "drawer" and env.scene.contents[r]
    )
    obs, *_ = env.step(f"go to {drawer}")
    assert obs == f"You arrive at {drawer}. The {drawer} is closed."
    obs, *_ = env.step(f"open {drawer}")
    first = env.scene.contents[drawer][0]
    assert obs.startswith(f"You open the {drawer}.") and f"a {first}" in obs
    obs, *_, info = env.step(f"take {first} from {drawer}")
    assert obs == f"You pick up the {first} from the {drawer}." and info["valid"]
    obs, *_ = env.step("inventory")
    assert obs == f"You are carrying: a {first}."


def test_invalid_actions_print_nothing_happens_and_change_nothing():
    env = HouseholdEnv()
    reset(env, 0)
    before = (
        env.state.location,
        env.state.held,
        {k: list(v) for k, v in env.state.contents.items()},
    )
    for bad in ("fly to the moon", "take mug 1 from cabinet 1", "open cabinet 1", "go to sofa 9"):
        obs, r, _term, _trunc, info = env.step(bad)
        assert obs == "Nothing happens." and not info["valid"] and r == 0.0
    after = (
        env.state.location,
        env.state.held,
        {k: list(v) for k, v in env.state.contents.items()},
    )
    assert before == after


def test_clean_and_put_solves_a_clean_goal():
    i = find_index(lambda s: s.goal.task_type == "clean")
    env = HouseholdEnv()
    reset(env, i, max_turns=50)
    g, scene = env.goal, env.scene
    src, obj = next(
        (r, o) for r in scene.receptacles for o in scene.contents[r] if _kind(o) == g.obj
    )
    sink = next(r for r in scene.receptacles if _kind(r) == "sinkbasin")
    target = next(r for r in scene.receptacles if _kind(r) == g.target)
    steps = [f"go to {src}", f"open {src}", f"take {obj} from {src}", f"go to {target}"]
    steps += [f"open {target}", f"put {obj} in/on {target}"]
    for a in steps:
        *_, term, _, _ = env.step(a)
    assert not term  # placed but not clean yet
    steps = [f"take {obj} from {target}", f"go to {sink}", f"clean {obj} with {sink}"]
    steps += [f"examine {obj}", f"go to {target}", f"put {obj} in/on {target}"]
    for a in steps:
        obs, r, term, _trunc, _info = env.step(a)
    assert term and r == 1.0 and obs.endswith("You have completed the task.")
    with pytest.raises(RuntimeError):
        env.step("look")


def test_action_parsing_is_tolerant():
    env = HouseholdEnv()
    reset(env, 0)
    r = env.scene.receptacles[1]
    obs, *_ = env.step(f"  Go To {r.replace(' ', '')}. ")
    assert obs.startswith(f"You arrive at {r}.")


def test_turn_cap():
    env = HouseholdEnv()
    reset(env, 0, max_turns=2)
    assert env.step("look")[3] is False
    assert env.step("look")[3] is True

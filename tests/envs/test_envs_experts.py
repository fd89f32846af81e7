"""Expert and random policies, SFT demonstrations and prompt helpers."""

import pytest

from tidejax.envs import (
    RandomPolicy,
    Task,
    action_format,
    expert_demonstrations,
    format_prompt,
    get_spec,
    make_env,
    make_expert,
    run_episode,
)


def run_split(env_type: str, policy_factory, split: str, n: int):
    env = make_env(env_type)
    policy = policy_factory(env)
    turns = get_spec(env_type).default_max_turns
    return [
        run_episode(env, policy, Task(f"t{i}", f"g{i}", split, env_type, i, turns))
        for i in range(n)
    ]


def test_webshop_expert_wins_95_percent_of_test_goals():
    episodes = run_split("webshop", lambda env: make_expert(env, "webshop"), "test", 500)
    success = sum(e.won for e in episodes) / len(episodes)
    assert success >= 0.95, success
    assert max(len(e.turns) for e in episodes) <= 20


def test_household_expert_wins_and_has_longer_horizons():
    hh = run_split("household", lambda env: make_expert(env, "household"), "test", 200)
    ws = run_split("webshop", lambda env: make_expert(env, "webshop"), "test", 100)
    assert sum(e.won for e in hh) / len(hh) >= 0.95
    mean = lambda eps: sum(len(e.turns) for e in eps) / len(eps)
    assert mean(hh) > mean(ws)


@pytest.mark.parametrize("env_type", ["webshop", "household"])
def test_random_policy_is_a_low_floor(env_type):
    episodes = run_split(env_type, lambda env: RandomPolicy(seed=0), "eval", 60)
    assert sum(e.won for e in episodes) / len(episodes) < 0.3
    assert all(e.terminated or e.truncated for e in episodes)


def test_expert_demonstrations_for_sft():
    demos = expert_demonstrations("webshop", 5, seed=0)
    assert len(demos) == 5 and all(d.won for d in demos)
    assert len({d.task.goal_index for d in demos}) == 5
    for d in demos:
        obs0, act0 = d.turns[0]
        assert d.instruction in obs0 and act0.startswith("search[")
        assert d.turns[-1][1] == "click[Buy Now]"
    assert expert_demonstrations("webshop", 5, seed=0) == demos  # seeded
    hh = expert_demonstrations("household", 3, seed=1, split="eval")
    assert len(hh) == 3 and all(isinstance(a, str) for d in hh for _, a in d.turns)


def test_prompt_helpers():
    env = make_env("webshop")
    obs, info = env.reset(seed=0)
    prompt = format_prompt("webshop", obs, info)
    assert prompt.startswith(action_format("webshop"))
    assert obs in prompt and "search[<keywords>]" in prompt
    _, *_, info = env.step("search[coffee mug]")
    assert "click[next >]" in format_prompt("webshop", "", info)
    henv = make_env("household")
    obs, info = henv.reset(seed=0)
    assert "Admissible actions: go to " in format_prompt("household", obs, info)


SMALL_SHOP = {"catalogue": {"n_products": 50, "goals_per_product": 1}}


def test_imperfect_demonstrator_buys_without_options_for_a_partial_reward():
    demos = expert_demonstrations("webshop", 66, seed=0, env_kwargs=SMALL_SHOP,
                                  expert_kwargs={"skip_options": 0.5})
    assert len(demos) == 66  # 33 training goals, each visited twice
    assert sorted({d.task.goal_index for d in demos}) == list(range(33))
    imperfect = [d for d in demos if not d.won]
    # Every goal is shown once each way; on a product without options the two look alike.
    assert 30 <= len(imperfect) <= 33
    assert len({d.task.goal_index for d in imperfect}) == len(imperfect)
    for d in imperfect:  # bought straight from the item page: the right product, no options
        assert d.turns[-1][1] == "click[Buy Now]" and d.turns[-2][1].startswith("click[B0")
        assert 0.0 < d.reward < 1.0
    full = expert_demonstrations("webshop", 66, seed=0, env_kwargs=SMALL_SHOP)
    assert all(d.won for d in full) and full[33:] == full[:33]  # revisits repeat the expert
    with pytest.raises(ValueError, match="skip_options"):
        make_expert(make_env("webshop", **SMALL_SHOP), "webshop", skip_options=1.5)

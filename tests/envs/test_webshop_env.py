"""The WebShop-style env: catalogue, goals, search, pages, actions, observation modes."""

import itertools
import re
import time

import pytest
from rapidfuzz import fuzz

from tidejax.envs import Task, make_env, make_tasks, parse_action
from tidejax.envs.webshop_catalogue import Catalogue, CatalogueConfig, get_catalogue
from tidejax.envs.webshop_data import PRODUCT_TYPES
from tidejax.envs.webshop_reward import EXACT_OPTIONS, FUZZY_THRESHOLD, webshop_reward


@pytest.fixture(scope="module")
def cat() -> Catalogue:
    return get_catalogue()


def task(split="test", goal_index=0, max_turns=20) -> Task:
    return Task("t0", "g0", split, "webshop", goal_index, max_turns)


def test_catalogue_shape_and_build_time(cat):
    assert len(cat.products) >= 1000
    assert len({p.category[0] for p in cat.products}) >= 5
    assert len({p.category for p in cat.products}) >= 20
    assert len({p.asin for p in cat.products}) == len(cat.products)
    for p in cat.products:
        assert p.title and p.attributes and p.options and p.price > 0
        assert p.description and p.features and p.title_nouns
    # CPU time of this thread, so a busy machine does not fail the check.
    t0 = time.thread_time()
    other = Catalogue(CatalogueConfig(seed=11))  # uncached: a fresh build and BM25 index
    assert time.thread_time() - t0 < 2.0
    assert other.products[0].asin != cat.products[0].asin


def test_catalogue_is_deterministic():
    a, b = (
        Catalogue(CatalogueConfig(seed=5, n_products=200)),
        Catalogue(CatalogueConfig(seed=5, n_products=200)),
    )
    assert a.products == b.products and a.goals == b.goals and a.splits == b.splits


def test_goal_splits_like_webshop(cat):
    sizes = {k: len(v) for k, v in cat.splits.items()}
    assert sizes == {"test": 500, "eval": 1000, "train": 3000}
    all_ids = [i for ids in cat.splits.values() for i in ids]
    assert sorted(all_ids) == list(range(len(cat.goals)))


def test_goals_are_achievable_and_phrased_like_webshop(cat):
    form = re.compile(
        r"^(i need|i am looking for|i want to buy|find me) .+, and price lower than "
        r"\d+\.\d\d dollars$"
    )
    for g in cat.goals:
        assert form.match(g.instruction), g.instruction
        target = cat.product(g.asin)
        assert set(g.attributes) <= set(target.attributes)
        for name, value in g.options:
            assert value in target.option_values(name)
        assert webshop_reward(target, dict(g.options), g).reward == 1.0


def test_fuzzy_pools_do_not_collide():
    # Otherwise distinct attributes (or colours, flavours) would count as matches.
    pools = set()
    for t in PRODUCT_TYPES:
        pools.add(t.attributes)
        pools.update(vals for name, vals in t.options if name not in EXACT_OPTIONS)
    for pool in pools:
        for a, b in itertools.combinations(pool, 2):
            assert fuzz.token_set_ratio(a, b) <= FUZZY_THRESHOLD, (a, b)


def test_bm25_finds_each_product_by_its_title(cat):
    misses = [p.asin for i, p in enumerate(cat.products) if i not in cat.search(p.title, k=10)]
    assert misses == []
    assert cat.search("zzzz qqqq") == []
    assert len(cat.search("protein bars gluten free")) == 50


def test_parse_action_is_tolerant_but_strict():
    assert parse_action("  CLICK[ Buy   Now ] ") == ("click", "Buy Now")
    assert parse_action("search[red shoes]") == ("search", "red shoes")
    for bad in ("buy now", "click buy now", "search[x", "press[x]", "", None, 3):
        assert parse_action(bad) is None


def test_full_navigation(cat):
    env = make_env("webshop")
    obs, info = env.reset(options={"task": task()})
    assert obs.startswith("WebShop [SEP] Instruction: [SEP] ")
    assert info["available_actions"] == {"has_search_bar": True, "clickables": []}

    obs, r, term, trunc, info = env.step("search[protein bars gluten free]")
    assert (r, term, trunc, info["valid"], info["page"]) == (0.0, False, False, True, "results")
    assert "Page 1 (Total results: 50)" in obs and "Next >" in obs and "< Prev" not in obs
    clickables = info["available_actions"]["clickables"]
    ids = [c for c in clickables if c.startswith("b0")]
    assert len(ids) == 10 and clickables[:2] == ["back to search", "next >"]

    obs, *_, info = env.step("click[Next >]")
    assert "Page 2" in obs and "< prev" in info["available_actions"]["clickables"]
    obs, *_ = env.step("click[< prev]")
    assert "Page 1" in obs

    obs, *_, info = env.step(f"click[{ids[0].upper()}]")
    product = cat.product(ids[0].upper())
    assert info["page"] == "item" and product.title in obs and "Buy Now" in obs
    obs, *_ = env.step("click[Features]")
    assert product.features[0] in obs
    obs, *_, info = env.step("click[< Prev]")
    assert info["page"] == "item"
    value = product.options[0][1][0]
    obs, *_, info = env.step(f"click[{value}]")
    assert env.state.selected == {product.options[0][0]: value}
    assert f"You have clicked {value}." in obs
    obs, *_, info = env.step("click[back to search]")
    assert info["page"] == "search" and info["available_actions"]["has_search_bar"]


def test_invalid_actions_change_nothing():
    env = make_env("webshop")
    env.reset(options={"task": task()})
    env.step("search[coffee mug]")
    before = (env.state.page, env.state.page_no, list(env.state.results))
    for bad in ("search[tea]", "click[not a button]", "hello", "click[Buy Now]"):
        obs, r, term, _trunc, info = env.step(bad)
        assert obs.startswith("Invalid action: ") and "Page 1" in obs
        assert info["valid"] is False and r == 0.0 and not term
        assert (env.state.page, env.state.page_no, list(env.state.results)) == before


def test_text_rich_marks_buttons_and_clicked_options(cat):
    env = make_env("webshop", observation_mode="text_rich")
    obs, _ = env.reset(options={"task": task()})
    assert obs.endswith("[button] Search [button_]")
    _, *_, info = env.step("search[water bottle]")
    asin = next(c for c in info["available_actions"]["clickables"] if c.startswith("b0"))
    env.step(f"click[{asin}]")
    value = cat.product(asin.upper()).options[0][1][0]
    obs, *_ = env.step(f"click[{value}]")
    assert f"[clicked button] {value} [clicked button_]" in obs
    assert "[button] Buy Now [button_]" in obs


def test_buying_scores_and_ends(cat):
    env = make_env("webshop")
    env.reset(options={"task": task(goal_index=3)})
    g = env.goal
    env.step(f"search[{cat.product(g.asin).title}]")
    env.step(f"click[{g.asin}]")
    for _, value in g.options:
        env.step(f"click[{value}]")
    obs, r, term, trunc, info = env.step("click[buy now]")
    assert term and not trunc and r == 1.0 and info["won"]
    assert info["purchased"] == g.asin and info["reward_breakdown"]["reward"] == 1.0
    assert "Thank you for shopping with us!" in obs
    with pytest.raises(RuntimeError):
        env.step("click[buy now]")


def test_turn_cap_truncates():
    env = make_env("webshop")
    env.reset(options={"task": task(max_turns=3)})
    results = [env.step("nonsense") for _ in range(3)]
    assert [r[3] for r in results] == [False, False, True]
    assert all(r[1] == 0.0 and not r[2] for r in results)


def test_same_task_same_actions_same_observations():
    t = make_tasks("webshop", "eval", 1, 1, seed=9)[0]
    actions = ["search[face serum]", "click[next >]", "click[back to search]", "search[tea]"]
    runs = []
    for _ in range(2):
        env = make_env("webshop")
        runs.append([env.reset(options={"task": t})[0]] + [env.step(a)[0] for a in actions])
    assert runs[0] == runs[1]


def test_reset_without_task_uses_seed():
    env = make_env("webshop")
    a, _ = env.reset(seed=1)
    b, _ = env.reset(seed=1)
    assert a == b
    with pytest.raises(ValueError):
        env.reset(options={"split": "test", "goal_index": 10_000})

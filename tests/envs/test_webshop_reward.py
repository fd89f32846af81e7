"""WebShop's reward on hand-built products and goals, with the arithmetic spelled out.

r = r_type * (attrs matched + options matched + [price <= limit]) / (n_attrs + n_opts + 1)
"""

import pytest

from tidejax.envs.webshop_catalogue import Goal, Product
from tidejax.envs.webshop_reward import type_reward, webshop_reward

SNACK_CAT = ("grocery & gourmet food", "snacks", "bars")


def product(**kw) -> Product:
    base = {
        "asin": "B0TEST0001",
        "title": "Acme Protein Bars - Gluten Free, Non Gmo",
        "category": SNACK_CAT,
        "query": "protein bars",
        "title_nouns": ("acme", "protein", "bars"),
        "attributes": ("gluten free", "non gmo"),
        "options": (("flavor", ("chocolate", "vanilla")), ("size", ("12 count", "24 count"))),
        "price": 25.99,
        "description": "Acme protein bars for snacking.",
        "features": ("Gluten Free: tasty", "Non Gmo: tasty"),
        "reviews": (),
        "rating": 4.0,
    }
    base.update(kw)
    return Product(**base)


def goal(**kw) -> Goal:
    base = {
        "goal_id": 0,
        "asin": "B0TEST0001",
        "instruction": "i need protein bars ...",
        "query": "protein bars",
        "category": SNACK_CAT,
        "title_nouns": ("acme", "protein", "bars"),
        "attributes": ("gluten free", "low sugar"),
        "options": (("flavor", "chocolate"), ("size", "12 count")),
        "price_upper": 30.0,
        "phrase": "protein bars",
    }
    base.update(kw)
    return Goal(**base)


def test_partial_match_with_exact_size():
    # attrs: "gluten free" in product attrs (1); "low sugar" neither in attrs nor text (0).
    # options: flavor chocolate == chocolate (1); size "24 count" != "12 count" even though
    #   their fuzzy ratio is 95 > 85, because sizes match exactly (0).
    # price 25.99 <= 30 (1). Same query, so r_type = 1.
    # r = 1 * (1 + 1 + 1) / (2 + 2 + 1) = 3/5 = 0.6
    r = webshop_reward(product(), {"flavor": "chocolate", "size": "24 count"}, goal())
    assert r.reward == pytest.approx(0.6)
    assert (r.attributes_matched, r.options_matched, r.price_ok) == (1, 1, True)


def test_full_match_and_case_folding():
    # attrs 2/2 ("low sugar" is found in the description text), options 2/2 (size
    # "12 Count " folds to "12 count"), price ok: r = 1 * (2 + 2 + 1) / 5 = 1.0
    p = product(description="Acme protein bars, low sugar, for snacking.")
    r = webshop_reward(p, {"flavor": "Chocolate", "size": "12 Count "}, goal())
    assert r.reward == pytest.approx(1.0)


def test_price_over_limit_and_missing_options():
    # attrs 1/2, no options clicked 0/2, price 35.99 > 30 (0): r = (1 + 0 + 0) / 5 = 0.2
    r = webshop_reward(product(price=35.99), {}, goal())
    assert r.reward == pytest.approx(0.2)
    assert not r.price_ok


def test_fuzzy_option_is_lenient_for_colours():
    # goal colour "blue" vs clicked "navy blue": token_set_ratio = 100 > 85, a match.
    # goal has 1 attr (matched), 1 option (matched): r = (1 + 1 + 1) / (1 + 1 + 1) = 1.0
    g = goal(attributes=("gluten free",), options=(("color", "blue"),))
    r = webshop_reward(product(), {"color": "navy blue"}, g)
    assert r.reward == pytest.approx(1.0)


def test_fuzzy_attribute_match():
    # goal attr "gluten free" vs product attr "gluten free snack": ratio 100 > 85 (1/1).
    # No options. Price ok. r = (1 + 0 + 1) / (1 + 0 + 1) = 1.0
    p = product(attributes=("gluten free snack",), description="bars", features=())
    g = goal(attributes=("gluten free",), options=())
    assert webshop_reward(p, {}, g).reward == pytest.approx(1.0)


def test_r_type_half_when_only_weak_title_overlap():
    # Different query, categories share only "grocery & gourmet food" (1 level < 2), title
    # nouns: goal has 5, product shares 1 -> title_score 0.2, not > 0.2 -> r_type 0.5.
    # Everything else matches: r = 0.5 * (2 + 2 + 1) / 5 = 0.5
    g = goal(title_nouns=("acme", "protein", "bars", "oats", "honey"))
    p = product(
        query="trail mix",
        category=("grocery & gourmet food", "nuts", "mixes"),
        title_nouns=("honey", "trail", "mix"),
        description="low sugar",
    )
    r = webshop_reward(p, {"flavor": "chocolate", "size": "12 count"}, g)
    assert r.r_type == 0.5 and r.title_score == pytest.approx(0.2)
    assert r.reward == pytest.approx(0.5)


def test_r_type_low_and_zero_overlap_override_category_match():
    # Same category path (match), but title_score 1/11 ~ 0.09 < 0.1 -> r_type 0.1.
    nouns = tuple(f"n{i}" for i in range(10)) + ("bars",)
    g = goal(title_nouns=nouns)
    p = product(query="other", title_nouns=("bars", "x"))
    r_type, query_match, category_match, score = type_reward(p, g)
    assert (query_match, category_match) == (False, True)
    assert score == pytest.approx(1 / 11) and r_type == 0.1
    # No shared noun at all: r_type 0 even with the same query; the whole reward is 0.
    p0 = product(title_nouns=("socks",))
    assert type_reward(p0, goal())[0] == 0.0
    assert webshop_reward(p0, {"flavor": "chocolate", "size": "12 count"}, goal()).reward == 0.0


def test_r_type_one_from_category_alone():
    # Different query and title_score 1/5 = 0.2 (not > 0.2), but 2 shared category
    # levels: the category match alone keeps r_type at 1.
    g = goal(title_nouns=("acme", "protein", "bars", "oats", "honey"))
    p = product(query="granola", category=("grocery & gourmet food", "snacks", "granola"),
                title_nouns=("honey", "granola"))  # fmt: skip
    r_type, _, category_match, score = type_reward(p, g)
    assert category_match and score == pytest.approx(0.2) and r_type == 1.0

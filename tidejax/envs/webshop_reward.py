"""WebShop's purchase reward, as the paper defines it (Yao et al., 2022, section 3.2).

    r = r_type * (|U_att & Y_att| + |U_opt & Y_opt| + 1[y_price <= u_price])
               / (|U_att| + |U_opt| + 1)

U is the goal, Y the purchase (product plus the options clicked before "Buy Now").

- An attribute matches if some product attribute fuzzy-matches it (rapidfuzz
  token_set_ratio > 85) or it appears verbatim in the title, description or features.
- An option matches if some clicked value fuzzy-matches it, except sizes and lengths,
  which must be equal (after case and whitespace folding): "x-large" is not "xx-large".
- r_type guards against buying a different kind of product that shares attributes.
  Following the paper's text-matching heuristic: it is 1 when the product was listed
  under the goal's query, or shares at least two category levels with it, or more than
  20% of the goal title's nouns appear in the purchased title; otherwise 0.5. Whatever
  else matched, a noun overlap under 10% gives 0.1 and no overlap at all gives 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from rapidfuzz import fuzz

from tidejax.envs.webshop_catalogue import Goal, Product

FUZZY_THRESHOLD = 85.0
EXACT_OPTIONS = frozenset({"size", "length"})


@dataclasses.dataclass(frozen=True)
class RewardBreakdown:
    reward: float
    r_type: float
    attributes_matched: int
    n_attributes: int
    options_matched: int
    n_options: int
    price_ok: bool
    query_match: bool
    category_match: bool
    title_score: float

    def as_dict(self) -> dict[str, float | int | bool]:
        return dataclasses.asdict(self)


def _fold(text: str) -> str:
    return " ".join(text.lower().split())


def type_reward(product: Product, goal: Goal) -> tuple[float, bool, bool, float]:
    """(r_type, query_match, category_match, title_score) for buying `product`."""
    query_match = product.query == goal.query
    category_match = len(set(product.category) & set(goal.category)) >= 2
    wanted = set(goal.title_nouns)
    got = set(product.title_nouns)
    # A goal title with no nouns gets the paper's neutral score rather than a division by 0.
    title_score = len(wanted & got) / len(wanted) if wanted else 0.2
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type, query_match, category_match, title_score


def attribute_matches(product: Product, attributes: tuple[str, ...]) -> int:
    n = 0
    for want in attributes:
        w = _fold(want)
        if (
            any(fuzz.token_set_ratio(w, _fold(a)) > FUZZY_THRESHOLD for a in product.attributes)
            or w in product.text
        ):
            n += 1
    return n


def option_matches(selected: Mapping[str, str], options: tuple[tuple[str, str], ...]) -> int:
    clicked = {name: _fold(value) for name, value in selected.items()}
    n = 0
    for name, value in options:
        v = _fold(value)
        if name in EXACT_OPTIONS:
            n += clicked.get(name) == v
        elif any(fuzz.token_set_ratio(v, c) > FUZZY_THRESHOLD for c in clicked.values()):
            n += 1
    return n


def webshop_reward(product: Product, selected: Mapping[str, str], goal: Goal) -> RewardBreakdown:
    """The reward for buying `product` with option values `selected` (name -> value)."""
    r_type, query_match, category_match, title_score = type_reward(product, goal)
    n_attr = attribute_matches(product, goal.attributes)
    n_opt = option_matches(selected, goal.options)
    price_ok = product.price <= goal.price_upper
    total = len(goal.attributes) + len(goal.options) + 1
    reward = r_type * (n_attr + n_opt + int(price_ok)) / total
    return RewardBreakdown(
        reward=reward,
        r_type=r_type,
        attributes_matched=n_attr,
        n_attributes=len(goal.attributes),
        options_matched=n_opt,
        n_options=len(goal.options),
        price_ok=price_ok,
        query_match=query_match,
        category_match=category_match,
        title_score=title_score,
    )

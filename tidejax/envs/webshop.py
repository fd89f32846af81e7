"""A WebShop-style text environment, written from the WebShop paper's description.

Pages (Yao et al., 2022, section 3): a search page; a results page showing 10 products
per page (id, title, price) with "< Prev" / "Next >" and "Back to Search"; an item page
with option values to click, "Description" / "Features" / "Reviews" sub-pages and "Buy
Now". Actions are `search[query]` (only where there is a search bar) and
`click[button]`. An invalid action changes nothing; the observation says why. Buying
ends the episode with WebShop's reward (`webshop_reward.py`); running out of turns
truncates it with reward 0.

Observation modes: "text" joins the visible strings with " [SEP] "; "text_rich" marks
buttons as "[button] X [button_]" and clicked options as "[clicked button] X [clicked
button_]".
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Literal

import numpy as np

from tidejax.envs.latency_spec import WEBSHOP_LATENCY
from tidejax.envs.protocol import Task, task_from_options
from tidejax.envs.registry import EnvSpec, register
from tidejax.envs.webshop_catalogue import (
    Catalogue,
    CatalogueConfig,
    Goal,
    Product,
    get_catalogue,
)
from tidejax.envs.webshop_reward import RewardBreakdown, webshop_reward

SEP = " [SEP] "
PAGE_SIZE = 10
MAX_QUERY_CHARS = 200
DEFAULT_MAX_TURNS = 20  # TideRL's WebShop cap (calibration.md env.webshop.max_turns)
_ACTION = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*$", re.IGNORECASE | re.DOTALL)

BACK = "Back to Search"
PREV = "< Prev"
NEXT = "Next >"
BUY = "Buy Now"
DETAIL_PAGES = ("Description", "Features", "Reviews")

ACTION_FORMAT = """\
You are shopping on a web store for the item described by the instruction.
Each turn, reply with exactly one action:
  search[<keywords>]   type keywords into the search bar (only on the search page)
  click[<button>]      click one of the buttons listed as available
Results show 10 products per page; click a product id to open it, click option values
(size, color, ...) to choose them, and click[Buy Now] to purchase and end the episode.
The purchase is scored on matching the instruction's product type, attributes, options
and price limit."""


@dataclasses.dataclass(frozen=True)
class WebShopConfig:
    catalogue: CatalogueConfig = dataclasses.field(default_factory=CatalogueConfig)
    observation_mode: Literal["text", "text_rich"] = "text"

    def __post_init__(self) -> None:
        if isinstance(self.catalogue, dict):  # env kwargs that came as JSON or TOML
            object.__setattr__(self, "catalogue", CatalogueConfig(**self.catalogue))
        if not isinstance(self.catalogue, CatalogueConfig):
            raise ValueError(f"catalogue must be a CatalogueConfig or a dict of its fields, "
                             f"got {type(self.catalogue).__name__}")
        if self.observation_mode not in ("text", "text_rich"):
            raise ValueError(
                f"observation_mode must be 'text' or 'text_rich', got {self.observation_mode!r}"
            )


def parse_action(action: Any) -> tuple[str, str] | None:
    """("search" | "click", argument) from `verb[arg]`, tolerant of case and spaces."""
    if not isinstance(action, str):
        return None
    m = _ACTION.match(action)
    if m is None:
        return None
    return m.group(1).lower(), " ".join(m.group(2).split())


@dataclasses.dataclass
class WebShopState:
    page: str = "search"  # search | results | item | detail | done
    query: str = ""
    results: list[int] = dataclasses.field(default_factory=list)
    page_no: int = 1
    item: int = -1  # product index on the item / detail page
    detail: str = ""
    selected: dict[str, str] = dataclasses.field(default_factory=dict)
    turn: int = 0
    done: bool = False


class WebShopEnv:
    """One shopping episode at a time over a shared, read-only catalogue."""

    def __init__(self, config: WebShopConfig | None = None, **overrides: Any):
        if config is None:
            config = WebShopConfig(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        self.catalogue: Catalogue = get_catalogue(config.catalogue)
        self.goal: Goal | None = None
        self.task: Task | None = None
        self.max_turns = DEFAULT_MAX_TURNS
        self.state = WebShopState()

    # -- protocol ---------------------------------------------------------------------

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Starts the goal named by options["task"] (or split + goal_index), else a
        train goal drawn from `seed`."""
        options = options or {}
        task = task_from_options(options)
        if task is not None:
            split, index, self.max_turns = task.split, task.goal_index, task.max_turns
        elif "goal_index" in options:
            split = options.get("split", "train")
            index = int(options["goal_index"])
            self.max_turns = int(options.get("max_turns", DEFAULT_MAX_TURNS))
        else:
            split = "train"
            n = len(self.catalogue.splits[split])
            index = int(np.random.default_rng(seed).integers(n))
            self.max_turns = int(options.get("max_turns", DEFAULT_MAX_TURNS))
        self.task = task
        self.goal = self.catalogue.goal(split, index)
        self.state = WebShopState()
        return self._render(), self._info(valid=True)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.goal is None:
            raise RuntimeError("call reset() before step()")
        if self.state.done:
            raise RuntimeError("the episode is over; call reset()")
        st = self.state
        st.turn += 1
        error = self._apply(action)
        reward, terminated, extra = 0.0, False, {}
        if st.page == "done":
            breakdown = self._score()
            reward, terminated = breakdown.reward, True
            extra = {
                "purchased": self.catalogue.products[st.item].asin,
                "selected_options": dict(st.selected),
                "reward_breakdown": breakdown.as_dict(),
                "won": breakdown.reward >= 1.0,
            }
        truncated = not terminated and st.turn >= self.max_turns
        st.done = terminated or truncated
        obs = self._render() if error is None else f"Invalid action: {error}{SEP}{self._render()}"
        info = self._info(valid=error is None)
        info.update(extra)
        if error is not None:
            info["error"] = error
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        self.goal = None

    # -- transitions --------------------------------------------------------------------

    def clickables(self) -> list[str]:
        """Buttons on the current page, lower-cased as WebShop lists them."""
        st = self.state
        if st.page == "results":
            out = [BACK]
            if st.page_no > 1:
                out.append(PREV)
            if st.page_no * PAGE_SIZE < len(st.results):
                out.append(NEXT)
            out += [self.catalogue.products[i].asin for i in self.page_items()]
        elif st.page == "item":
            product = self.catalogue.products[st.item]
            values = [v for _, vals in product.options for v in vals]
            out = [BACK, PREV, *values, *DETAIL_PAGES, BUY]
        elif st.page == "detail":
            out = [BACK, PREV]
        else:
            out = []
        return [b.lower() for b in out]

    def page_items(self) -> list[int]:
        start = (self.state.page_no - 1) * PAGE_SIZE
        return self.state.results[start : start + PAGE_SIZE]

    def _apply(self, action: str) -> str | None:
        """Applies a parsed action; returns why it is invalid, or None."""
        parsed = parse_action(action)
        if parsed is None:
            return "expected search[<keywords>] or click[<button>]"
        verb, arg = parsed
        st = self.state
        if verb == "search":
            if st.page != "search":
                return "there is no search bar on this page"
            query = arg[:MAX_QUERY_CHARS].lower()
            if not query:
                return "the search query is empty"
            st.query, st.results, st.page_no, st.page = (
                query,
                self.catalogue.search(query),
                1,
                "results",
            )
            return None
        button = arg.lower()
        if button not in self.clickables():
            return f"'{arg}' is not a button on this page"
        if button == BACK.lower():
            self.state = WebShopState(turn=st.turn)
        elif st.page == "results":
            if button == NEXT.lower():
                st.page_no += 1
            elif button == PREV.lower():
                st.page_no -= 1
            else:
                st.item, st.selected, st.page = self.catalogue.by_asin[button.upper()], {}, "item"
        elif st.page == "item":
            product = self.catalogue.products[st.item]
            if button == PREV.lower():
                st.page = "results"
            elif button == BUY.lower():
                st.page = "done"
            elif button in (d.lower() for d in DETAIL_PAGES):
                st.page, st.detail = "detail", button
            else:
                value = next(v for _, vals in product.options for v in vals if v.lower() == button)
                st.selected[product.option_name_of(value)] = value
        elif st.page == "detail":
            st.page = "item"  # the only other button here is < Prev
        return None

    def _score(self) -> RewardBreakdown:
        assert self.goal is not None
        return webshop_reward(
            self.catalogue.products[self.state.item], self.state.selected, self.goal
        )

    # -- rendering ----------------------------------------------------------------------

    def _button(self, label: str, clicked: bool = False) -> str:
        if self.config.observation_mode == "text":
            return label
        if clicked:
            return f"[clicked button] {label} [clicked button_]"
        return f"[button] {label} [button_]"

    def _render(self) -> str:
        assert self.goal is not None
        st, b = self.state, self._button
        head = ["Instruction:", self.goal.instruction]
        if st.page == "search":
            return SEP.join(["WebShop", *head, b("Search")])
        if st.page == "results":
            parts = [*head, b(BACK), f"Page {st.page_no} (Total results: {len(st.results)})"]
            if st.page_no > 1:
                parts.append(b(PREV))
            if st.page_no * PAGE_SIZE < len(st.results):
                parts.append(b(NEXT))
            for i in self.page_items():
                p = self.catalogue.products[i]
                parts += [b(p.asin), p.title, f"${p.price:.2f}"]
            return SEP.join(parts)
        product = self.catalogue.products[st.item]
        if st.page == "item":
            parts = [*head, b(BACK), b(PREV)]
            for name, values in product.options:
                parts.append(name)
                parts += [b(v, clicked=st.selected.get(name) == v) for v in values]
            rating = "N.A." if product.rating is None else f"{product.rating:.1f}"
            parts += [product.title, f"Price: ${product.price:.2f}", f"Rating: {rating}"]
            parts += [b(d) for d in DETAIL_PAGES] + [b(BUY)]
            if self.config.observation_mode == "text" and st.selected:
                parts += [f"You have clicked {v}." for v in st.selected.values()]
            return SEP.join(parts)
        if st.page == "detail":
            body = {
                "description": [product.description],
                "features": list(product.features),
                "reviews": list(product.reviews),
            }[st.detail]
            return SEP.join([*head, b(BACK), b(PREV), *body])
        score = self._score().reward
        return SEP.join(
            [
                "Thank you for shopping with us!",
                "Purchased",
                product.asin,
                product.title,
                "Your score (min 0.0, max 1.0)",
                f"{score:.2f}",
            ]
        )

    def _info(self, valid: bool) -> dict[str, Any]:
        assert self.goal is not None
        return {
            "available_actions": {
                "has_search_bar": self.state.page == "search",
                "clickables": self.clickables(),
            },
            "page": self.state.page,
            "turn": self.state.turn,
            "max_turns": self.max_turns,
            "valid": valid,
            "instruction": self.goal.instruction,
        }


def _split_sizes(**env_kwargs: Any) -> dict[str, int]:
    return WebShopConfig(**env_kwargs).catalogue.split_sizes()


class WebShopExpert:
    """A scripted expert that plays from the env's state and earns reward 1.0 on almost
    every goal (SFT warm-start data, and proof that the env is solvable).

    It searches with the goal's product phrase and attributes, opens the first listed
    product that would earn the full reward (scored with the env's reward function on
    the product record), clicks the wanted options and buys. If two result pages hold no
    such product it searches again with the target product's title. With `skip_options`
    it is an imperfect demonstrator: in that share of episodes it buys without choosing
    options, for a partial reward (the WebShop paper's imitation agents fail the same
    way), which leaves RL something to learn that imitation did not.
    """

    def __init__(self, env: WebShopEnv, max_pages: int = 2, skip_options: float = 0.0):
        if not 0.0 <= skip_options <= 1.0:
            raise ValueError(f"skip_options must be in [0, 1], got {skip_options}")
        self.env = env
        self.max_pages = max_pages
        self.skip_options = skip_options
        self._episodes = 0
        self._fallback = False
        self._pages_seen = 1
        # True when this episode's mistake is deliberate: such a demonstration is kept.
        self.imperfect_episode = False

    def _wanted(self, product: Product) -> dict[str, str]:
        goal = self.env.goal
        assert goal is not None
        return {n: v for n, v in goal.options if v in product.option_values(n)}

    def _score(self, product: Product) -> float:
        assert self.env.goal is not None
        return webshop_reward(product, self._wanted(product), self.env.goal).reward

    def act(self, obs: str, info: dict[str, Any]) -> str:
        env, st, goal = self.env, self.env.state, self.env.goal
        assert goal is not None
        if st.turn == 0:  # a new episode
            self._fallback, self._pages_seen = False, 1
            # Evenly spread (k-th episode skips when floor(k * share) steps up), so any run
            # of episodes holds the share; at 0.5 the two visits of a goal differ.
            k, self._episodes = self._episodes, self._episodes + 1
            self.imperfect_episode = (math.floor((k + 1) * self.skip_options)
                                      > math.floor(k * self.skip_options))
        cat = env.catalogue
        if st.page == "search":
            if self._fallback:
                return f"search[{cat.product(goal.asin).title}]"
            return f"search[{goal.phrase} {' '.join(goal.attributes)}]"
        if st.page == "results":
            items = env.page_items()
            scored = [(self._score(cat.products[i]), -rank, i) for rank, i in enumerate(items)]
            best = max(scored, default=None)
            if best is not None and best[0] >= 1.0:
                return f"click[{cat.products[best[2]].asin}]"
            if "next >" in env.clickables() and self._pages_seen < self.max_pages:
                self._pages_seen += 1
                return "click[Next >]"
            if not self._fallback:
                self._fallback = True
                return "click[Back to Search]"
            if best is not None:
                return f"click[{cat.products[best[2]].asin}]"
            return "click[Back to Search]"
        if st.page == "item":
            product = cat.products[st.item]
            for name, value in self._wanted(product).items():
                if st.selected.get(name) != value and not self.imperfect_episode:
                    return f"click[{value}]"
            return "click[Buy Now]"
        return "click[< Prev]"  # a description / features / reviews page


register(
    EnvSpec(
        name="webshop",
        factory=WebShopEnv,
        default_max_turns=DEFAULT_MAX_TURNS,
        split_sizes=CatalogueConfig().split_sizes(),
        split_sizes_for=_split_sizes,
        latency=WEBSHOP_LATENCY,
        action_format=ACTION_FORMAT,
        expert=WebShopExpert,
        config_class=WebShopConfig,
    )
)

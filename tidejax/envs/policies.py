"""Scripted policies (an expert per env type, a random one), episodes and SFT demos.

The experts play from the env's own state, as the scripted experts that produce
ALFWorld's and similar demonstration sets do; they exist to make SFT warm-start data
and to prove the envs solvable, not to be fair opponents.

- WebShopExpert searches with the goal's product phrase and attributes, opens the
  first listed product that would earn the full reward (scored with the env's reward
  function on the product record), clicks the wanted options and buys. If two result
  pages hold no such product it searches again with the target product's title. With
  `skip_options` it is an imperfect demonstrator: in that share of episodes it buys
  without choosing options, for a partial reward (the WebShop paper's imitation agents
  fail the same way), which leaves RL something to learn that imitation did not.
- HouseholdExpert knows where each kind of object is likely to be (the scene
  generator's placement priors) but not where it is: it visits and opens receptacles in
  that order until it sees one, then takes it, cleans / heats / cools it, and puts it
  at the target.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from tidejax.envs.household import APPLIANCE, ROOMS, HouseholdEnv, _kind
from tidejax.envs.protocol import Policy, Task, TextEnv
from tidejax.envs.registry import get_spec, make_env
from tidejax.envs.webshop import WebShopEnv
from tidejax.envs.webshop_catalogue import Product
from tidejax.envs.webshop_reward import webshop_reward


class WebShopExpert:
    """Reaches reward 1.0 on almost every WebShop goal; see the module docstring."""

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


class HouseholdExpert:
    """Solves household goals by searching likely places first; see the module docstring."""

    def __init__(self, env: HouseholdEnv):
        self.env = env
        self.memory: dict[str, list[str]] = {}

    def act(self, obs: str, info: dict[str, Any]) -> str:
        env, st, goal = self.env, self.env.state, self.env.goal
        scene = env.scene
        assert scene is not None
        if st.turn == 0:
            self.memory = {}
        here = st.location
        if here is not None and env.visible(here):
            self.memory[here] = list(st.contents[here])
        if st.held is not None:
            verb = goal.task_type
            if verb in APPLIANCE:
                adj = {"clean": "clean", "heat": "hot", "cool": "cool"}[verb]
                if st.held not in st.status[adj]:
                    app = next(r for r in scene.receptacles if _kind(r) == APPLIANCE[verb])
                    return f"go to {app}" if here != app else f"{verb} {st.held} with {app}"
            target = next(r for r in scene.receptacles if _kind(r) == goal.target)
            if here != target:
                return f"go to {target}"
            if not env.visible(target):
                return f"open {target}"
            return f"put {st.held} in/on {target}"
        for r, items in self.memory.items():
            if _kind(r) == goal.target:
                continue  # already delivered there
            for o in items:
                if _kind(o) == goal.obj:
                    if here != r:
                        return f"go to {r}"
                    if not env.visible(r):
                        return f"open {r}"
                    return f"take {o} from {r}"
        likely = ROOMS[scene.room].objects[goal.obj]
        order = [r for k in likely for r in scene.receptacles if _kind(r) == k]
        order += [r for r in scene.receptacles if r not in order]
        for r in order:
            if r in self.memory or _kind(r) == goal.target:
                continue
            return f"go to {r}" if here != r else f"open {r}"
        return "look"


class RandomPolicy:
    """Uniform over the actions an env lists: a reference floor, and it needs no state."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def act(self, obs: str, info: dict[str, Any]) -> str:
        if info.get("admissible_actions"):
            acts = info["admissible_actions"]
            return str(acts[int(self.rng.integers(len(acts)))])
        avail = info.get("available_actions") or {}
        if avail.get("has_search_bar"):
            words = str(info.get("instruction", "item")).replace(",", "").split()
            k = int(self.rng.integers(1, min(6, len(words)) + 1))
            picked = self.rng.choice(len(words), size=k, replace=False)
            return f"search[{' '.join(words[int(i)] for i in sorted(picked))}]"
        clickables = avail.get("clickables") or []
        if clickables:
            return f"click[{clickables[int(self.rng.integers(len(clickables)))]}]"
        return "look"


def make_expert(env: TextEnv, env_type: str, **expert_kwargs: Any) -> Policy:
    return get_spec(env_type).expert(env, **expert_kwargs)


@dataclasses.dataclass(frozen=True)
class Episode:
    """One finished episode: each turn is (observation the policy saw, action it took)."""

    task: Task
    instruction: str
    turns: tuple[tuple[str, str], ...]
    reward: float
    terminated: bool
    truncated: bool

    @property
    def won(self) -> bool:
        return self.reward >= 1.0


def run_episode(env: TextEnv, policy: Policy, task: Task) -> Episode:
    obs, info = env.reset(options={"task": task})
    turns: list[tuple[str, str]] = []
    reward, terminated, truncated = 0.0, False, False
    instruction = str(info.get("instruction", ""))
    while not (terminated or truncated):
        action = policy.act(obs, info)
        turns.append((obs, action))
        obs, reward, terminated, truncated, info = env.step(action)
    return Episode(task, instruction, tuple(turns), reward, terminated, truncated)


def expert_demonstrations(
    env_type: str,
    n: int,
    seed: int,
    *,
    split: str = "train",
    only_success: bool = True,
    env_kwargs: dict[str, Any] | None = None,
    expert_kwargs: dict[str, Any] | None = None,
) -> list[Episode]:
    """`n` expert episodes on the goals of `split`, in a seeded order.

    Goals are visited in that order and revisited when `n` exceeds the split (an
    imperfect demonstrator may then play each visit its own way). With `only_success`,
    failed episodes are skipped, except an imperfect demonstrator's deliberate mistakes
    (`expert_kwargs`, e.g. WebShop's `skip_options`), which are the point of it; fewer
    than `n` come back only if a whole pass over the split yields none.
    """
    spec = get_spec(env_type)
    env = make_env(env_type, **(env_kwargs or {}))
    expert = spec.expert(env, **(expert_kwargs or {}))
    order = np.random.default_rng(seed).permutation(spec.sizes(env_kwargs)[split])
    out: list[Episode] = []
    while len(out) < n:
        before = len(out)
        for goal_index in order:
            if len(out) == n:
                break
            task = Task(
                task_id=f"demo-{env_type}-{split}-{int(goal_index)}",
                group_id=f"demo-{env_type}-{split}-{int(goal_index)}",
                split=split,  # type: ignore[arg-type]
                env_type=env_type,
                goal_index=int(goal_index),
                max_turns=spec.default_max_turns,
            )
            episode = run_episode(env, expert, task)
            if episode.won or not only_success or getattr(expert, "imperfect_episode", False):
                out.append(episode)
        if len(out) == before:
            break
    return out


def action_format(env_type: str) -> str:
    """Prompt text telling a language model which actions it may write."""
    return get_spec(env_type).action_format


def available_actions_text(info: dict[str, Any]) -> str:
    """The actions an env lists in `info`, as one prompt line."""
    if info.get("admissible_actions"):
        return "Admissible actions: " + ", ".join(info["admissible_actions"])
    avail = info.get("available_actions") or {}
    acts = ["search[<keywords>]"] if avail.get("has_search_bar") else []
    acts += [f"click[{c}]" for c in avail.get("clickables", [])]
    return "Available actions: " + ", ".join(acts)


def format_prompt(env_type: str, obs: str, info: dict[str, Any]) -> str:
    """WebShop-style turn prompt: action format, observation, available actions."""
    return f"{action_format(env_type)}\n\nObservation:\n{obs}\n\n{available_actions_text(info)}"

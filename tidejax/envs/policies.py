"""Env-independent policies and episodes: a random policy, each env type's registered
expert (`make_expert`), episodes, SFT demonstrations and prompt helpers.

The scripted experts live next to their envs (`webshop.WebShopExpert`,
`household.HouseholdExpert`): they play from the env's own state, and each env registers
its expert with the registry, which is how this module finds them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tidejax.envs.protocol import Policy, Task, TextEnv
from tidejax.envs.registry import get_spec, make_env


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
    expert = get_spec(env_type).expert
    if expert is None:
        raise ValueError(f"env type {env_type!r} declares no expert")
    return expert(env, **expert_kwargs)


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
    obs, info = env.reset(seed=task.reset_seed, options={"task": task})
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
    expert = make_expert(env, env_type, **(expert_kwargs or {}))
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


DEMO_ROLES = ("system", "user", "tool", "assistant")


def read_demonstrations(path: str, env_type: str) -> list[Episode]:
    """Episodes from a JSONL file, one demonstration a line, in the chat-messages shape:

        {"messages": [{"role": "user", "content": "<first observation>"},
                      {"role": "assistant", "content": "<action>"},
                      {"role": "user" | "tool", "content": "<next observation>"}, ...]}

    Each assistant message is an action taken after the observations before it. System
    messages are skipped: the job's prompt is the env's own, as in its rollouts. A
    trailing observation is dropped (nothing was learned from it). A bad line raises
    ValueError naming the file, the line and the problem.
    """
    import json

    episodes = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where}: not JSON: {e}") from None
            messages = row.get("messages") if isinstance(row, dict) else None
            if not isinstance(messages, list):
                raise ValueError(f'{where}: expected an object with a "messages" list')
            turns, pending = [], []
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or m.get("role") not in DEMO_ROLES:
                    raise ValueError(f"{where}: messages[{i}].role must be one of {DEMO_ROLES}")
                if not isinstance(m.get("content"), str):
                    raise ValueError(f"{where}: messages[{i}].content must be a string")
                if m["role"] == "system":
                    continue
                if m["role"] != "assistant":
                    pending.append(m["content"])
                    continue
                if not pending:
                    raise ValueError(f"{where}: messages[{i}] is an assistant message with no "
                                     f"observation before it")
                turns.append(("\n".join(pending), m["content"]))
                pending = []
            if not turns:
                raise ValueError(f"{where}: no assistant message (no action to learn)")
            name = f"demo-file-{number}"
            task = Task(name, name, "train", env_type, number, max(len(turns), 1))
            episodes.append(Episode(task, "", tuple(turns), 0.0, False, False))
    if not episodes:
        raise ValueError(f"{path}: no demonstrations")
    return episodes


def env_texts(
    env_type: str,
    n: int,
    seed: int,
    *,
    split: str = "train",
    env_kwargs: dict[str, Any] | None = None,
    rows: list[dict[str, Any]] | None = None,
) -> list[str]:
    """Text the env itself writes, for a tokenizer when there is no expert to imitate: its
    action format and the first observations of up to `n` goals of `split`, seeded (with
    `rows`, the split's dataset, each goal's prompt messages too)."""
    spec = get_spec(env_type)
    env = make_env(env_type, **(env_kwargs or {}))
    size = len(rows) if rows is not None else spec.sizes(env_kwargs)[split]
    order = np.random.default_rng(seed).permutation(size)[:n]
    texts = [spec.action_format] if spec.action_format else []
    try:
        for goal_index in order:
            name = f"text-{env_type}-{split}-{int(goal_index)}"
            task = Task(task_id=name, group_id=name, split=split,  # type: ignore[arg-type]
                        env_type=env_type, goal_index=int(goal_index),
                        max_turns=spec.default_max_turns,
                        data=None if rows is None else rows[int(goal_index)])
            if task.data:
                texts += [m["content"] for m in task.data.get("messages", [])]
            obs, info = env.reset(seed=task.reset_seed, options={"task": task})
            texts.append(obs)
            texts += [str(a) for a in info.get("admissible_actions") or []]
    finally:
        env.close()
    return texts


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

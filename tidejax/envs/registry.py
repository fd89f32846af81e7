"""A registry of env types by name, and GRPO task groups built from it.

An env module registers its type when it is imported. The built-in types ("webshop",
"household") are imported by the `tidejax.envs` package, which Python runs before any
of its submodules (this one included), so both are registered before code outside the
package can reach the registry. This module imports no env: each env imports it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tidejax.envs.latency_spec import LatencySpec
from tidejax.envs.protocol import SPLITS, Policy, Task, TextEnv


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """Everything the rest of the system needs to know about one env type."""

    name: str
    factory: Callable[..., TextEnv]  # make_env(name, **kwargs) calls factory(**kwargs)
    default_max_turns: int
    split_sizes: Mapping[str, int]  # goals per split for the default env config
    latency: LatencySpec
    action_format: str  # prompt text describing the actions a model may write
    # expert(env, **kwargs) -> a policy that reads that env's state
    expert: Callable[..., Policy]
    # Goals per split for factory(**kwargs); None when kwargs never change the splits.
    split_sizes_for: Callable[..., Mapping[str, int]] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must be non-empty")
        if self.default_max_turns < 1:
            raise ValueError(f"default_max_turns must be >= 1, got {self.default_max_turns}")
        for split in SPLITS:
            if self.split_sizes.get(split, 0) < 1:
                raise ValueError(f"split_sizes[{split!r}] must be >= 1")
        object.__setattr__(self, "split_sizes", dict(self.split_sizes))

    def sizes(self, env_kwargs: Mapping[str, Any] | None = None) -> dict[str, int]:
        """Goals per split of the env that make_env(name, **env_kwargs) builds."""
        if not env_kwargs or self.split_sizes_for is None:
            return dict(self.split_sizes)
        return dict(self.split_sizes_for(**env_kwargs))


_REGISTRY: dict[str, EnvSpec] = {}
_LOCK = threading.Lock()


def register(spec: EnvSpec, *, replace: bool = False) -> None:
    """Adds an env type; registering a taken name raises unless `replace`."""
    with _LOCK:
        if spec.name in _REGISTRY and not replace:
            raise ValueError(f"env type {spec.name!r} is already registered")
        _REGISTRY[spec.name] = spec


def env_types() -> list[str]:
    return sorted(_REGISTRY)


def get_spec(env_type: str) -> EnvSpec:
    try:
        return _REGISTRY[env_type]
    except KeyError:
        raise ValueError(f"unknown env type {env_type!r}; known: {sorted(_REGISTRY)}") from None


def make_env(env_type: str, **kwargs: Any) -> TextEnv:
    """A fresh env of the named type."""
    return get_spec(env_type).factory(**kwargs)


def make_tasks(
    env_type: str,
    split: str,
    n_groups: int,
    group_size: int,
    seed: int,
    *,
    max_turns: int | None = None,
    long_tail_fraction: float = 0.0,
    prefix: str | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
) -> list[Task]:
    """GRPO groups: `n_groups` distinct goals of `split`, each repeated `group_size` times.

    Goals are drawn without replacement while the split has enough of them. A group is
    of kind "long_tail" with probability `long_tail_fraction` (its env calls then draw
    from the heavier latency tail). Ids are stable for a given seed. `env_kwargs` are
    those the envs are built with (they may change how many goals a split has).
    """
    spec = get_spec(env_type)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n_groups < 1:
        raise ValueError(f"n_groups must be >= 1, got {n_groups}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not 0.0 <= long_tail_fraction <= 1.0:
        raise ValueError(f"long_tail_fraction must be in [0, 1], got {long_tail_fraction}")
    turns = spec.default_max_turns if max_turns is None else max_turns
    size = spec.sizes(env_kwargs)[split]
    rng = np.random.default_rng(seed)
    goals = rng.choice(size, size=n_groups, replace=n_groups > size)
    long_tail = rng.random(n_groups) < long_tail_fraction
    prefix = prefix or f"{env_type}-{split}-s{seed}"
    tasks = []
    for g in range(n_groups):
        group_id = f"{prefix}-g{g:05d}"
        kind = "long_tail" if long_tail[g] else "normal"
        for i in range(group_size):
            tasks.append(
                Task(
                    task_id=f"{group_id}-{i:03d}",
                    group_id=group_id,
                    split=split,  # type: ignore[arg-type]
                    env_type=env_type,
                    goal_index=int(goals[g]),
                    max_turns=turns,
                    kind=kind,
                )
            )
    return tasks

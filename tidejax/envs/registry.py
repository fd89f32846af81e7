"""A registry of env types by name, and GRPO task groups built from it.

An env type is named in one of three ways, and every place that takes a name (the job's
config and CLI, the env server, the benches) accepts all three:

- a built-in name ("webshop", "household"): the env module registers its type when it is
  imported, and the `tidejax.envs` package imports the built-ins;
- an installed plugin: a distribution declares an entry point in the group `tidejax.envs`
  (`myenv = "mypkg.envs:MyEnv"`), loaded the first time its name is asked for;
- "package.module:Class": the module is imported and the class read on first use.

A class (plugin or "module:Class") declares what the runtime needs as class attributes,
all optional but `split_sizes`; see `spec_from_class`. This module imports no env.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import importlib.metadata
import re
import threading
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tidejax.envs.actions import ParsedActionEnv, Tool, get_action_parser
from tidejax.envs.latency_spec import LatencySpec
from tidejax.envs.protocol import SPLITS, Policy, Task, TextEnv


RETURN_RULES = ("last", "sum", "max")


def episode_return(rule: str, step_rewards: Sequence[float]) -> float:
    """An episode's return from its per-step rewards (0 for an episode with none)."""
    if not step_rewards:
        return 0.0
    if rule == "sum":
        return float(sum(step_rewards))
    if rule == "max":
        return float(max(step_rewards))
    if rule == "last":
        return float(step_rewards[-1])
    raise ValueError(f"return_rule must be one of {RETURN_RULES}, got {rule!r}")


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """Everything the rest of the system needs to know about one env type."""

    name: str
    factory: Callable[..., TextEnv]  # make_env(name, **kwargs) calls factory(**kwargs)
    default_max_turns: int
    split_sizes: Mapping[str, int]  # goals per split for the default env config
    latency: LatencySpec
    action_format: str  # prompt text describing the actions a model may write
    # expert(env, **kwargs) -> a policy that reads that env's state; None: no expert (the
    # job then skips SFT and trains its tokenizer on the env's own text)
    expert: Callable[..., Policy] | None = None
    # Goals per split for factory(**kwargs); None when kwargs never change the splits.
    split_sizes_for: Callable[..., Mapping[str, int]] | None = None
    # The dataclass that validates the env's settings (the job's `[env]` table, the
    # server's --env-kwargs); None: settings go to the factory unchecked.
    config_class: type | None = None
    # How per-step rewards make the episode's return (`RETURN_RULES`): "last" (the final
    # step's reward; what WebShop, household and TextWorld-Express give), "sum" or "max".
    return_rule: str = "last"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must be non-empty")
        if self.return_rule not in RETURN_RULES:
            raise ValueError(f"env type {self.name!r}: return_rule must be one of "
                             f"{RETURN_RULES}, got {self.return_rule!r}")
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
_LOCK = threading.RLock()  # re-entrant: resolving a name imports a module that may register
ENTRY_POINT_GROUP = "tidejax.envs"


def register(spec: EnvSpec, *, replace: bool = False) -> None:
    """Adds an env type; registering a taken name raises unless `replace`."""
    with _LOCK:
        if spec.name in _REGISTRY and not replace:
            raise ValueError(f"env type {spec.name!r} is already registered")
        _REGISTRY[spec.name] = spec


def env_types() -> list[str]:
    """The names resolved so far (built-ins, and plugins or classes already asked for)."""
    return sorted(_REGISTRY)


def plugin_names() -> list[str]:
    """Env types installed distributions declare in the `tidejax.envs` entry-point group."""
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)})


def get_spec(env_type: str) -> EnvSpec:
    """The spec of a registered name, an installed plugin or a "module:Class" name;
    resolved once, then registered under that name. Unknown names raise ValueError."""
    if not isinstance(env_type, str) or not env_type:
        raise ValueError(f"env type must be a non-empty string, got {env_type!r}")
    with _LOCK:
        spec = _REGISTRY.get(env_type)
        if spec is None:
            spec = _resolve(env_type)
            _REGISTRY.setdefault(env_type, spec)
        return spec


def _resolve(env_type: str) -> EnvSpec:
    plugins = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
               if ep.name == env_type]
    if plugins:
        try:
            target = plugins[0].load()
        except Exception as e:  # noqa: BLE001 (a broken plugin is a config error, named)
            raise ValueError(f"env type {env_type!r}: loading entry point "
                             f"{plugins[0].value!r} failed: {type(e).__name__}: {e}") from None
        return _as_spec(env_type, target)
    if ":" not in env_type:
        raise ValueError(
            f"unknown env type {env_type!r}; known: {sorted(_REGISTRY)}, installed plugins: "
            f"{plugin_names()}, or name a class as 'package.module:Class'")
    module_name, _, attr = env_type.partition(":")
    if not module_name or not attr:
        raise ValueError(f"env type {env_type!r} must look like 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"env type {env_type!r}: cannot import {module_name!r}: {e}") from None
    except Exception as e:  # the user's module failed while importing: say so, keep the cause
        raise ValueError(f"env type {env_type!r}: importing {module_name!r} raised "
                         f"{type(e).__name__}: {e}") from e
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"env type {env_type!r}: {module_name!r} has no {attr!r}")
        target = getattr(target, part)
    return _as_spec(env_type, target)


def _as_spec(name: str, target: Any) -> EnvSpec:
    """An entry point or "module:Class" target: an EnvSpec, a function returning one, or
    an env class."""
    if isinstance(target, EnvSpec):
        return dataclasses.replace(target, name=name) if target.name != name else target
    if isinstance(target, type):
        return spec_from_class(name, target)
    if callable(target):
        spec = target()
        if isinstance(spec, EnvSpec):
            return dataclasses.replace(spec, name=name)
    raise ValueError(f"env type {name!r} names {target!r}, which is neither an env class "
                     f"nor an EnvSpec")


def spec_from_class(name: str, cls: type) -> EnvSpec:
    """An EnvSpec from an env class's declarations (class attributes):

    - `split_sizes` (required): goals per split, e.g. {"train": 500, "eval": 50, "test": 50};
      `reset` gets the task (its `goal_index` below that size) in `options["task"]`
    - `max_turns` (default 10): the turn cap of its tasks
    - `action_format` (default ""): the system prompt telling the model how to act
    - `config_class`: a dataclass validating the settings; the env is then built as
      `cls(config_class(**settings))`, else as `cls(**settings)`
    - `expert(env) -> Policy`: a staticmethod/classmethod making a scripted expert
    - `latency`: a LatencySpec for simulated latency (default none)
    - `tools`: the functions the model may call (`actions.Tool`s or OpenAI-style dicts);
      they are listed in the system prompt and imply `action_parser = "tool_call"`
    - `action_parser`: "raw" (default), "bracket", "tool_call" or a registered name; the
      env's step then receives the parsed action (a `ToolCall` for tool calls)
    - `return_rule`: how per-step rewards make the episode's return: "last" (default),
      "sum" or "max" (`RETURN_RULES`)

    Observations may say who speaks: `info["role"]` is "user" (default) or "tool" (the
    result of a tool call; tool-call envs get "tool" unless they say otherwise). A task
    may carry a dataset row (`Task.data`: prompt `messages`, `metadata`) that `reset`
    reads from `options["task"]`.
    """
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise ValueError(f"env type {name!r}: {cls.__qualname__} has no {method}() method")
    sizes = getattr(cls, "split_sizes", None)
    if not isinstance(sizes, Mapping):
        raise ValueError(f"env type {name!r}: {cls.__qualname__} must declare split_sizes, "
                         f'e.g. split_sizes = {{"train": 100, "eval": 20, "test": 20}}')
    config_class = getattr(cls, "config_class", None)
    if config_class is not None and not dataclasses.is_dataclass(config_class):
        raise ValueError(f"env type {name!r}: config_class must be a dataclass")

    try:
        tools = tuple(Tool.of(t) for t in getattr(cls, "tools", None) or ())
        parser_name = getattr(cls, "action_parser", "tool_call" if tools else "raw")
        parser = get_action_parser(parser_name)
    except ValueError as e:
        raise ValueError(f"env type {name!r}: {e}") from None
    prompt = str(getattr(cls, "action_format", ""))
    if tools:  # the model must see the tools it may call
        listed = "\n".join(json.dumps({"name": t.name, "description": t.description,
                                        "parameters": dict(t.parameters)}) for t in tools)
        prompt = f"{prompt}\n\n# Tools\n{listed}".lstrip()

    def factory(**settings: Any) -> TextEnv:
        if config_class is not None:
            env = cls(build_env_config(config_class, settings))
        else:
            env = cls(**settings)
        if parser_name == "raw":
            return env
        return ParsedActionEnv(env, parser, tools)

    return_rule = getattr(cls, "return_rule", "last")
    if return_rule not in RETURN_RULES:
        raise ValueError(f"env type {name!r}: return_rule must be one of {RETURN_RULES}, "
                         f"got {return_rule!r}")
    max_turns = getattr(cls, "max_turns", 10)
    if not isinstance(max_turns, int) or isinstance(max_turns, bool):
        raise ValueError(f"env type {name!r}: max_turns must be an int, got {max_turns!r}")
    latency = getattr(cls, "latency", None) or LatencySpec(median_s=0.0, p99_s=0.0)
    return EnvSpec(name=name, factory=factory, default_max_turns=max_turns,
                   split_sizes=dict(sizes), latency=latency,
                   action_format=prompt,
                   expert=getattr(cls, "expert", None), config_class=config_class,
                   return_rule=return_rule)


def build_env_config(config_class: type, settings: Mapping[str, Any], path: str = "env") -> Any:
    """`config_class(**settings)`, nested dataclasses built from tables; a bad field raises
    ValueError naming it as `path.field`."""
    if isinstance(settings, config_class):
        return settings
    if not isinstance(settings, Mapping):
        raise ValueError(f"{path} must be a table, got {type(settings).__name__}")
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise ValueError(f"unknown env setting {path}.{unknown[0]}; "
                         f"{config_class.__name__} has {sorted(fields)}")
    hints = typing.get_type_hints(config_class)
    kwargs = {}
    for key, value in settings.items():
        hint = hints.get(key)
        if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
            value = build_env_config(hint, value, f"{path}.{key}")  # type: ignore[arg-type]
        elif isinstance(value, list):
            value = tuple(value)
        _check_scalar(hint, value, f"{path}.{key}")
        kwargs[key] = value
    try:
        return config_class(**kwargs)
    except (TypeError, ValueError) as e:
        # Name the field when the class's own check names exactly one of them.
        named = [f for f in fields if re.search(rf"\b{re.escape(f)}\b", str(e))]
        where = f"{path}.{named[0]}" if len(named) == 1 else path
        raise ValueError(f"{where}: {e}") from None


def _check_scalar(hint: Any, value: Any, path: str) -> None:
    """A str/int/float/bool field must get one (TOML and JSON carry these types exactly)."""
    if hint not in (str, int, float, bool):
        return
    ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ValueError(f"{path} must be a {hint.__name__}, got {value!r}")


def env_settings(env_type: str, settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """The factory keyword arguments for `settings`, checked by the env's config class
    (when it declares one) so that a bad one fails here, naming its field."""
    spec = get_spec(env_type)
    settings = dict(settings or {})
    if spec.config_class is not None:
        build_env_config(spec.config_class, settings)
    return settings


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
    rows: Sequence[Mapping[str, Any]] | None = None,
) -> list[Task]:
    """GRPO groups: `n_groups` distinct goals of `split`, each repeated `group_size` times.

    Goals are drawn without replacement while the split has enough of them. A group is
    of kind "long_tail" with probability `long_tail_fraction` (its env calls then draw
    from the heavier latency tail). Ids and each group's reset seed are stable for a given
    seed. `env_kwargs` are those the envs are built with (they may change how many goals a
    split has). With `rows` (the split's dataset, `read_task_rows`) the split has one goal
    per row and each task carries its row as `Task.data`.
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
    size = len(rows) if rows is not None else spec.sizes(env_kwargs)[split]
    if size < 1:
        raise ValueError(f"split {split!r} has no goals")
    rng = np.random.default_rng(seed)
    goals = rng.choice(size, size=n_groups, replace=n_groups > size)
    long_tail = rng.random(n_groups) < long_tail_fraction
    seeds = rng.integers(0, 2**31 - 1, size=n_groups)  # drawn last: earlier draws unchanged
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
                    seed=int(seeds[g]),  # one per group: its members start alike
                    data=None if rows is None else dict(rows[int(goals[g])]),
                )
            )
    return tasks

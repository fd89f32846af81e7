"""The text-env protocol: tasks, the Gymnasium-style env interface, step results.

An env is Gymnasium's interface narrowed to text: observations are plain strings and
actions are the strings a language model writes.

    obs, info = env.reset(seed=None, options={"task": task})
    obs, reward, terminated, truncated, info = env.step("click[buy now]")

`terminated` means the episode reached its own end (a purchase, a solved goal);
`truncated` means the task's turn cap ran out. Envs are deterministic given the task:
the same task and the same actions give the same observations, which is what lets the
pool rebuild a broken env by replaying its actions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import zlib
from typing import Any, Literal, Protocol, runtime_checkable

Split = Literal["train", "eval", "test"]
SPLITS: tuple[str, ...] = ("train", "eval", "test")

# Limits every env path enforces alike (the pool for local and remote envs, the server):
# an action longer than this is refused before it reaches an env, an observation longer
# than this is a malformed observation.
MAX_ACTION_CHARS = 4096
MAX_OBS_CHARS = 200_000


@dataclasses.dataclass(frozen=True)
class Task:
    """One trajectory to roll out: which env, which goal, which GRPO group.

    All G tasks of a GRPO group share `group_id` and `goal_index`. `kind` selects the
    latency regime ("normal", or "long_tail" for the heavier tail) and is free-form
    otherwise, so the runtime can tag tasks for diversity-aware admission.
    """

    task_id: str
    group_id: str
    split: Split
    env_type: str
    goal_index: int
    max_turns: int
    kind: str = "normal"
    # Passed to every reset of this task, replays included (None: the pool derives one
    # from group_id, so a GRPO group's members start from the same state).
    seed: int | None = None
    # A dataset row (JSON object) for envs whose tasks are more than a goal index:
    # `messages` (chat messages that open the episode: an optional system message, then
    # user / assistant context) and free-form `metadata` the env reads in `reset`.
    data: dict[str, Any] | None = dataclasses.field(default=None, hash=False)

    def __post_init__(self) -> None:
        if not self.task_id or not isinstance(self.task_id, str):
            raise ValueError(f"task_id must be a non-empty string, got {self.task_id!r}")
        if not self.group_id or not isinstance(self.group_id, str):
            raise ValueError(f"group_id must be a non-empty string, got {self.group_id!r}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if not self.env_type or not isinstance(self.env_type, str):
            raise ValueError(f"env_type must be a non-empty string, got {self.env_type!r}")
        if not isinstance(self.goal_index, int) or self.goal_index < 0:
            raise ValueError(f"goal_index must be an int >= 0, got {self.goal_index!r}")
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {self.max_turns!r}")
        if not self.kind or not isinstance(self.kind, str):
            raise ValueError(f"kind must be a non-empty string, got {self.kind!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or self.seed < 0):
            raise ValueError(f"seed must be an int >= 0 or None, got {self.seed!r}")
        if self.data is not None:
            check_task_data(self.data)

    @property
    def reset_seed(self) -> int:
        """The seed every reset of this task gets: `seed`, else a stable hash of group_id."""
        if self.seed is not None:
            return self.seed
        return zlib.crc32(self.group_id.encode())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        """Builds a Task from JSON-like data; bad data raises TypeError or ValueError."""
        if not isinstance(d, dict):
            raise TypeError(f"task must be an object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"task has unknown fields {sorted(unknown)}")
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = required - set(d)
        if missing:
            raise ValueError(f"task is missing fields {sorted(missing)}")
        try:
            return cls(**d)
        except TypeError as e:  # e.g. an unhashable value where a str belongs
            raise ValueError(f"bad task: {e}") from None


TASK_DATA_KEYS = ("messages", "metadata")
PROMPT_ROLES = ("system", "user", "assistant")
OBSERVATION_ROLES = ("user", "tool")


def check_task_data(data: Any) -> None:
    """A task's dataset row: a JSON object with optional `messages` (a list of
    {"role", "content"} with roles in PROMPT_ROLES, a system message only first) and
    `metadata` (an object). Raises ValueError naming what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"task data must be an object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(TASK_DATA_KEYS))
    if unknown:
        raise ValueError(f"task data has unknown keys {unknown}; known: {TASK_DATA_KEYS}")
    messages = data.get("messages", [])
    if not isinstance(messages, list):
        raise ValueError("task data 'messages' must be a list of {role, content} objects")
    for i, m in enumerate(messages):
        if (not isinstance(m, dict) or set(m) != {"role", "content"}
                or not isinstance(m["content"], str)):
            raise ValueError(f"task data messages[{i}] must be an object with exactly a "
                             f"'role' and a string 'content'")
        if m["role"] not in PROMPT_ROLES:
            raise ValueError(f"task data messages[{i}].role must be one of {PROMPT_ROLES}, "
                             f"got {m['role']!r}")
        if m["role"] == "system" and i:
            raise ValueError(f"task data messages[{i}]: a system message may only come first")
    if not isinstance(data.get("metadata", {}), dict):
        raise ValueError("task data 'metadata' must be an object")


def read_task_rows(path: str) -> list[dict[str, Any]]:
    """A split's dataset rows from a JSONL file (one `Task.data` object per line, blank
    lines skipped); a bad row raises ValueError naming the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                check_task_data(row)
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{path} line {number}: {e}") from None
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


@runtime_checkable
class TextEnv(Protocol):
    """What the pool, the server and the policies need from an env."""

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]: ...

    def close(self) -> None: ...


@runtime_checkable
class Policy(Protocol):
    """Maps the latest observation (and its info) to the next action string."""

    def act(self, obs: str, info: dict[str, Any]) -> str: ...


class MalformedObservation(Exception):
    """An env (or a server) returned something that is not a valid observation."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What the pool hands back for one reset or step of one task.

    `error` is None when the env answered normally. Otherwise it names why the task
    ended ("exception", "timeout", "malformed_observation", "unknown_task",
    "episode_over", "replay_diverged", "action_too_long"); such a result is final
    (`truncated` is True) and `info["detail"]` says more.
    """

    task_id: str
    obs: str
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    latency_s: float = 0.0  # simulated env latency this call waited for, replays included
    attempts: int = 1  # env instances tried: 1 + retries that replayed the episode
    faults: tuple[str, ...] = ()  # every fault met on the way, recovered from or not

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    @property
    def ok(self) -> bool:
        return self.error is None


def task_from_options(options: dict[str, Any] | None) -> Task | None:
    """Reads the task out of reset options: a Task, or a dict in Task's shape."""
    if not options or options.get("task") is None:
        return None
    task = options["task"]
    if isinstance(task, Task):
        return task
    return Task.from_dict(task)


def validate_reset(out: Any, max_obs_chars: int) -> tuple[str, dict[str, Any]]:
    """Checks an env's reset return; raises MalformedObservation naming the problem."""
    if not isinstance(out, tuple) or len(out) != 2:
        raise MalformedObservation(f"reset must return (obs, info), got {type(out).__name__}")
    obs, info = out
    _check_obs(obs, max_obs_chars)
    _check_info(info)
    return obs, info


def validate_step(out: Any, max_obs_chars: int) -> tuple[str, float, bool, bool, dict[str, Any]]:
    """Checks an env's step return; raises MalformedObservation naming the problem."""
    if not isinstance(out, tuple) or len(out) != 5:
        raise MalformedObservation(
            f"step must return (obs, reward, terminated, truncated, info), got {out!r:.80}"
        )
    obs, reward, terminated, truncated, info = out
    _check_obs(obs, max_obs_chars)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise MalformedObservation(f"reward must be a number, got {type(reward).__name__}")
    if not math.isfinite(reward):
        raise MalformedObservation(f"reward must be finite, got {reward}")
    if not isinstance(terminated, bool) or not isinstance(truncated, bool):
        raise MalformedObservation("terminated and truncated must be bools")
    _check_info(info)
    return obs, float(reward), terminated, truncated, info


def _check_info(info: Any) -> None:
    if not isinstance(info, dict):
        raise MalformedObservation(f"info must be a dict, got {type(info).__name__}")
    if info.get("role", "user") not in OBSERVATION_ROLES:
        raise MalformedObservation(f"info['role'] must be one of {OBSERVATION_ROLES}, "
                                   f"got {info['role']!r}")


def _check_obs(obs: Any, max_obs_chars: int) -> None:
    if not isinstance(obs, str):
        raise MalformedObservation(f"observation must be a str, got {type(obs).__name__}")
    if len(obs) > max_obs_chars:
        raise MalformedObservation(f"observation has {len(obs)} chars > {max_obs_chars}")
    if "\x00" in obs:
        raise MalformedObservation("observation contains NUL characters")

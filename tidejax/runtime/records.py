"""What the rollout manager knows about each task and group, and what it hands on.

Plain records, no behaviour beyond a few derived figures: the manager
(`runtime.manager`), its schedulers (`runtime.scheduling`) and the episode loop
(`runtime.episode_loop`) share them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import math

from tidejax.envs import Task
from tidejax.rl.batch import Trajectory
from tidejax.runtime.episode import EpisodeTokens


class TaskState(str, enum.Enum):
    """Where a task is in its life (a str, so it reads and logs as its value)."""

    PENDING = "pending"  # queued, not admitted
    READY = "ready"  # admitted, its next turn may run once it holds a rank
    GENERATING = "generating"  # a turn is on a rollout rank
    ENV = "env"  # waiting for its env's answer
    PAUSED = "paused"  # holds no rank: its KV is unpinned until CTB resumes it
    DONE = "done"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


# Tasks that hold neither env nor KV and never will again (or not yet).
INACTIVE = (TaskState.PENDING, TaskState.DONE, TaskState.FAILED)
ENDED = (TaskState.DONE, TaskState.FAILED)


@dataclasses.dataclass
class TaskRecord:
    task: Task
    uid: int
    group: GroupRecord
    rank: int | None = None  # rank holding (or about to hold) its KV; None while paused
    home: int | None = None
    state: TaskState = TaskState.PENDING
    episode: EpisodeTokens | None = None
    # KV tokens its admission charged against the rank's CTB budget; stands for the task's
    # footprint until its episode exists (between admission and the env reset's prompt)
    charge_tokens: int = 0
    reward: float = 0.0  # the episode's return, by the env's return rule
    step_rewards: list[float] = dataclasses.field(default_factory=list)
    won: bool = False
    error: str | None = None
    attempts: int = 0
    actions: list[str] = dataclasses.field(default_factory=list)  # as the env received them
    end: str = ""  # how the episode ended: env_done | context_cap
    can_run: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def tokens(self) -> int:
        return len(self.episode) if self.episode is not None else 0

    @property
    def active(self) -> bool:
        return self.state not in INACTIVE


@dataclasses.dataclass
class GroupRecord:
    group_id: str
    uid: int
    tasks: list[TaskRecord]
    is_eval: bool
    eval_version: int = -1  # evaluation groups: the policy version they measure
    probe_tokens: int | None = None
    admitted: int = 0
    route: int | None = None  # request-level: the rank its tasks are sent to

    @property
    def finished(self) -> int:
        return sum(t.state in ENDED for t in self.tasks)


@dataclasses.dataclass
class EvalTally:
    version: int
    groups: int = 0
    episodes: int = 0
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    wins: int = 0
    transcripts: list[dict] = dataclasses.field(default_factory=list)

    @property
    def reward(self) -> float:
        return self.reward_sum / self.episodes if self.episodes else float("nan")

    @property
    def reward_se(self) -> float:
        """Standard error of the mean episode reward (sample std / sqrt(episodes))."""
        return reward_standard_error(self.reward_sum, self.reward_sq_sum, self.episodes)


def reward_standard_error(total: float, total_sq: float, n: int) -> float:
    """Standard error of a mean from the sum and the sum of squares of `n` samples."""
    if n < 2:
        return float("nan")
    variance = max(0.0, (total_sq - total * total / n) / (n - 1))
    return math.sqrt(variance / n)


@dataclasses.dataclass
class GroupPayload:
    """A finished training group as the trainer consumes it."""

    trajectories: list[Trajectory]
    advantages: list[float]
    keep: list[bool]
    task_ids: list[str]

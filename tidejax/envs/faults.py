"""Fault injection for envs: exceptions, hangs and garbage observations on purpose.

`FaultInjector` wraps an env factory; every env it makes draws, on each reset and
step, one of: raise, hang for `hang_s` (longer than the pool's timeout, so the pool
sees a timeout), return garbage, or behave. Draws come from a Generator seeded by
(seed, task id, instance number), so a run is reproducible. The injector counts what
it injected under the names the pool reports ("exception", "timeout",
"malformed_observation"), so tests can check that every fault was seen.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from tidejax.envs.protocol import Task, TextEnv


class InjectedFault(RuntimeError):
    """Raised by a FaultInjectingEnv on purpose."""


@dataclasses.dataclass(frozen=True)
class FaultConfig:
    p_exception: float = 0.0
    p_hang: float = 0.0
    p_garbage: float = 0.0
    hang_s: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("p_exception", "p_hang", "p_garbage"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if self.p_exception + self.p_hang + self.p_garbage > 1.0:
            raise ValueError("p_exception + p_hang + p_garbage must be <= 1")
        if not self.hang_s >= 0.0:
            raise ValueError(f"hang_s must be >= 0, got {self.hang_s}")

    @classmethod
    def uniform(cls, total: float, hang_s: float = 5.0, seed: int = 0) -> FaultConfig:
        """`total` fault probability split evenly over the three kinds."""
        return cls(total / 3, total / 3, total / 3, hang_s, seed)


_GARBAGE_STEP: tuple[Callable[[tuple], Any], ...] = (
    lambda out: (None, *out[1:]),
    lambda out: (out[0].encode(), *out[1:]),
    lambda out: (out[0], float("nan"), *out[2:]),
    lambda out: ("\x00" * 8, *out[1:]),
    lambda out: ("x" * 2_000_000, *out[1:]),  # over any sane max_obs_chars
    lambda out: out[:3],
    lambda out: (out[0], out[1], "yes", out[3], out[4]),
    lambda out: (*out[:4], ["not", "a", "dict"]),
)
_GARBAGE_RESET: tuple[Callable[[tuple], Any], ...] = (
    lambda out: (None, out[1]),
    lambda out: (out[0], "info"),
    lambda out: out[0],
    lambda out: ("x" * 2_000_000, out[1]),
)


class FaultInjectingEnv:
    def __init__(
        self, env: TextEnv, config: FaultConfig, rng: np.random.Generator, counts: FaultCounts
    ):
        self.env, self.config, self.rng, self.counts = env, config, rng, counts

    def _call(self, fn: Callable[[], Any], garbage: tuple[Callable[[tuple], Any], ...]) -> Any:
        c = self.config
        u = self.rng.random()
        if u < c.p_exception:
            self.counts.add("exception")
            if self.rng.random() < 0.5:
                fn()  # fail after the env moved on: recovery must not trust its state
            raise InjectedFault("injected exception")
        if u < c.p_exception + c.p_hang:
            self.counts.add("timeout")
            time.sleep(c.hang_s)
            return fn()
        if u < c.p_exception + c.p_hang + c.p_garbage:
            self.counts.add("malformed_observation")
            out = fn()
            return garbage[int(self.rng.integers(len(garbage)))](out)
        return fn()

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        return self._call(lambda: self.env.reset(seed=seed, options=options), _GARBAGE_RESET)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return self._call(lambda: self.env.step(action), _GARBAGE_STEP)

    def close(self) -> None:
        self.env.close()


class FaultCounts:
    """Thread-safe tally of injected faults by the reason the pool should report."""

    def __init__(self) -> None:
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def add(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {k: self._counts[k] for k in ("exception", "timeout", "malformed_observation")}


class FaultInjector:
    """Wraps an env factory (task -> env) so that its envs misbehave at random."""

    def __init__(self, factory: Callable[[Task], TextEnv], config: FaultConfig):
        self.factory = factory
        self.config = config
        self.counts = FaultCounts()
        self._instances: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def __call__(self, task: Task) -> FaultInjectingEnv:
        with self._lock:
            n = self._instances[task.task_id]
            self._instances[task.task_id] += 1
        rng = np.random.default_rng([self.config.seed, zlib.crc32(task.task_id.encode()), n])
        return FaultInjectingEnv(self.factory(task), self.config, rng, self.counts)

    @property
    def injected(self) -> dict[str, int]:
        return self.counts.snapshot()

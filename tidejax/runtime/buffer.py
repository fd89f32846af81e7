"""The global buffer between rollout (producer) and trainer (consumer).

Rollout puts whole GRPO groups (advantages already computed); the trainer takes groups
for a step. The buffer measures the readiness signals ERS and RA2P decide on:
RAS (ready work when a step starts), TPRM (mean interval between ready micro-batches
during the step) and head-of-line latency (age of the oldest ready group). It enforces
the staleness bound: a group whose oldest token is more than `staleness_bound` versions
behind the trainer is dropped, counted and never trained on. A stale group leaves the
staleness quota like a taken one: `take_new_stale_drops` tells the controller how many were
dropped since it last asked, so it returns their slots to the `RolloutManager` (groups the
manager `drop`s itself, failed ones, it has already returned).

Consumption order. "admission" hands the trainer groups in the order they were admitted
(`admit`), waiting for the oldest; "completion" hands it whatever finished first. The
staleness quota keeps a stream within the bound only if it is consumed in admission order
(`sched/staleness.py`). Completion order passes slow groups over until they are too stale
and dropped, so every batch leans toward the fastest groups: short, often all-success
episodes that carry no GRPO signal (measured by `bench.learning`: about 13% of
generated tokens dropped and a lower final reward than sync). "deadline" takes the oldest
version first and, within it, the fastest, but keeps a place in the batch for every
admitted group still running that would be stale by the next update ("due": admitted at a
version `staleness_bound` or more behind the trainer), so the batch waits for those and no
longer for every slower group admitted before a fast one. `sched.staleness.batch_countable`
is that rule; the controller's `batch_shares` applies it across hosts. Deadline order is
the default: `bench.learning` (3 seeds, 2026-12-07) found it learns like admission order
(final reward +0.002, paired standard error 0.011), and it keeps the trainer fed sooner.

Threads: in a run every call comes from the controller's asyncio loop thread. The
`RolloutManager`'s task coroutines `put` (or `drop`) finished groups; `Controller.run`
polls `batch_digest` between short `asyncio.sleep`s, so the loop keeps serving
turns and env steps while a step waits for its batch, then `take`s it, calling
`take_new_stale_drops` after each poll and the take. The trainer thread
receives the batch's trajectories, never the buffer. One Condition guards everything, so
a caller on another thread may also block in `wait_for` while the loop puts groups.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from typing import Any

from tidejax.runtime.config import CONSUME_ORDERS, DEFAULT_CONSUME_ORDER
from tidejax.sched.staleness import batch_countable, is_due


@dataclasses.dataclass
class ReadyGroup:
    """One finished GRPO group waiting for the trainer."""

    group_id: str
    payload: Any  # the trajectories (tidejax.rl types); opaque to the buffer
    generated_tokens: int  # model-generated tokens: what goodput counts
    total_tokens: int  # prompt + observations + generated: what training compute costs
    min_version: int  # oldest policy version that produced any of its tokens
    ready_time: float = 0.0


@dataclasses.dataclass(frozen=True)
class ReadinessSignals:
    """What the buffer tells the scheduler at a post-update boundary (times in seconds)."""

    ras_micro_batches: float  # ready work at the start of the last step, in micro-batches
    tprm_s: float  # mean seconds per newly ready micro-batch during the last step
    hol_latency_s: float  # age of the oldest ready group now
    ready_groups: int
    ready_tokens: int


@dataclasses.dataclass
class DropRecord:
    group_id: str
    reason: str
    generated_tokens: int


class GlobalBuffer:
    def __init__(self, staleness_bound: int, micro_batch_tokens: int, clock=time.monotonic,
                 consume_order: str = DEFAULT_CONSUME_ORDER):
        if consume_order not in CONSUME_ORDERS:
            raise ValueError(f"consume_order must be one of {CONSUME_ORDERS}, "
                             f"got {consume_order!r}")
        if staleness_bound < 0:
            raise ValueError(f"staleness_bound must be >= 0, got {staleness_bound}")
        if micro_batch_tokens <= 0:
            raise ValueError(f"micro_batch_tokens must be > 0, got {micro_batch_tokens}")
        self.staleness_bound = staleness_bound
        self.micro_batch_tokens = micro_batch_tokens
        self._clock = clock
        self._cond = threading.Condition()
        self.consume_order = consume_order
        self._ready: deque[ReadyGroup] = deque()
        # admitted groups not yet taken or dropped, oldest first: the policy version each
        # was admitted at (its tokens are no older)
        self._admitted: dict[str, int] = {}
        self.dropped: list[DropRecord] = []
        self._unreported_stale = 0  # stale drops not yet returned by take_new_stale_drops
        self._step_start = clock()
        self._ras = 0.0
        self._arrived_tokens_in_step = 0
        self._last_tprm = 0.0
        self.closed = False

    # producer side -------------------------------------------------------------
    def admit(self, group_id: str, version: int) -> None:
        """A training group was admitted at policy `version`: its place in the admission
        order."""
        with self._cond:
            self._admitted.setdefault(group_id, version)

    def put(self, group: ReadyGroup) -> None:
        with self._cond:
            group.ready_time = self._clock()
            # restored groups were never admitted
            self._admitted.setdefault(group.group_id, group.min_version)
            self._ready.append(group)
            self._arrived_tokens_in_step += group.total_tokens
            self._cond.notify_all()

    def drop(self, group_id: str, reason: str, generated_tokens: int = 0) -> None:
        """Record a group that will never reach the trainer (failed env, stale, ...)."""
        with self._cond:
            self.dropped.append(DropRecord(group_id, reason, generated_tokens))
            self._admitted.pop(group_id, None)
            self._cond.notify_all()  # the head of the admission order may have moved

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    # consumer side -------------------------------------------------------------
    def begin_step(self) -> None:
        """Mark a trainer step start: record RAS, reset the TPRM window."""
        with self._cond:
            now = self._clock()
            elapsed = now - self._step_start
            arrived_mb = self._arrived_tokens_in_step / self.micro_batch_tokens
            self._last_tprm = elapsed / arrived_mb if arrived_mb > 0 else float("inf")
            self._ras = sum(g.total_tokens for g in self._ready) / self.micro_batch_tokens
            self._step_start = now
            self._arrived_tokens_in_step = 0

    def _drop_stale(self, trainer_version: int) -> None:
        kept = deque()
        for group in self._ready:
            if trainer_version - group.min_version > self.staleness_bound:
                self.dropped.append(DropRecord(group.group_id, "stale", group.generated_tokens))
                self._admitted.pop(group.group_id, None)
                self._unreported_stale += 1
            else:
                kept.append(group)
        self._ready = kept

    def _takeable(self) -> list[ReadyGroup]:
        """Ready groups the trainer may take now, in the order it takes them."""
        if self.consume_order == "completion":
            return list(self._ready)
        if self.consume_order == "deadline":  # oldest version first, fastest within it
            return sorted(self._ready, key=lambda g: g.min_version)
        ready = {g.group_id: g for g in self._ready}
        prefix = []
        for group_id in self._admitted:  # the ready run at the head of the admission order
            if group_id not in ready:
                break
            prefix.append(ready[group_id])
        return prefix

    def batch_digest(self, trainer_version: int) -> dict[str, int]:
        """Drop the stale groups, then count the groups that may be taken ("ready") and, in
        deadline order, the due ones ready and still running (`batch_countable`'s inputs)."""
        with self._cond:
            self._drop_stale(trainer_version)
            due_ready = due_in_flight = 0
            if self.consume_order == "deadline":
                ready_ids = {g.group_id for g in self._ready}
                bound = self.staleness_bound
                due_ready = sum(is_due(trainer_version, g.min_version, bound)
                                for g in self._ready)
                due_in_flight = sum(is_due(trainer_version, v, bound)
                                    for group_id, v in self._admitted.items()
                                    if group_id not in ready_ids)
            return {"ready": len(self._takeable()), "due_ready": due_ready,
                    "due_in_flight": due_in_flight}

    def wait_for(self, n_groups: int, trainer_version: int, timeout: float | None = None) -> int:
        """Block until `n_groups` fresh groups count toward the batch (`batch_countable`),
        or closed / timed out; returns how many do."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                takeable = batch_countable(n_groups, **self.batch_digest(trainer_version))
                if takeable >= n_groups or self.closed:
                    return takeable
                remaining = None if deadline is None else deadline - self._clock()
                if remaining is not None and remaining <= 0:
                    return takeable
                self._cond.wait(timeout=remaining if remaining is not None else 0.5)

    def take(self, max_groups: int, trainer_version: int) -> list[ReadyGroup]:
        """Up to `max_groups` groups within the staleness bound, in the consumption order
        (how many: `wait_for`, or the controller's `batch_shares`)."""
        with self._cond:
            self._drop_stale(trainer_version)
            taken = self._takeable()[:max_groups]
            taken_ids = {g.group_id for g in taken}
            self._ready = deque(g for g in self._ready if g.group_id not in taken_ids)
            for group_id in taken_ids:
                self._admitted.pop(group_id, None)
            return taken

    def take_new_stale_drops(self) -> int:
        """Groups dropped as stale since the last call (each one is reported once)."""
        with self._cond:
            n, self._unreported_stale = self._unreported_stale, 0
            return n

    def signals(self) -> ReadinessSignals:
        with self._cond:
            now = self._clock()
            hol = now - self._ready[0].ready_time if self._ready else 0.0
            return ReadinessSignals(
                ras_micro_batches=self._ras, tprm_s=self._last_tprm, hol_latency_s=hol,
                ready_groups=len(self._ready),
                ready_tokens=sum(g.total_tokens for g in self._ready))

    def __len__(self) -> int:
        with self._cond:
            return len(self._ready)

    def snapshot(self) -> list[ReadyGroup]:
        """Ready groups, for checkpointing the buffer contents."""
        with self._cond:
            return list(self._ready)

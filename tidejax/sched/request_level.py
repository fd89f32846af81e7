"""Request-level continuous batching: the baseline CTB replaces.

What a vLLM/SGLang-style engine behind an RL rollout manager does with multi-turn tasks:
every turn is an independent request. The manager submits new tasks as long as the
staleness quota and environment capacity allow (least-loaded rank, a whole group to one
rank so siblings share the prompt's pages: the baseline gets prefix-aware routing). Each
rank admits queued requests first come, first served while its free plus evictable pages
cover the request; making room evicts least-recently-used cached pages, including those of
tasks that are only waiting for their environment (the page pool's LRU does that). Nothing
is pinned between turns, which is the behaviour TideRL's C1 measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def admit_fifo(available_tokens: int, needs: Sequence[int], running: int, max_running: int) -> int:
    """How many queued requests, taken in order, start now.

    ``available_tokens`` is free plus evictable KV, ``needs`` the queued requests' new KV
    demand in queue order, ``running`` the sequences already decoding. Stops at the first
    request that does not fit (head-of-line order, as vLLM's FCFS scheduler does).
    """
    if available_tokens < 0 or running < 0 or max_running <= 0:
        raise ValueError("admit_fifo: available_tokens, running must be >= 0, max_running > 0")
    n = 0
    for need in needs:
        if running + n >= max_running or need > available_tokens:
            break
        available_tokens -= need
        n += 1
    return n


@dataclass(frozen=True, slots=True)
class EngineState:
    """One rollout rank's engine."""

    rank: int
    available_tokens: int  # free + evictable (cached, unreferenced) KV tokens
    queued_needs: tuple[int, ...] = ()  # new-token demand of queued requests, FIFO order
    running: int = 0  # sequences decoding now
    max_running: int = 256  # vLLM EngineArgs max_num_seqs default
    assigned_tasks: int = 0  # tasks routed here and not finished (routing load)
    open: bool = True

    def __post_init__(self) -> None:
        if self.available_tokens < 0 or self.running < 0 or self.assigned_tasks < 0:
            raise ValueError(f"EngineState {self.rank}: counts must be >= 0")
        if self.max_running <= 0:
            raise ValueError(f"EngineState {self.rank}: max_running must be positive")


@dataclass(frozen=True, slots=True)
class NewGroup:
    group_id: int
    size: int
    is_eval: bool = False

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"NewGroup {self.group_id}: size must be positive")


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    engines: tuple[EngineState, ...]
    new_groups: tuple[NewGroup, ...] = ()  # in dispatch order
    env_capacity: int = 1 << 30
    env_in_use: int = 0
    outstanding_groups: int = 0
    quota_groups: int = 1 << 30

    def __post_init__(self) -> None:
        ids = [e.rank for e in self.engines]
        if len(set(ids)) != len(ids):
            raise ValueError("RequestSnapshot.engines has duplicate rank ids")
        if min(self.env_capacity, self.env_in_use, self.outstanding_groups) < 0:
            raise ValueError("RequestSnapshot counters must be >= 0")


@dataclass(frozen=True, slots=True)
class RequestDecisions:
    start: tuple[tuple[int, int], ...] = ()  # (rank, n): first n queued requests start
    route: tuple[tuple[int, int], ...] = ()  # (group_id, rank): new groups routed


def decide(snap: RequestSnapshot) -> RequestDecisions:
    """Start what fits on each engine; route new groups to the least-loaded open rank."""
    start = []
    for e in snap.engines:
        n = admit_fifo(e.available_tokens, e.queued_needs, e.running, e.max_running)
        if n:
            start.append((e.rank, n))
    route = []
    load = {e.rank: e.assigned_tasks for e in snap.engines if e.open}
    env_free = snap.env_capacity - snap.env_in_use
    quota_left = snap.quota_groups - snap.outstanding_groups
    for g in snap.new_groups:
        if not load or g.size > env_free:
            break
        if not g.is_eval:
            if quota_left <= 0:
                continue
            quota_left -= 1
        rank = min(load, key=lambda r: (load[r], r))
        load[rank] += g.size
        env_free -= g.size
        route.append((g.group_id, rank))
    return RequestDecisions(start=tuple(start), route=tuple(route))

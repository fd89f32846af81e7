"""One rank's KV pool: device K/V pages plus the host `PagePool`, with per-task turn records.

`PagePool` (shared with the simulator) decides which pages hold which tokens. This module
adds what only the engine knows:

* the device arrays `[L, P + 1, page_size, K, H]`; page `P` is a trash page that padded
  and inactive tokens write into, so writes never need a branch;
* the exact token ids whose K/V a task's live sequence holds. `PagePool` trusts hashes
  of full pages only; before reusing a task's partly filled last page the engine checks
  that the new prompt really extends those tokens. Only these tokens hold valid K/V; the
  pool's count can be higher while a turn runs (a multi-token generate reserves its
  tokens ahead, and the loop frees a slot a dispatch late); `end_turn` truncates the
  sequence back to the tokens with K/V, so what stays pinned or cached is exact;
* the turn lifecycle: `begin_turn` (allocate for a prompt), `grow` (decode reserves one
  more token), `end_turn` (index the full pages of the real sequence, then pin or
  release). `pin` during a turn is remembered and applied when the turn ends.

All mutators keep `PagePool.check()` true; `check()` here also checks the records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tidejax.models.config import ModelConfig
from tidejax.serving.page_pool import PagePool, PoolCounters, PoolUsage, chain_hashes


class KVPages(NamedTuple):
    """Device K and V pages `[L, P + 1, page_size, K, H]` (the last page is trash)."""

    k: jax.Array
    v: jax.Array


def init_kv_pages(config: ModelConfig, num_pages: int, page_size: int,
                  sharding: jax.sharding.Sharding | None = None) -> KVPages:
    shape = (config.num_layers, num_pages + 1, page_size, config.num_kv_heads, config.head_dim)

    def zeros():
        return jnp.zeros(shape, config.jnp_dtype)

    make = jax.jit(zeros, out_shardings=sharding) if sharding is not None else zeros
    return KVPages(make(), make())


@dataclasses.dataclass
class _Record:
    tokens: list[int]  # token ids of the live sequence whose K/V is valid
    in_turn: bool = False
    pin_at_end: bool = False


@dataclasses.dataclass(frozen=True)
class TurnPlan:
    """Where a prefill starts: tokens `[start, len(prompt))` are computed.

    `write` is False only when the whole prompt was cached: the last token is recomputed
    for its logits, but its K/V is already in a (possibly shared) page and is not written.
    """

    start: int
    write: bool
    cached_tokens: int  # prompt tokens whose K/V was reused (the engine's hit count)


class KVPool:
    """Host bookkeeping for one rank; the engine owns the device `KVPages` next to it."""

    def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int):
        self.pages = PagePool(num_pages, page_size)
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.trash_page = num_pages
        self._records: dict[Hashable, _Record] = {}

    # ------------------------------------------------------------------ queries
    def usage(self) -> PoolUsage:
        return self.pages.usage()

    def counters(self) -> PoolCounters:
        return self.pages.counters()

    def page_row(self, task_id: Hashable) -> np.ndarray:
        """The task's page table row `[Pmax]`, padded with the trash page."""
        row = np.full((self.max_pages_per_seq,), self.trash_page, np.int32)
        pages = self.pages.pages(task_id)
        row[: len(pages)] = pages
        return row

    def pages_needed(self, task_id: Hashable, prompt: Sequence[int]) -> int:
        """New pages `begin_turn(task_id, prompt)` would take (no side effect)."""
        hashes = chain_hashes(prompt, self.page_size)
        record = self._records.get(task_id)
        if record is not None and not _extends(record.tokens, prompt):
            # begin_turn releases the stale sequence first and then reuses indexed pages.
            return self.pages.pages_for(len(prompt)) - self.pages.lookup_prefix(hashes)
        return self.pages.pages_needed(task_id, len(prompt), hashes)

    def available_pages(self) -> int:
        return self.pages.available_pages()

    def has(self, task_id: Hashable) -> bool:
        return task_id in self._records

    def in_turn(self, task_id: Hashable) -> bool:
        record = self._records.get(task_id)
        return record is not None and record.in_turn

    def is_pinned(self, task_id: Hashable) -> bool:
        return self.pages.is_pinned(task_id)

    def tasks(self) -> tuple[Hashable, ...]:
        return tuple(self._records)

    # ---------------------------------------------------------------- mutations
    def begin_turn(self, task_id: Hashable, prompt: Sequence[int]) -> TurnPlan:
        """Allocate pages for `prompt`, reusing the task's own or indexed cached pages.

        Raises `PoolFull` or `ValueError` (too long / task mid-turn). A live sequence the
        prompt does not extend is released first (its indexed pages stay cached).
        """
        n = len(prompt)
        if n == 0:
            raise ValueError("prompt must not be empty")
        if self.pages.pages_for(n) > self.max_pages_per_seq:
            raise ValueError(f"prompt of {n} tokens exceeds max_seq_len "
                             f"{self.max_pages_per_seq * self.page_size}")
        record = self._records.get(task_id)
        if record is not None and record.in_turn:
            raise ValueError(f"task {task_id!r} is already in a turn")
        hashes = chain_hashes(prompt, self.page_size)
        own_valid = None
        if record is not None:
            if _extends(record.tokens, prompt) and self.pages.tokens(task_id) <= n:
                own_valid = len(record.tokens)
            else:
                # The old sequence is not a prefix of this prompt: its partly filled page
                # must not be reused. Its indexed full pages stay findable through the index.
                self._drop(task_id)
                record = None
        cached = self.pages.allocate(task_id, n, hashes)
        # Own sequence: the pool counts every token it holds; only `own_valid` hold real K/V.
        start = min(cached, own_valid) if own_valid is not None else cached
        self._records[task_id] = _Record(tokens=list(prompt), in_turn=True)
        if start >= n:
            return TurnPlan(start=n - 1, write=False, cached_tokens=n - 1)
        return TurnPlan(start=start, write=True, cached_tokens=start)

    def grow(self, task_id: Hashable, n_tokens: int = 1) -> bool:
        """Reserve `n_tokens` more for a decoding task. Returns whether a page was added.

        Raises `PoolFull` (nothing changed) when no page can be found.
        """
        before = len(self.pages.pages(task_id))
        self.pages.extend(task_id, n_tokens)
        return len(self.pages.pages(task_id)) != before

    def grow_needs_page(self, task_id: Hashable, n_tokens: int = 1) -> bool:
        have = len(self.pages.pages(task_id))
        return self.pages.pages_for(self.pages.tokens(task_id) + n_tokens) > have

    def end_turn(self, task_id: Hashable, tokens: Sequence[int] | None,
                 keep: bool | None = None) -> bool:
        """The task's turn is over. Returns whether its pages stay pinned.

        `tokens` is the whole sequence (prompt + generated); all but the last hold K/V and
        their full pages are indexed for prefix reuse. Without `tokens` only the prompt is
        known, and the task cannot be pinned. `keep=None` pins if `pin` was called during
        the turn; True / False decide here.
        """
        record = self._live_record(task_id)
        if not record.in_turn:
            raise ValueError(f"task {task_id!r} is not in a turn")
        pin = record.pin_at_end if keep is None else keep
        valid = None
        if tokens is not None:
            tokens = list(tokens)
            if tokens[: len(record.tokens)] != record.tokens:
                raise ValueError("tokens must start with the turn's prompt")
            valid = tokens[:-1] if len(tokens) > len(record.tokens) else record.tokens
            if len(valid) > self.pages.tokens(task_id):
                raise ValueError("tokens extend beyond what the turn decoded")
        elif pin:
            raise ValueError("pinning a task needs its tokens")
        record.in_turn = False
        if valid is not None:
            # A decoder that reserved ahead (multi-token steps, results read a step late)
            # holds more tokens than have K/V: give the unused tail back first.
            self.pages.truncate(task_id, len(valid))
            self.pages.extend(task_id, 0, chain_hashes(valid, self.page_size))
            record.tokens = valid
        if pin:
            self.pages.pin(task_id)
            record.pin_at_end = False
            return True
        self._drop(task_id)
        return False

    def pin(self, task_id: Hashable) -> None:
        """Keep the task's pages resident across its env wait (deferred if mid-turn)."""
        record = self._live_record(task_id)
        if record.in_turn:
            record.pin_at_end = True
        else:
            self.pages.pin(task_id)

    def unpin(self, task_id: Hashable) -> None:
        """The task's pages become evictable (still reusable until evicted)."""
        record = self._live_record(task_id)
        if record.in_turn:
            record.pin_at_end = False
            return
        self.pages.unpin(task_id)
        del self._records[task_id]

    def evict(self, task_id: Hashable) -> None:
        """Free the task's pages now (those no other sequence references)."""
        record = self._live_record(task_id)
        if record.in_turn:
            raise ValueError(f"task {task_id!r} is mid-turn; free its slot first")
        self.pages.evict(task_id)
        del self._records[task_id]

    def abort_turn(self, task_id: Hashable, kv_written: bool = True) -> None:
        """End a turn without indexing what it generated (preemption, errors).

        If the prefill never ran (`kv_written=False`) the prompt pages indexed by
        `begin_turn` hold garbage, so they are freed now instead of cached.
        """
        self._live_record(task_id)
        if kv_written:
            self._drop(task_id)
        else:
            self.pages.evict(task_id)
            del self._records[task_id]

    def flush(self) -> tuple[Hashable, ...]:
        """New weights: every cached K/V is stale. Returns the tasks dropped."""
        self._records.clear()
        return self.pages.flush()

    def check(self) -> None:
        self.pages.check()
        if set(self._records) != set(self.pages.tasks()):
            raise AssertionError("task records differ from the pool's live sequences")
        for task_id, record in self._records.items():
            if self.pages.tokens(task_id) < len(record.tokens):
                raise AssertionError(f"task {task_id!r} records more tokens than it holds")

    # ---------------------------------------------------------------- internals
    def _live_record(self, task_id: Hashable) -> _Record:
        record = self._records.get(task_id)
        if record is None:
            raise KeyError(f"task {task_id!r} has no live sequence")
        return record

    def _drop(self, task_id: Hashable) -> None:
        if self.pages.has(task_id):
            self.pages.release(task_id)
        self._records.pop(task_id, None)


def _extends(old: Sequence[int], new: Sequence[int]) -> bool:
    return len(new) >= len(old) and list(new[: len(old)]) == list(old)

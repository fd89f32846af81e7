"""Host-side page bookkeeping for a paged KV cache, shared by the engine and the simulator.

This module is pure Python (no jax, no numpy). It decides *which* pages hold *which* tokens;
the serving engine keeps the device K/V arrays indexed by the page ids it hands out, and the
cluster simulator uses it as is, so KV hit rates in both come from the same rules.

Model
-----
The pool has ``num_pages`` pages of ``page_size`` tokens. Every page is in exactly one state:

* **free**: holds nothing;
* **cached**: unreferenced, but its contents are still valid and findable through the prefix
  index; evictable, least recently used first;
* **referenced**: held by one or more live sequences (refcount > 0); never evicted.

A *sequence* belongs to one task (``task_id``, any hashable) and is the ordered list of pages
holding that task's tokens. A live sequence is either **active** (the task is in a turn) or
**pinned** (the task waits for its environment and keeps its pages, so its next turn needs no
re-prefill). Pinned and active sequences both hold references, so neither is ever evicted.

Prefix index. Only FULL pages are indexed. A page's key is a hash chain:
``key_i = hash_page(key_{i-1}, tokens of page i)`` with ``key_{-1} = ROOT_HASH``, so equal
keys mean equal whole prefixes. :func:`chain_hashes` computes the keys of a token list.
Callers that do not carry real token ids (the simulator) may pass any hashable that
identifies the page's tokens instead of the tuple of ids (e.g. ``(task, page_index)`` for
tokens derived from task and position); the rules are unchanged. Keys are Python ``hash`` of
tuples of ints (deterministic across processes; 64-bit, so collisions are negligible but
possible: an engine that cannot tolerate one should also compare token ids on a hit).

Calls
-----
``allocate(task, n_tokens, page_hashes, reserve=0) -> cached_tokens``
    Start a turn: the task's prompt now has ``n_tokens`` tokens whose full pages have keys
    ``page_hashes``. If the task has a live sequence whose known keys are a prefix of
    ``page_hashes``, its pages (including a partly filled last page) are reused. Otherwise the
    longest run of leading pages found in the index is reused (shared with other sequences),
    the task's previous pages are dropped, and the rest are allocated, evicting cached pages
    in LRU order if the free list is empty. Returns how many prompt tokens were served from
    cache; the caller prefills only the rest. Raises :class:`PoolFull` (and changes nothing)
    if the pages cannot be found without touching referenced pages. ``reserve`` appends
    that many decode tokens in the same call (all or nothing), as if ``extend`` followed.
``extend(task, n_tokens, page_hashes)``
    Append ``n_tokens`` generated tokens. ``page_hashes`` lists keys of the sequence's full
    pages (the whole chain so far, possibly shorter than the number of full pages); newly
    full pages with a known key are indexed. Raises :class:`PoolFull` without change.
``truncate(task, n_tokens)``
    Give back the tail of a sequence that reserved more tokens than it used.
``pin(task)``
    The turn ended and the task will come back: keep its pages resident (pinned).
``unpin(task)``
    A pinned task gives up residency: its pages become cached (evictable, still reusable by
    a later ``allocate``); the sequence is forgotten.
``release(task)``
    Same effect as ``unpin`` for any live sequence: what request-level serving does when a
    request (or a whole trajectory) ends.
``evict(task)``
    Drop the task's pages and free those no other sequence references, now.
``flush()``
    Weights changed: every live sequence is dropped and every cached page freed.

Queries: :meth:`lookup_prefix`, :meth:`pages_needed`, :meth:`admission_need` (exact pages
an ``allocate`` would take vs can get), :meth:`available_pages`,
:meth:`usage` (a frozen :class:`PoolUsage` in tokens: used / pinned / cached / free) and
:meth:`counters` (prompt tokens needed, prompt tokens served from cache, evicted pages).
Hit rate = ``hit_tokens / prompt_tokens``.

Invariants (checked by :meth:`check`): a page is free xor cached xor referenced; a page's
refcount equals the number of live sequences holding it; the index maps each key to one
cached or referenced page whose recorded key is that key; cached pages are exactly the
unreferenced indexed pages.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

ROOT_HASH = 0


def hash_page(parent: int, tokens: Hashable) -> int:
    """Key of a full page: a hash of (parent key, the page's tokens or a stand-in for them)."""
    return hash((parent, tokens))


def chain_hashes(tokens: Sequence[int], page_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Keys of the full pages of ``tokens`` (a trailing partial page has no key)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    keys = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = hash_page(parent, tuple(tokens[start : start + page_size]))
        keys.append(parent)
    return keys


class PoolFull(RuntimeError):
    """Not enough free or evictable pages; the pool is unchanged."""


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """Token accounting of one pool; the four parts sum to ``total_tokens``."""

    total_tokens: int
    used_tokens: int  # in pages referenced by an active sequence
    pinned_tokens: int  # in pages referenced only by pinned sequences
    cached_tokens: int  # in unreferenced, indexed (evictable) pages
    free_tokens: int

    def __post_init__(self) -> None:
        parts = (self.used_tokens, self.pinned_tokens, self.cached_tokens, self.free_tokens)
        if min(parts) < 0:
            raise ValueError(f"negative token count in {self}")
        if sum(parts) != self.total_tokens:
            raise ValueError(f"used+pinned+cached+free != total_tokens in {self}")


@dataclass(frozen=True, slots=True)
class PoolCounters:
    """Cumulative counters: prompt tokens needed, of which served from cache; evictions."""

    prompt_tokens: int
    hit_tokens: int
    evicted_pages: int
    flushed_pages: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _Seq:
    __slots__ = ("hashes", "n_tokens", "pages", "pinned")

    def __init__(self) -> None:
        self.pages: list[int] = []
        self.n_tokens = 0
        self.hashes: list[int] = []  # keys of leading full pages, as given by the caller
        self.pinned = False


class PagePool:
    """Pages, refcounts, a prefix index over full pages, LRU eviction, per-task sequences."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._ref = [0] * num_pages
        self._key: list[int | None] = [None] * num_pages  # indexed key of the page, if any
        self._index: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, oldest first
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._seqs: dict[Hashable, _Seq] = {}
        self._prompt_tokens = 0
        self._hit_tokens = 0
        self._evicted = 0
        self._flushed = 0

    # ------------------------------------------------------------------ queries
    def pages_for(self, n_tokens: int) -> int:
        """Pages that hold ``n_tokens`` tokens."""
        return -(-n_tokens // self.page_size)

    def available_pages(self) -> int:
        """Pages obtainable without touching referenced ones: free + cached."""
        return len(self._free) + len(self._lru)

    def free_pages(self) -> int:
        return len(self._free)

    def cached_pages(self) -> int:
        return len(self._lru)

    def referenced_pages(self) -> int:
        return self.num_pages - len(self._free) - len(self._lru)

    def lookup_prefix(self, page_hashes: Sequence[int]) -> int:
        """Number of leading pages of ``page_hashes`` present in the index (no side effect)."""
        found = list(map(self._index.__contains__, page_hashes))
        return found.index(False) if False in found else len(found)

    def has(self, task_id: Hashable) -> bool:
        return task_id in self._seqs

    def is_pinned(self, task_id: Hashable) -> bool:
        seq = self._seqs.get(task_id)
        return seq is not None and seq.pinned

    def tokens(self, task_id: Hashable) -> int:
        """Tokens held by the task's live sequence (0 if none)."""
        seq = self._seqs.get(task_id)
        return seq.n_tokens if seq is not None else 0

    def pages(self, task_id: Hashable) -> tuple[int, ...]:
        """Page ids of the task's live sequence, in token order (for the engine's page table)."""
        seq = self._seqs.get(task_id)
        return tuple(seq.pages) if seq is not None else ()

    def tasks(self) -> tuple[Hashable, ...]:
        return tuple(self._seqs)

    def pages_needed(self, task_id: Hashable, n_tokens: int, page_hashes: Sequence[int]) -> int:
        """New pages ``allocate(task_id, n_tokens, page_hashes)`` would take (pure query).

        Compare with :meth:`available_pages` for admission; it counts pages the call would
        reuse from the cache as needed only if they are not already held.
        """
        own = self._seqs.get(task_id)
        if own is not None and self._extends(own, n_tokens, page_hashes):
            return self.pages_for(n_tokens) - len(own.pages)
        return self.pages_for(n_tokens) - self.lookup_prefix(page_hashes)

    def admission_need(
        self, task_id: Hashable, n_tokens: int, page_hashes: Sequence[int], reserve: int = 0
    ) -> tuple[int, int]:
        """``(new pages, pages obtainable)`` for ``allocate(task_id, n_tokens, page_hashes,
        reserve)``, exactly (pure query): the call succeeds iff the first <= the second."""
        ps = self.page_size
        prompt_keys = page_hashes[: n_tokens // ps]
        own = self._seqs.get(task_id)
        total = self.pages_for(n_tokens + reserve)
        if own is not None and self._extends(own, n_tokens, prompt_keys):
            return total - len(own.pages), self.available_pages()
        matched = list(map(self._index.get, prompt_keys))
        if None in matched:
            del matched[matched.index(None) :]
        ref = self._ref
        avail = self.available_pages() - sum(1 for p in matched if ref[p] == 0)
        if own is not None:
            kept = set(matched)
            avail += sum(1 for p in own.pages if ref[p] == 1 and p not in kept)
        return total - len(matched), avail

    def usage(self) -> PoolUsage:
        """Token accounting (O(pages held); meant for metrics and checks, not hot loops)."""
        active: set[int] = set()
        for seq in self._seqs.values():
            if not seq.pinned:
                active.update(seq.pages)
        referenced = self.referenced_pages()
        ps = self.page_size
        return PoolUsage(
            total_tokens=self.num_pages * ps,
            used_tokens=len(active) * ps,
            pinned_tokens=(referenced - len(active)) * ps,
            cached_tokens=len(self._lru) * ps,
            free_tokens=len(self._free) * ps,
        )

    def counters(self) -> PoolCounters:
        return PoolCounters(self._prompt_tokens, self._hit_tokens, self._evicted, self._flushed)

    # ---------------------------------------------------------------- mutations
    def allocate(
        self, task_id: Hashable, n_tokens: int, page_hashes: Sequence[int], reserve: int = 0
    ) -> int:
        """Start a turn with an ``n_tokens`` prompt; returns prompt tokens served from cache.

        ``reserve`` more tokens (the turn's decode budget) are appended in the same call, all
        or nothing; ``page_hashes`` may then cover those pages too.
        """
        if n_tokens < 0 or reserve < 0:
            raise ValueError(f"n_tokens and reserve must be >= 0, got {n_tokens}, {reserve}")
        if len(page_hashes) > (n_tokens + reserve) // self.page_size:
            raise ValueError("page_hashes lists more pages than the tokens fill")
        prompt_keys = page_hashes[: n_tokens // self.page_size] if reserve else page_hashes
        own = self._seqs.get(task_id)
        if own is not None and self._extends(own, n_tokens, prompt_keys):
            cached = own.n_tokens
            self._grow(own, n_tokens + reserve - own.n_tokens, page_hashes)
            own.pinned = False
        else:
            cached = self._fresh(task_id, own, n_tokens, prompt_keys, reserve, page_hashes)
        self._prompt_tokens += n_tokens
        self._hit_tokens += cached
        return cached

    def extend(self, task_id: Hashable, n_tokens: int, page_hashes: Sequence[int] = ()) -> None:
        """Append ``n_tokens`` tokens to the task's live sequence; index newly full pages."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        seq = self._live(task_id)
        self._grow(seq, n_tokens, page_hashes)

    def truncate(self, task_id: Hashable, n_tokens: int) -> None:
        """Shorten the task's live sequence to its first ``n_tokens`` tokens; pages past
        them are released (a decoder that reserved ahead gives back what it did not use)."""
        seq = self._live(task_id)
        if not 0 <= n_tokens <= seq.n_tokens:
            raise ValueError(f"cannot truncate {seq.n_tokens} tokens to {n_tokens}")
        keep = self.pages_for(n_tokens)
        self._release(seq.pages[keep:])
        del seq.pages[keep:]
        del seq.hashes[n_tokens // self.page_size:]
        seq.n_tokens = n_tokens

    def pin(self, task_id: Hashable) -> None:
        """Keep the task's pages resident across its environment wait."""
        self._live(task_id).pinned = True

    def unpin(self, task_id: Hashable) -> None:
        """A pinned task's pages become cached (evictable, reusable); the sequence ends."""
        seq = self._live(task_id)
        if not seq.pinned:
            raise ValueError(f"task {task_id!r} is not pinned")
        self._drop(task_id, seq)

    def release(self, task_id: Hashable) -> None:
        """End the task's live sequence; its full indexed pages stay cached."""
        self._drop(task_id, self._live(task_id))

    def evict(self, task_id: Hashable) -> None:
        """Drop the task's sequence and free, now, its pages that nobody else references."""
        seq = self._live(task_id)
        pages = list(seq.pages)
        self._drop(task_id, seq)
        for page in pages:
            if self._ref[page] == 0 and page in self._lru:
                del self._lru[page]
                self._unindex(page)
                self._free.append(page)
                self._evicted += 1

    def flush(self) -> tuple[Hashable, ...]:
        """Invalidate everything (new weights): drop all sequences, free all cached pages."""
        dropped = tuple(self._seqs)
        for task_id in dropped:
            self._drop(task_id, self._seqs[task_id])
        self._flushed += len(self._lru)
        for page in self._lru:
            self._unindex(page)
            self._free.append(page)
        self._lru.clear()
        return dropped

    def check(self) -> None:
        """Assert every invariant in the module docstring (O(pages); for tests)."""
        held = [0] * self.num_pages
        for seq in self._seqs.values():
            if len(seq.pages) != self.pages_for(seq.n_tokens):
                raise AssertionError("sequence page count does not match its tokens")
            if len(set(seq.pages)) != len(seq.pages):
                raise AssertionError("sequence holds a page twice")
            for page in seq.pages:
                held[page] += 1
        if held != self._ref:
            raise AssertionError("refcounts differ from sequence holdings")
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("page freed twice")
        lru = set(self._lru)
        for page in range(self.num_pages):
            states = (page in free) + (page in lru) + (self._ref[page] > 0)
            if states != 1:
                raise AssertionError(f"page {page} is in {states} states")
            if page in lru and self._key[page] is None:
                raise AssertionError(f"cached page {page} has no key")
            if page in free and self._key[page] is not None:
                raise AssertionError(f"free page {page} still indexed")
        for key, page in self._index.items():
            if self._key[page] != key:
                raise AssertionError(f"index entry {key} points at page {page} with another key")
        if sum(k is not None for k in self._key) != len(self._index):
            raise AssertionError("a page carries a key that is not in the index")

    # ---------------------------------------------------------------- internals
    def _live(self, task_id: Hashable) -> _Seq:
        seq = self._seqs.get(task_id)
        if seq is None:
            raise KeyError(f"task {task_id!r} has no live sequence")
        return seq

    def _extends(self, seq: _Seq, n_tokens: int, page_hashes: Sequence[int]) -> bool:
        known = len(seq.hashes)
        if n_tokens < seq.n_tokens or len(page_hashes) < known:
            return False
        head = page_hashes[:known]
        return (head if type(head) is list else list(head)) == seq.hashes

    def _take(self, n: int) -> list[int]:
        """Hand out ``n`` pages, evicting cached pages (oldest first) when none are free."""
        free, ref = self._free, self._ref
        if n <= len(free):  # the common case: pop() n times, in one slice
            out = free[-n:] if n else []
            del free[len(free) - n :]
            out.reverse()
        else:
            out = []
            for _ in range(n):
                if free:
                    out.append(free.pop())
                else:
                    page, _ = self._lru.popitem(last=False)
                    self._unindex(page)
                    self._evicted += 1
                    out.append(page)
        for page in out:
            ref[page] = 1
        return out

    def _grow(self, seq: _Seq, n_tokens: int, page_hashes: Sequence[int]) -> None:
        total = seq.n_tokens + n_tokens
        need = -(-total // self.page_size) - len(seq.pages)
        if need > len(self._free) + len(self._lru):
            raise PoolFull(f"need {need} pages, {self.available_pages()} available")
        if need > 0:
            seq.pages.extend(self._take(need))
        seq.n_tokens = total
        self._index_pages(seq, page_hashes)

    def _index_pages(self, seq: _Seq, page_hashes: Sequence[int]) -> None:
        """Record keys for the sequence's full pages that gained one; index new ones."""
        upto = min(len(page_hashes), seq.n_tokens // self.page_size)
        if upto <= len(seq.hashes):
            return
        for i in range(len(seq.hashes), upto):
            key = page_hashes[i]
            seq.hashes.append(key)
            page = seq.pages[i]
            if self._key[page] is None and key not in self._index:
                self._key[page] = key
                self._index[key] = page

    def _fresh(
        self,
        task_id: Hashable,
        own: _Seq | None,
        n_tokens: int,
        page_hashes: Sequence[int],
        reserve: int = 0,
        all_hashes: Sequence[int] = (),
    ) -> int:
        matched = list(map(self._index.get, page_hashes))  # C-speed walk, cut at first miss
        if None in matched:
            del matched[matched.index(None) :]
        need = self.pages_for(n_tokens + reserve) - len(matched)
        if need > self.available_pages() - len(matched):  # exact count only when tight
            ref = self._ref
            avail = self.available_pages() - sum(1 for p in matched if ref[p] == 0)
            if own is not None:  # pages the old sequence frees by being dropped
                kept = set(matched)
                avail += sum(1 for p in own.pages if ref[p] == 1 and p not in kept)
            if need > avail:
                raise PoolFull(f"need {need} pages, {avail} available")
        ref, lru_pop = self._ref, self._lru.pop
        for page in matched:  # acquire first so that the allocation below cannot evict them
            if not ref[page]:
                lru_pop(page)
            ref[page] += 1
        if own is not None:
            self._drop(task_id, own)
        seq = _Seq()
        seq.pages = matched + self._take(need)
        seq.n_tokens = n_tokens + reserve
        seq.hashes = list(page_hashes[: len(matched)])
        self._seqs[task_id] = seq
        self._index_pages(seq, all_hashes if reserve else page_hashes)
        return len(matched) * self.page_size

    def _drop(self, task_id: Hashable, seq: _Seq) -> None:
        del self._seqs[task_id]
        self._release(seq.pages)

    def _release(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page no one holds goes to the free list, or to
        the LRU when its prefix is indexed. Tail pages go into the LRU first (older), so
        eviction shortens chains from the end and keeps their prefixes findable."""
        ref, key, free, lru = self._ref, self._key, self._free, self._lru
        for page in reversed(pages):
            ref[page] -= 1
            if not ref[page]:
                if key[page] is None:
                    free.append(page)
                else:
                    lru[page] = None

    def _unindex(self, page: int) -> None:
        key = self._key[page]
        if key is not None:
            del self._index[key]
            self._key[page] = None

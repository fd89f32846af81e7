"""serving.page_pool: hand-checked cases plus random operation sequences (hypothesis).

Invariants checked after every operation: no leak (free + cached + referenced = all pages),
no double free, refcounts equal holdings, a pinned or referenced page is never evicted.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tidejax.serving.page_pool import ROOT_HASH, PagePool, PoolFull, chain_hashes, hash_page

PS = 4


def toks(task, n, shared=0):
    """Deterministic token stream: ``shared`` prompt tokens common to a group, then own ones."""
    return [1000 + i for i in range(min(n, shared))] + [task * 10_000 + i for i in range(shared, n)]


def keys(task, n, shared=0):
    return chain_hashes(toks(task, n, shared), PS)


def test_chain_hashes_only_full_pages_and_chain():
    k = chain_hashes(list(range(10)), 4)
    assert len(k) == 2
    assert k[0] == hash_page(ROOT_HASH, (0, 1, 2, 3))
    assert k[1] == hash_page(k[0], (4, 5, 6, 7))
    assert chain_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != k[1]  # same page, other prefix


def test_allocate_reuses_cached_prefix_and_counts_hits():
    pool = PagePool(8, PS)
    assert pool.allocate("a", 10, keys(1, 10, shared=8)) == 0
    pool.release("a")  # 2 full pages cached, partial freed
    assert pool.cached_pages() == 2 and pool.free_pages() == 6
    assert pool.allocate("b", 9, keys(2, 9, shared=8)) == 8  # shared prompt pages hit
    c = pool.counters()
    assert (c.prompt_tokens, c.hit_tokens) == (19, 8)
    assert c.hit_rate == pytest.approx(8 / 19)
    pool.check()


def test_pinned_task_resumes_with_all_its_tokens():
    pool = PagePool(6, PS)
    pool.allocate("a", 6, keys(1, 6))
    pool.extend("a", 3, keys(1, 9))
    pool.pin("a")
    assert pool.usage().pinned_tokens == 3 * PS
    assert pool.allocate("a", 12, keys(1, 12)) == 9  # partial page kept too
    assert pool.usage().used_tokens == 3 * PS
    pool.check()


def test_truncate_gives_back_reserved_tail_pages_only():
    """A decoder reserved ahead (3 pages) but only 5 tokens have K/V: the tail page goes
    back to the free list; a shared indexed page stays referenced by the other task."""
    pool = PagePool(8, PS)
    pool.allocate("a", 2 * PS, keys(1, 2 * PS))
    pool.release("a")  # two indexed full pages, cached
    pool.allocate("b", 2 * PS + 1, keys(1, 2 * PS + 1), reserve=PS)  # 3 pages + reserve
    assert len(pool.pages("b")) == 4
    free_before = pool.free_pages()
    pool.truncate("b", 2 * PS + 2)
    assert len(pool.pages("b")) == 3 and pool.tokens("b") == 2 * PS + 2
    assert pool.free_pages() == free_before + 1
    pool.truncate("b", PS)  # back into the shared, indexed pages: the 2nd goes to the LRU
    assert len(pool.pages("b")) == 1 and pool.cached_pages() == 1
    with pytest.raises(ValueError):
        pool.truncate("b", PS + 1)
    pool.check()


def test_lru_evicts_oldest_unreferenced_and_never_pinned():
    pool = PagePool(4, PS)
    pool.allocate("a", 8, keys(1, 8))
    pool.pin("a")
    pool.allocate("b", 8, keys(2, 8))
    pool.release("b")
    with pytest.raises(PoolFull):
        pool.allocate("c", 12, keys(3, 12))  # would need a pinned page
    pool.check()
    pool.allocate("c", 8, keys(3, 8))  # evicts b's cached pages
    assert pool.counters().evicted_pages == 2
    assert pool.lookup_prefix(keys(1, 8)) == 2
    assert pool.lookup_prefix(keys(2, 8)) == 0
    pool.check()


def test_eviction_keeps_prefixes_findable():
    pool = PagePool(4, PS)
    pool.allocate("a", 12, keys(1, 12))
    pool.release("a")
    pool.allocate("b", 4, keys(2, 4))  # one page needed: 1 free, none evicted
    pool.allocate("c", 4, keys(3, 4))  # evicts the tail page of a's chain first
    assert pool.lookup_prefix(keys(1, 12)) == 2
    pool.check()


def test_evict_frees_now_but_keeps_shared_pages():
    pool = PagePool(8, PS)
    pool.allocate("a", 8, keys(1, 8, shared=8))
    pool.allocate("b", 8, keys(2, 8, shared=8))  # shares both pages
    pool.evict("a")
    assert pool.referenced_pages() == 2 and pool.free_pages() == 6
    pool.evict("b")
    assert pool.free_pages() == 8 and pool.lookup_prefix(keys(1, 8, shared=8)) == 0
    pool.check()


def test_pool_full_changes_nothing():
    pool = PagePool(3, PS)
    pool.allocate("a", 8, keys(1, 8))
    before = (pool.usage(), pool.counters())
    with pytest.raises(PoolFull):
        pool.extend("a", 8, keys(1, 16))
    with pytest.raises(PoolFull):
        pool.allocate("b", 9, keys(2, 9))
    assert (pool.usage(), pool.counters()) == before
    pool.check()


def test_flush_drops_everything():
    pool = PagePool(6, PS)
    pool.allocate("a", 8, keys(1, 8))
    pool.pin("a")
    pool.allocate("b", 5, keys(2, 5))
    pool.release("b")
    assert set(pool.flush()) == {"a"}
    assert pool.free_pages() == 6 and not pool.has("a")
    pool.check()


def test_unpin_requires_pinned_and_validation():
    pool = PagePool(4, PS)
    pool.allocate("a", 4, keys(1, 4))
    with pytest.raises(ValueError):
        pool.unpin("a")
    with pytest.raises(KeyError):
        pool.release("zzz")
    with pytest.raises(ValueError):
        pool.allocate("b", 3, keys(2, 8))  # more keys than full pages
    with pytest.raises(ValueError):
        PagePool(0, PS)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/extend/pin/unpin/release/evict/flush sequences on a small pool."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(12, PS)
        self.length: dict[int, int] = {}  # live tasks -> tokens

    @rule(task=st.integers(0, 5), n=st.integers(0, 20), shared=st.sampled_from([0, 4, 8]))
    def allocate(self, task, n, shared):
        old = self.length.get(task, 0)
        n = max(n, old)  # a live task's new prompt extends its tokens
        try:
            cached = self.pool.allocate(task, n, keys(task, n, shared if old == 0 else 0))
        except PoolFull:
            return
        assert 0 <= cached <= n
        self.length[task] = n

    @precondition(lambda self: self.length)
    @rule(data=st.data(), n=st.integers(0, 9))
    def extend(self, data, n):
        task = data.draw(st.sampled_from(sorted(self.length)))
        total = self.length[task] + n
        try:
            self.pool.extend(task, n, keys(task, total))
        except PoolFull:
            return
        self.length[task] = total

    @precondition(lambda self: self.length)
    @rule(data=st.data(), op=st.sampled_from(["pin", "unpin", "release", "evict"]))
    def lifecycle(self, data, op):
        task = data.draw(st.sampled_from(sorted(self.length)))
        pages = set(self.pool.pages(task))
        if op == "pin":
            self.pool.pin(task)
            return
        if op == "unpin":
            if not self.pool.is_pinned(task):
                return
            self.pool.unpin(task)
        else:
            getattr(self.pool, op)(task)
        del self.length[task]
        if op == "evict":  # freed now unless another live task shares the page
            shared = {p for t in self.length for p in self.pool.pages(t)}
            assert not (pages - shared) & set(self.pool._lru)

    @rule()
    def flush(self):
        self.pool.flush()
        self.length.clear()

    @invariant()
    def consistent(self):
        self.pool.check()
        u = self.pool.usage()
        held = {p for t in self.length for p in self.pool.pages(t)}
        assert u.used_tokens + u.pinned_tokens == len(held) * PS
        for t, n in self.length.items():
            assert self.pool.tokens(t) == n
        # nothing referenced is ever cached (evictable)
        assert not held & set(self.pool._lru)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=80,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 16)), min_size=1, max_size=30))
def test_request_level_turns_never_leak(turns):
    """Multi-turn tasks served request by request: hits never exceed what was cached."""
    pool = PagePool(10, PS)
    length = {}
    for task, grow in turns:
        n = length.get(task, 0) + grow
        try:
            pool.allocate(task, n, keys(task, n))
        except PoolFull:
            continue
        pool.release(task)
        length[task] = n
        pool.check()
    c = pool.counters()
    assert 0 <= c.hit_tokens <= c.prompt_tokens
    assert pool.referenced_pages() == 0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.integers(1, 14), st.integers(0, 6)), min_size=1, max_size=25
    )
)
def test_admission_need_predicts_allocate(ops):
    """admission_need says exactly whether allocate(..., reserve) succeeds."""
    pool = PagePool(9, PS)
    length = {}
    for task, grow, reserve in ops:
        n = length.get(task, 0) + grow
        k = keys(task, n + reserve, shared=4)
        need, avail = pool.admission_need(task, n, k, reserve)
        try:
            pool.allocate(task, n, k, reserve=reserve)
            ok = True
        except PoolFull:
            ok = False
        assert ok == (need <= avail)
        if ok:
            length[task] = n + reserve
            if grow % 2:
                pool.release(task)
                del length[task]
            else:
                pool.pin(task)
        pool.check()

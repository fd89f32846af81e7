"""The engine-level pool (`KVPool`) under random turn / pin / unpin / evict / free sequences.

A shadow "device" records which token each page slot holds, written exactly where the
engine would write K/V. After every step: no page leaks or is handed out twice (the pool's
own invariants), every live task's pages still hold its tokens (so a pinned task was never
evicted and no page was overwritten by another sequence), and every prefix-cache hit
served exactly the prompt's tokens.
"""

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tidejax.serving.kv_pool import KVPool
from tidejax.serving.page_pool import PoolFull

PAGE, PAGES, MAX_PAGES = 4, 12, 8
MAX_LEN = PAGE * MAX_PAGES
TASKS = ("a", "b", "c", "d")
PREFIXES = ((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9), ())  # shared pages across tasks


class KVPoolMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.pool = KVPool(PAGES, PAGE, MAX_PAGES)
        self.shadow = {}  # (page, offset) -> token whose K/V the engine wrote there
        self.kv_tokens = {}  # task -> tokens with K/V (live tasks)
        self.pending = {}  # in-turn task -> last sampled token (no K/V yet)

    def _write(self, task, position, token):
        row = self.pool.page_row(task)
        self.shadow[(int(row[position // PAGE]), position % PAGE)] = token

    def _holds(self, task, tokens):
        row = self.pool.page_row(task)
        return all(self.shadow.get((int(row[p // PAGE]), p % PAGE)) == t
                   for p, t in enumerate(tokens))

    @rule(task=st.sampled_from(TASKS), prefix=st.sampled_from(PREFIXES),
          suffix=st.lists(st.integers(0, 10**6), min_size=1, max_size=10),
          resume=st.booleans(), first=st.integers(0, 10**6))
    def begin_turn(self, task, prefix, suffix, resume, first):
        if task in self.pending:
            return
        if resume and task in self.kv_tokens:
            prompt = list(self.kv_tokens[task]) + [first] + suffix  # next turn: history + obs
        else:
            prompt = list(prefix) + suffix
        if len(prompt) + 2 > MAX_LEN:
            return
        try:
            plan = self.pool.begin_turn(task, prompt)
        except PoolFull:
            self.kv_tokens = {t: v for t, v in self.kv_tokens.items() if self.pool.has(t)}
            return
        # Reused K/V must be exactly this prompt's tokens.
        assert self._holds(task, prompt[: plan.start])
        if plan.write:
            for p in range(plan.start, len(prompt)):
                self._write(task, p, prompt[p])
        assert self._holds(task, prompt)
        self.kv_tokens = {t: v for t, v in self.kv_tokens.items() if self.pool.has(t)}
        self.kv_tokens[task] = prompt
        self.pending[task] = first

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), written=st.booleans(), token=st.integers(0, 10**6))
    def decode(self, data, written, token):
        """A generate step: reserve one token; the device writes it unless the slot is done."""
        task = data.draw(st.sampled_from(sorted(self.pending)))
        tokens = self.kv_tokens[task]
        if self.pool.pages.tokens(task) + 1 >= MAX_LEN:
            return
        try:
            self.pool.grow(task, 1)
        except PoolFull:
            return
        if written and self.pool.pages.tokens(task) == len(tokens) + 1:
            self._write(task, len(tokens), self.pending[task])
            self.kv_tokens[task] = tokens + [self.pending[task]]
            self.pending[task] = token

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), keep=st.sampled_from([True, False, None]))
    def end_turn(self, data, keep):
        task = data.draw(st.sampled_from(sorted(self.pending)))
        tokens = self.kv_tokens[task] + [self.pending.pop(task)]
        kept = self.pool.end_turn(task, tokens, keep)
        if not kept:
            del self.kv_tokens[task]

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def pin_mid_turn(self, data):
        self.pool.pin(data.draw(st.sampled_from(sorted(self.pending))))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def abort(self, data):
        task = data.draw(st.sampled_from(sorted(self.pending)))
        del self.pending[task]
        del self.kv_tokens[task]
        self.pool.abort_turn(task)

    def _resting(self):
        return sorted(t for t in self.kv_tokens if t not in self.pending)

    @precondition(lambda self: self._resting())
    @rule(data=st.data(), action=st.sampled_from(["unpin", "evict"]))
    def release_resting(self, data, action):
        task = data.draw(st.sampled_from(self._resting()))
        assert self.pool.is_pinned(task)
        getattr(self.pool, action)(task)
        del self.kv_tokens[task]

    @precondition(lambda self: not self.pending)
    @rule()
    def flush(self):
        self.pool.flush()
        self.kv_tokens.clear()
        assert self.pool.usage().free_tokens == PAGES * PAGE

    @invariant()
    def consistent(self):
        self.pool.check()
        assert set(self.kv_tokens) == set(self.pool.tasks())
        for task, tokens in self.kv_tokens.items():
            assert self._holds(task, tokens), f"pages of {task!r} were overwritten or evicted"
        usage = self.pool.usage()
        pinned = {t for t in self.kv_tokens if t not in self.pending}
        assert all(self.pool.is_pinned(t) for t in pinned)
        if not self.kv_tokens:
            assert usage.used_tokens == usage.pinned_tokens == 0

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for task in list(self.pending):  # nothing leaks once every task is gone
            self.pool.end_turn(task, self.kv_tokens[task] + [self.pending.pop(task)], False)
        for task in list(self.pool.tasks()):
            self.pool.evict(task)
        usage = self.pool.usage()
        assert usage.used_tokens == usage.pinned_tokens == 0
        assert usage.free_tokens + usage.cached_tokens == PAGES * PAGE
        self.pool.flush()
        assert self.pool.pages.free_pages() == PAGES


KVPoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_kv_pool_never_leaks_double_frees_or_evicts_pinned = KVPoolMachine.TestCase


def test_late_free_resumes_from_the_last_written_token():
    """A caller that frees a slot a step late reserved a token that was never written."""
    pool = KVPool(PAGES, PAGE, MAX_PAGES)
    pool.begin_turn("a", [1, 2, 3, 4, 5])
    pool.grow("a")  # K/V of the first sampled token (6) at position 5
    pool.grow("a")  # the slot was already done: position 6 reserved, never written
    assert pool.end_turn("a", [1, 2, 3, 4, 5, 6, 7], keep=True)
    plan = pool.begin_turn("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert plan.start == 6 and plan.write  # 7 is recomputed, not trusted
    pool.check()


def test_whole_prompt_hit_recomputes_last_token_without_writing():
    pool = KVPool(PAGES, PAGE, MAX_PAGES)
    pool.begin_turn("a", list(range(8)))
    pool.end_turn("a", list(range(8)), keep=False)
    plan = pool.begin_turn("b", list(range(8)))
    assert (plan.start, plan.write, plan.cached_tokens) == (7, False, 7)
    pool.check()


def test_pinned_partial_page_is_not_reused_by_a_diverging_prompt():
    pool = KVPool(PAGES, PAGE, MAX_PAGES)
    pool.begin_turn("a", [1, 2, 3, 4, 5, 6])
    pool.end_turn("a", [1, 2, 3, 4, 5, 6, 7], keep=True)
    plan = pool.begin_turn("a", [1, 2, 3, 4, 5, 9, 9])  # differs inside the second page
    assert plan.start == 4  # only the full first page is reused
    pool.check()

"""Mock engine outputs by hand; the request-level loop: admission, preemption, pinning, C1."""

import numpy as np
import pytest
from tidejax.serving import (
    EngineConfig,
    MockEngine,
    OutOfPages,
    Request,
    RequestLevelPolicy,
    RequestLoop,
    SamplingParams,
)

CONFIG = EngineConfig(page_size=4, num_pages=16, max_slots=2, max_pages_per_seq=8,
                      prefill_buckets=(8, 16), prefill_row_tokens=8,
                      sampling=SamplingParams.greedy())


def test_mock_engine_api_by_hand():
    engine = MockEngine(CONFIG, vocab_size=10, logprob=-0.25)
    state = engine.init_decode_state()
    prefix = engine.prefill(None, [3, 4, 5, 6, 7], "t", SamplingParams(max_new_tokens=4))
    first = prefix.first.to_host()
    assert first.tokens[0] == 8 and first.positions[0] == 5 and not first.done[0]
    state = engine.insert(prefix, state, slot=1)
    got = []
    for _ in range(3):
        state, result = engine.generate(None, state, num_steps=1)
        host = result.to_host()  # [1 step, 2 slots]
        assert not host.valid[0, 0]  # slot 0 is empty
        got.append((int(host.tokens[0, 1]), float(host.logprobs[0, 1]), bool(host.done[0, 1])))
    # 8 -> 9 -> 0 (mod 10) -> 1; the 4th token overall reaches max_new_tokens.
    assert got == [(9, -0.25, False), (0, -0.25, False), (1, -0.25, True)]
    state = engine.free_slot(state, 1, [3, 4, 5, 6, 7, 8, 9, 0, 1])
    # Tokens with K/V: 5 prompt + 3 fed back = 8 = two full pages, now cached.
    usage = engine.accounting()
    assert usage.cached_tokens == 8 and usage.used_tokens == 0
    engine.pool.check()


def test_loop_completions_stop_tokens_and_first_token_done():
    engine = MockEngine(CONFIG)
    loop = RequestLoop(engine)
    loop.submit(Request("a", "t1", [1, 2, 3, 7], 3))
    loop.submit(Request("b", "t2", [5, 6], 9, SamplingParams(stop_token_ids=(9,))))
    loop.submit(Request("c", None, [20], 1))
    done = {c.request_id: c for c in loop.run()}
    assert done["a"].token_ids == (8, 9, 10) and done["a"].finish_reason == "length"
    assert done["b"].token_ids == (7, 8, 9) and done["b"].finish_reason == "stop"
    assert done["c"].token_ids == (21,)
    assert all(lp == -0.5 for c in done.values() for lp in c.logprobs)
    assert engine.accounting().used_tokens == 0
    engine.pool.check()


def test_out_of_pages_preempts_newest_and_recomputes():
    config = CONFIG.replace(num_pages=6, max_pages_per_seq=6)  # 24 tokens in all
    engine = MockEngine(config)
    loop = RequestLoop(engine, policy=RequestLevelPolicy(watermark_pages=0))
    loop.submit(Request("old", None, list(range(8)), 12))
    loop.submit(Request("new", None, list(range(100, 108)), 12))
    done = {c.request_id: c for c in loop.run()}
    assert loop.metrics().preemptions >= 1
    assert done["new"].preemptions >= 1 and done["old"].preemptions == 0
    assert done["old"].token_ids == tuple(range(8, 20))
    assert done["new"].token_ids == tuple(range(108, 120))  # recomputed, same result
    engine.pool.check()


def test_generate_raises_out_of_pages_without_dispatching():
    config = CONFIG.replace(num_pages=3, max_pages_per_seq=3, prefill_buckets=(8,))
    engine = MockEngine(config)
    state = engine.init_decode_state()
    # Both prompts fill their pages and the pool: each slot's next token needs a page.
    for slot, (task, prompt) in enumerate((("t", range(8)), ("u", range(100, 104)))):
        state = engine.insert(engine.prefill(None, list(prompt), task,
                                             SamplingParams(max_new_tokens=5)), state, slot)
    with pytest.raises(OutOfPages) as err:
        engine.generate(None, state)
    assert err.value.slots == (0, 1) and engine.metrics().decode_steps == 0


def run_multi_turn(pin: bool):
    """Task A pauses for its env while B..E fill the pool; then A resumes."""
    engine = MockEngine(CONFIG.replace(num_pages=12))
    loop = RequestLoop(engine, policy=RequestLevelPolicy(watermark_pages=0))
    prompt = list(range(10))
    loop.submit(Request("a1", "A", prompt, 4))
    if pin:
        loop.pin("A")
    (turn1,) = list(loop.run())
    pinned_tokens = engine.accounting().pinned_tokens
    rng = np.random.default_rng(0)
    for i in range(4):  # other requests arrive during A's env wait
        loop.submit(Request(f"x{i}", f"X{i}", rng.integers(100, 500, 12).tolist(), 4))
    list(loop.run())
    loop.submit(Request("a2", "A", prompt + list(turn1.token_ids) + [77, 78], 3))
    (turn2,) = list(loop.run())
    engine.pool.check()
    return turn2, pinned_tokens, engine


def test_request_level_release_loses_a_paused_task_cache_pinning_keeps_it():
    lost, _, engine = run_multi_turn(pin=False)
    assert lost.cached_tokens == 0  # C1: evicted by the requests served during the wait
    assert engine.metrics().evicted_pages > 0
    kept, pinned_tokens, engine = run_multi_turn(pin=True)
    assert pinned_tokens == 16  # 13 tokens with K/V -> 4 pages
    assert kept.cached_tokens == 10 + 4 - 1  # all but the last sampled token of turn 1
    assert engine.accounting().pinned_tokens == 0


def test_unpin_and_evict_move_tokens_between_accounting_buckets():
    engine = MockEngine(CONFIG)
    loop = RequestLoop(engine)
    for task, start in (("p", 0), ("q", 50)):
        loop.submit(Request(task, task, list(range(start, start + 9)), 3))
        loop.pin(task)
    list(loop.run())
    usage = engine.accounting()
    assert usage.pinned_tokens == 2 * 12 and usage.used_tokens == 0  # 11 tokens: 3 pages
    assert set(engine.pinned_tasks()) == {"p", "q"}
    engine.unpin("p")  # evictable: its 2 full (indexed) pages stay cached, the partial is freed
    engine.evict("q")  # freed now
    usage = engine.accounting()
    assert usage.pinned_tokens == 0 and usage.cached_tokens == 8
    assert usage.free_tokens == usage.total_tokens - 8
    with pytest.raises(KeyError):
        engine.unpin("p")
    engine.pool.check()


class ResumeFirst(RequestLevelPolicy):
    """A task-level policy through the hooks: resumed turns jump the queue, A stays pinned."""

    def __init__(self):
        super().__init__(watermark_pages=0)
        self.pins = []

    def admission_order(self, waiting, view):
        return sorted(waiting, key=lambda r: r.task_id != "A")

    def keep_pinned(self, completion, view):
        self.pins.append(completion.task_id)
        return completion.task_id == "A"


def test_policy_hooks_decide_admission_order_and_pause():
    policy = ResumeFirst()
    engine = MockEngine(CONFIG.replace(max_slots=1))
    loop = RequestLoop(engine, policy=policy)
    loop.submit(Request("a1", "A", list(range(6)), 2))
    list(loop.run())
    assert engine.pinned_tasks() == ("A",) and loop.view().pinned_tasks == {"A": 7}
    loop.submit(Request("x", "X", [50, 51], 2))
    loop.submit(Request("a2", "A", [*range(6), 6, 7, 99], 2))
    order = [c.request_id for c in loop.run()]
    assert order == ["a2", "x"] and policy.pins == ["A", "A", "X"]
    engine.pool.check()


def test_loop_reports_a_stall_when_pinned_pages_block_admission():
    engine = MockEngine(CONFIG.replace(num_pages=4, max_pages_per_seq=4, prefill_buckets=(8,)))
    loop = RequestLoop(engine, policy=RequestLevelPolicy(watermark_pages=0))
    loop.submit(Request("a", "A", list(range(10)), 2))
    loop.pin("A")
    list(loop.run())  # A holds 3 of the 4 pages, pinned
    loop.submit(Request("b", "B", list(range(100, 110)), 2))
    with pytest.raises(RuntimeError, match="cannot be admitted"):
        list(loop.run())
    loop.unpin("A")
    (done,) = list(loop.run())
    assert done.request_id == "b"


def test_results_are_read_one_dispatch_late_and_dispatches_stop_when_not_needed():
    """Step 1 dispatches and reads nothing; step 2 dispatches and reads step 1; step 3
    needs no dispatch (max new tokens reached by those made) and reads step 2."""
    engine = MockEngine(CONFIG.replace(decode_steps_per_call=1))
    loop = RequestLoop(engine)
    loop.submit(Request("a", "t", [1, 2, 3], 3))
    per_step = [[c.token_ids for c in loop.step()] for _ in range(3)]
    assert per_step == [[], [], [(4, 5, 6)]]
    assert engine.metrics().decode_steps == 2 and loop.idle


def test_multi_token_dispatch_stops_each_slot_and_returns_unused_pages():
    """Eight tokens per dispatch: a slot hitting a stop id mid-call stops there while the
    other decodes on; pinning keeps only the pages of tokens with K/V."""
    engine = MockEngine(CONFIG.replace(decode_steps_per_call=8, num_pages=32))
    loop = RequestLoop(engine)
    loop.pin("A")
    loop.submit(Request("a", "A", [1, 2, 3], 20, SamplingParams(stop_token_ids=(6,))))
    loop.submit(Request("b", "B", [40, 41], 20))
    done = {c.request_id: c for c in loop.run()}
    assert done["a"].token_ids == (4, 5, 6) and done["a"].finish_reason == "stop"
    assert done["b"].token_ids == tuple(range(42, 62))
    # A holds 3 prompt + 2 fed-back tokens with K/V: 2 pages of 4, not the 3 it reserved.
    assert engine.accounting().pinned_tokens == 8
    assert engine.pool.pages.tokens("A") == 5
    engine.pool.check()


def test_admission_prefills_at_most_the_token_budget_between_decode_dispatches():
    """Eight 10-token prompts and a 25-token budget: each step admits requests until their
    new tokens reach 25 (three per step), so the running slots decode between admissions
    instead of waiting for all eight prefills; every request still completes."""
    config = CONFIG.replace(max_slots=8, num_pages=64, prefill_tokens_per_step=25)
    engine = MockEngine(config)
    loop = RequestLoop(engine)
    for i in range(8):
        loop.submit(Request(i, f"t{i}", [10 * i + j for j in range(10)], 12))
    running = []
    for _ in range(3):
        loop.step()
        running.append(8 - len(engine.free_slots()))
    assert running == [3, 6, 8]
    done = {c.request_id: c for c in loop.run()}
    assert sorted(done) == list(range(8)) and all(len(c.token_ids) == 12 for c in done.values())
    engine.pool.check()


def test_prefill_token_budget_is_validated():
    with pytest.raises(ValueError, match="prefill_tokens_per_step"):
        CONFIG.replace(prefill_tokens_per_step=0)

"""A rollout rank fails on engine errors and waits (without spinning) when its KV pool is full."""

import threading
import time

from tidejax.serving import EngineConfig, MockEngine, Request

from tidejax.runtime.rollout import RankFailed, RolloutWorker, TurnResult

# Quarantine and re-homing after an engine error: tests/runtime/test_manager.py.

# 8 pages of 4 tokens; a sequence may use all of them (max_seq_len 32).
SMALL_POOL = EngineConfig(page_size=4, num_pages=8, max_slots=2, max_pages_per_seq=8,
                          prefill_buckets=(16, 32))


class OnceBrokenEngine(MockEngine):
    """Its first decode step raises as a failing device would; later ones work."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.broke = False

    def generate(self, params, decode_state, num_steps=None):
        if not self.broke:
            self.broke = True
            raise RuntimeError("device error")
        return super().generate(params, decode_state, num_steps)


class Answer:
    """An `on_done` callback that can be waited for."""

    def __init__(self):
        self.value = None
        self.event = threading.Event()

    def __call__(self, value):
        self.value = value
        self.event.set()

    def wait(self, timeout=10.0):
        assert self.event.wait(timeout), "no answer: the request was never served"
        return self.value


def request(name, prompt_len, first_token=1, max_new=4):
    prompt = tuple(range(first_token, first_token + prompt_len))
    return Request(request_id=name, task_id=name, prompt_token_ids=prompt, max_new_tokens=max_new)


def count_steps(worker):
    calls = []
    step = worker.loop.step

    def counted():
        calls.append(time.perf_counter())
        return step()

    worker.loop.step = counted
    return calls


def test_an_engine_error_fails_the_rank_instead_of_being_retried():
    worker = RolloutWorker(0, OnceBrokenEngine(SMALL_POOL), pin_after_turn=True)
    answer = Answer()
    worker.submit(request("a", 8), answer)
    result = answer.wait()
    assert isinstance(result, RankFailed) and result.rank == 0
    assert isinstance(result.cause, RuntimeError) and str(result.cause) == "device error"
    assert not worker.alive and worker.stats.emergency_releases == 0
    late = Answer()
    worker.submit(request("b", 8), late)  # a dead rank answers new work at once
    assert isinstance(late.wait(), RankFailed)
    worker.stop()


def test_a_prompt_past_max_seq_len_fails_alone_and_the_rank_serves_on():
    worker = RolloutWorker(0, MockEngine(SMALL_POOL), pin_after_turn=True)
    too_long, fine = Answer(), Answer()
    worker.submit(request("long", 32), too_long)  # max_seq_len is 32
    worker.submit(request("ok", 8), fine)
    assert isinstance(too_long.wait(), ValueError) and "max_seq_len" in str(too_long.value)
    assert isinstance(fine.wait(), TurnResult)
    assert worker.alive
    worker.stop()


def test_pinned_pages_that_block_a_turn_are_released_and_the_turn_served():
    worker = RolloutWorker(0, MockEngine(SMALL_POOL), pin_after_turn=True)
    first = Answer()
    worker.submit(request("a", 20), first)
    assert isinstance(first.wait(), TurnResult)
    # a's 6 pinned pages leave 2: b's 3 prompt pages (shared with nothing) and the 1-page
    # watermark do not fit.
    assert worker.usage().pinned_tokens == 24
    second = Answer()
    worker.submit(request("b", 12, first_token=100), second)
    result = second.wait()
    assert isinstance(result, TurnResult) and result.completion.token_ids == (112, 113, 114, 115)
    assert worker.stats.emergency_releases == 1 and worker.alive
    assert worker.engine.pinned_tasks() == ("b",)  # a's pages went to the evictable cache
    worker.stop()


def test_a_turn_that_can_never_fit_waits_for_a_command_without_spinning():
    worker = RolloutWorker(0, MockEngine(SMALL_POOL), pin_after_turn=True)
    steps = count_steps(worker)
    # 30 tokens take all 8 pages, and the watermark wants one more: never admitted.
    worker.submit(request("huge", 30), Answer())
    time.sleep(0.5)
    assert 1 <= len(steps) <= 2, f"{len(steps)} steps in 0.5 s while nothing could change"
    before = len(steps)
    worker.unpin("someone")  # any command may have freed pages: the loop tries once more
    deadline = time.monotonic() + 5
    while len(steps) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(steps) == before + 1
    assert worker.alive
    worker.stop()

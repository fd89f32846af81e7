"""Global buffer: staleness enforcement, readiness signals, blocking take."""

import threading

import pytest

from tidejax.runtime.buffer import GlobalBuffer, ReadyGroup
from tidejax.sched.staleness import batch_countable


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def group(gid, version, tokens=100, generated=40):
    return ReadyGroup(gid, payload=None, generated_tokens=generated, total_tokens=tokens,
                      min_version=version)


def test_stale_groups_are_dropped_and_counted():
    buf = GlobalBuffer(staleness_bound=1, micro_batch_tokens=100)
    buf.put(group("g0", version=0))
    buf.put(group("g1", version=1))
    buf.put(group("g2", version=2))
    # Trainer at version 2: g0 is 2 versions behind (> bound 1) and must never be trained on.
    taken = buf.take(10, trainer_version=2)
    assert [g.group_id for g in taken] == ["g1", "g2"]
    assert [(d.group_id, d.reason, d.generated_tokens) for d in buf.dropped] == [("g0", "stale", 40)]


def test_readiness_signals():
    clock = FakeClock()
    buf = GlobalBuffer(staleness_bound=4, micro_batch_tokens=100, clock=clock)
    buf.put(group("a", 0, tokens=250))
    clock.t = 10.0
    buf.begin_step()  # step 1 starts with 250 tokens ready = 2.5 micro-batches
    s = buf.signals()
    assert s.ras_micro_batches == pytest.approx(2.5)
    assert s.hol_latency_s == pytest.approx(10.0)
    buf.take(1, trainer_version=0)
    for i in range(4):  # 4 micro-batches arrive over the next 8 s
        clock.t += 2.0
        buf.put(group(f"b{i}", 0, tokens=100))
    buf.begin_step()
    s = buf.signals()
    assert s.tprm_s == pytest.approx(2.0)  # 8 s / 4 micro-batches
    assert s.ras_micro_batches == pytest.approx(4.0)
    assert s.hol_latency_s == pytest.approx(6.0)  # oldest put at t=12, now t=18


def test_wait_for_blocks_until_enough_groups():
    buf = GlobalBuffer(staleness_bound=1, micro_batch_tokens=10)
    got = []
    t = threading.Thread(target=lambda: got.append(buf.wait_for(2, 0, timeout=5)))
    t.start()
    buf.put(group("x", 0))
    buf.put(group("y", 0))
    t.join(timeout=5)
    assert got == [2]
    assert buf.wait_for(5, 0, timeout=0.01) == 2  # times out with what is there


def test_bad_config_names_field():
    with pytest.raises(ValueError, match="staleness_bound"):
        GlobalBuffer(staleness_bound=-1, micro_batch_tokens=10)
    with pytest.raises(ValueError, match="consume_order"):
        GlobalBuffer(staleness_bound=1, micro_batch_tokens=10, consume_order="fastest")


def test_admission_order_waits_for_the_oldest_admitted_group():
    """A slow group admitted first is not passed over by faster ones admitted after it."""
    buf = GlobalBuffer(staleness_bound=1, micro_batch_tokens=100, consume_order="admission")
    for gid in ("slow", "fast1", "fast2"):
        buf.admit(gid, 0)
    buf.put(group("fast1", 0))
    buf.put(group("fast2", 0))
    assert buf.wait_for(1, trainer_version=0, timeout=0) == 0  # the head is still running
    assert buf.take(2, trainer_version=0) == []
    buf.put(group("slow", 0))
    assert buf.wait_for(3, trainer_version=0, timeout=0) == 3
    assert [g.group_id for g in buf.take(2, trainer_version=0)] == ["slow", "fast1"]
    assert [g.group_id for g in buf.take(2, trainer_version=0)] == ["fast2"]
    assert len(buf) == 0


def test_completion_order_takes_the_fastest():
    buf = GlobalBuffer(staleness_bound=1, micro_batch_tokens=100, consume_order="completion")
    for gid in ("slow", "fast1", "fast2"):
        buf.admit(gid, 0)
    buf.put(group("fast1", 0))
    buf.put(group("fast2", 0))
    assert [g.group_id for g in buf.take(2, trainer_version=0)] == ["fast1", "fast2"]


def test_a_dropped_head_unblocks_the_admission_order():
    """A group that fails, or goes stale, leaves the order: the trainer does not wait on it."""
    buf = GlobalBuffer(staleness_bound=1, micro_batch_tokens=100, consume_order="admission")
    for gid in ("failed", "ok", "late"):
        buf.admit(gid, 0)
    buf.put(group("ok", 1))
    got = []
    waiter = threading.Thread(target=lambda: got.append(buf.wait_for(1, 1, timeout=5)))
    waiter.start()
    buf.drop("failed", "task_failed:env_exception", 10)
    waiter.join(timeout=5)
    assert got == [1]
    assert [g.group_id for g in buf.take(5, trainer_version=1)] == ["ok"]
    buf.put(group("late", 0))  # two versions behind at trainer version 2: stale, not taken
    assert buf.take(5, trainer_version=2) == []
    assert buf.take_new_stale_drops() == 1


def test_deadline_order_takes_the_fastest_but_waits_for_groups_that_would_go_stale():
    """Bound 1, trainer at version 1: a group admitted at version 0 and still running would
    be stale at the next update, so the batch keeps it a place; one admitted at 1 would not."""
    buf = GlobalBuffer(staleness_bound=1, micro_batch_tokens=100, consume_order="deadline")
    buf.admit("due_slow", 0)
    buf.admit("slow", 1)
    for gid in ("fast1", "fast2", "fast3"):
        buf.admit(gid, 1)
        buf.put(group(gid, 1))
    assert buf.batch_digest(1) == {"ready": 3, "due_ready": 0, "due_in_flight": 1}
    assert buf.wait_for(3, trainer_version=1, timeout=0) == 2  # a place kept for due_slow
    buf.put(group("due_slow", 0))
    assert buf.batch_digest(1) == {"ready": 4, "due_ready": 1, "due_in_flight": 0}
    assert buf.wait_for(3, trainer_version=1, timeout=0) == 4  # "slow" is not waited for
    taken = [g.group_id for g in buf.take(3, trainer_version=1)]
    assert taken == ["due_slow", "fast1", "fast2"]  # oldest version first, then fastest
    assert buf.dropped == []


def test_deadline_order_counts_due_ready_groups_even_past_the_places():
    """More due groups than one batch: the due ones ready still count (the rest of a batch
    cannot be held for them), so the trainer is never stuck."""
    buf = GlobalBuffer(staleness_bound=1, micro_batch_tokens=100, consume_order="deadline")
    for gid in ("a", "b", "c", "d"):
        buf.admit(gid, 0)
    buf.put(group("a", 0))
    buf.put(group("b", 0))
    assert buf.wait_for(2, trainer_version=1, timeout=0) == 2
    assert [g.group_id for g in buf.take(2, trainer_version=1)] == ["a", "b"]


def test_batch_countable_keeps_a_place_per_due_group_in_flight():
    assert batch_countable(4, ready=6, due_ready=0, due_in_flight=0) == 6
    assert batch_countable(4, ready=6, due_ready=0, due_in_flight=1) == 3
    assert batch_countable(4, ready=2, due_ready=2, due_in_flight=5) == 2
    assert batch_countable(4, ready=3, due_ready=1, due_in_flight=1) == 3

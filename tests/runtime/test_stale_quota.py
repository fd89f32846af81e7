"""Stale drops return their staleness-quota slots: admission never stops for good."""

import asyncio

import pytest

from tidejax.envs import EnvPool, PoolConfig, make_tasks
from tidejax.envs.latency import LatencyModel
from tidejax.envs.pool import local_env_factory
from tidejax.models.testing import tiny_tokenizer
from tidejax.runtime.buffer import GlobalBuffer, ReadyGroup
from tidejax.runtime.config import RolloutConfig
from tidejax.runtime.controller import return_stale_slots
from tidejax.runtime.manager import RolloutManager
from tidejax.runtime.rollout import RolloutWorker
from tidejax.serving import EngineConfig, MockEngine

GROUP = 2


def group(gid, version, tokens=100, generated=40):
    return ReadyGroup(gid, payload=None, generated_tokens=generated, total_tokens=tokens,
                      min_version=version)


def test_stale_drops_are_reported_once():
    buf = GlobalBuffer(staleness_bound=1, micro_batch_tokens=100)
    assert buf.take_new_stale_drops() == 0
    buf.put(group("g0", version=0))
    buf.put(group("g1", version=0))
    buf.put(group("g2", version=2))
    assert buf.wait_for(1, trainer_version=2, timeout=0) == 1  # g0, g1 are 2 behind: stale
    assert buf.take_new_stale_drops() == 2
    assert buf.take_new_stale_drops() == 0  # reported once, not again
    buf.wait_for(1, trainer_version=2, timeout=0)  # nothing new goes stale
    assert buf.take_new_stale_drops() == 0
    buf.put(group("g3", version=3))
    assert [g.group_id for g in buf.take(10, trainer_version=4)] == ["g3"]  # g2 now stale
    assert buf.take_new_stale_drops() == 1
    assert [d.group_id for d in buf.dropped] == ["g0", "g1", "g2"]


def test_manager_drops_and_taken_groups_are_not_stale_drops():
    """The manager returns a failed group's slot itself and `consumed` covers taken ones:
    neither may be reported again as a stale drop (a slot comes back exactly once)."""
    buf = GlobalBuffer(staleness_bound=0, micro_batch_tokens=100)
    buf.drop("failed", "task_failed:env_exception", 12)
    buf.put(group("fresh", version=3))
    assert len(buf.take(10, trainer_version=3)) == 1
    assert buf.take_new_stale_drops() == 0
    assert [d.reason for d in buf.dropped] == ["task_failed:env_exception"]


def test_return_stale_slots_only_calls_consumed_for_new_drops():
    class Manager:
        def __init__(self):
            self.calls = []

        def consumed(self, n):
            self.calls.append(n)

    buf, manager = GlobalBuffer(staleness_bound=0, micro_batch_tokens=100), Manager()
    assert return_stale_slots(buf, manager) == 0
    buf.put(group("old", version=0))
    buf.wait_for(1, trainer_version=1, timeout=0)
    assert return_stale_slots(buf, manager) == 1
    assert return_stale_slots(buf, manager) == 0
    assert manager.calls == [1]


async def _wait_until(predicate, manager, timeout=120.0):
    """Poll the loop until `predicate()` holds (the timeout only guards against a hang)."""
    async def poll():
        while not predicate():
            manager.raise_if_failed()
            await asyncio.sleep(0.002)
    await asyncio.wait_for(poll(), timeout=timeout)


async def _stale_drop_then_readmit(scheduler):
    tok = tiny_tokenizer()
    pool = EnvPool(PoolConfig(capacity=8, step_timeout_s=2.0, max_retries=0),
                   env_factory=local_env_factory(),
                   latency=LatencyModel.default(time_scale=0.001, seed=0))
    ec = EngineConfig(page_size=16, num_pages=512, max_slots=4, max_pages_per_seq=96,
                      prefill_buckets=(256, 768))
    workers = {0: RolloutWorker(0, MockEngine(ec, vocab_size=tok.vocab_size),
                                pin_after_turn=scheduler == "ctb")}
    buffer = GlobalBuffer(staleness_bound=0, micro_batch_tokens=4096)
    # Quota = (bound + 1) * batch_groups = 1: one training group outstanding at a time.
    cfg = RolloutConfig(scheduler=scheduler, max_new_tokens=8, batch_groups=1,
                        staleness_bound=0, max_task_attempts=2, retry_backoff_s=0.001)
    manager = RolloutManager(cfg, workers, pool, tok, buffer, "webshop", max_seq_len=1536)
    try:
        tasks = make_tasks("webshop", "train", 2, GROUP, seed=0, max_turns=2)
        manager.add_groups(tasks, GROUP)
        assert manager.outstanding_groups == 1 and manager.pending_groups == 1  # at the quota
        await _wait_until(lambda: len(buffer) == 1, manager)  # the first group is ready
        assert manager.outstanding_groups == 1 and manager.pending_groups == 1

        # The trainer moved on to version 1: the group (version 0) is too stale to train.
        assert buffer.wait_for(1, trainer_version=1, timeout=0) == 0
        assert [d.reason for d in buffer.dropped] == ["stale"]
        assert return_stale_slots(buffer, manager) == 1
        # Its slot came back, so the second group was admitted in its place.
        assert manager.pending_groups == 0 and manager.outstanding_groups == 1
        assert return_stale_slots(buffer, manager) == 0  # the slot is returned only once

        await asyncio.wait_for(manager.wait_idle(), timeout=120)
        taken = buffer.take(1, trainer_version=1)  # served by the same version-0 mock: stale
        assert taken == [] and return_stale_slots(buffer, manager) == 1
        assert manager.outstanding_groups == 0
        assert [d.group_id for d in buffer.dropped] == [tasks[0].group_id, tasks[GROUP].group_id]
    finally:
        await manager.aclose()
        for w in workers.values():
            w.stop()
        await pool.aclose()


@pytest.mark.parametrize("scheduler", ["ctb", "request"])
def test_stale_drop_returns_its_quota_slot(scheduler):
    asyncio.run(_stale_drop_then_readmit(scheduler))

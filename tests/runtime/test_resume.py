"""Resume without a subprocess: reproducible seeds, the rollout snapshot, last-rank failure.

Mock engines (no compilation) run the real rollout manager and env pool; the controller
test uses the tiny model's trainer and a real Orbax checkpointer.
"""

import asyncio
import json
import threading
import time

import jax
import numpy as np
import pytest
from tidejax.models.testing import tiny_config, tiny_params, tiny_tokenizer
from tidejax.serving import EngineConfig, MockEngine, Request

from tidejax.checkpoint import Checkpointer
from tidejax.envs import EnvPool, PoolConfig, make_tasks
from tidejax.envs.latency import LatencyModel
from tidejax.envs.pool import local_env_factory
from tidejax.rl.testing import FAST_COMPILE
from tidejax.runtime import controller as controller_module
from tidejax.runtime import resume
from tidejax.runtime.buffer import GlobalBuffer
from tidejax.runtime.config import RolloutConfig
from tidejax.runtime.episode_loop import sampling_seed
from tidejax.runtime.manager import AllRanksFailed, RolloutManager
from tidejax.runtime.rollout import RankFailed, RolloutWorker

GROUP = 2


def engine_config():
    return EngineConfig(page_size=16, num_pages=512, max_slots=4, max_pages_per_seq=96,
                        prefill_buckets=(256, 768))


class DyingEngine(MockEngine):
    """A mock engine whose every generate raises once `dead` is set."""

    def __init__(self, *args, dead: threading.Event, **kwargs):
        super().__init__(*args, **kwargs)
        self.dead = dead

    def generate(self, params, decode_state, num_steps=None):
        if self.dead.is_set():
            raise RuntimeError("injected rank failure")
        return super().generate(params, decode_state, num_steps)


def make_manager(scheduler="ctb", ranks=2, env_capacity=32, seed=0, engines=None):
    tok = tiny_tokenizer()
    pool = EnvPool(PoolConfig(capacity=32), env_factory=local_env_factory(),
                   latency=LatencyModel.default(time_scale=0.01, seed=0))
    engines = engines or {r: MockEngine(engine_config(), vocab_size=tok.vocab_size)
                          for r in range(ranks)}
    workers = {r: RolloutWorker(r, e, pin_after_turn=scheduler == "ctb")
               for r, e in engines.items()}
    buffer = GlobalBuffer(staleness_bound=8, micro_batch_tokens=4096)
    cfg = RolloutConfig(scheduler=scheduler, max_new_tokens=8, batch_groups=8,
                        staleness_bound=8, env_capacity=env_capacity)
    manager = RolloutManager(cfg, workers, pool, tok, buffer, "webshop", seed=seed,
                             max_seq_len=1536)
    return manager, buffer, pool


async def shutdown(manager, pool):
    await manager.aclose()
    for w in manager.workers.values():
        w.stop()
    await pool.aclose()


def record_seeds(manager) -> dict:
    """{(task id, turn): sampling seed}, filled in as the manager samples turns."""
    seen = {}
    sampling = manager.episode_loop.sampling

    def record(rec):
        params = sampling(rec)
        seen[(rec.task.task_id, rec.episode.turns)] = params.seed
        return params

    manager.episode_loop.sampling = record
    return seen


def test_sampling_seed_depends_on_what_the_turn_is_not_when_it_ran():
    assert sampling_seed(0, "train0-g1-t0", 2, 1) == sampling_seed(0, "train0-g1-t0", 2, 1)
    seeds = {sampling_seed(s, t, turn, a) for s in (0, 1) for t in ("a", "b")
             for turn in (0, 1) for a in (1, 2)}
    assert len(seeds) == 16 and all(0 <= s < 2**31 - 1 for s in seeds)

    async def seeds_of(scheduler, ranks, env_capacity):
        manager, _, pool = make_manager(scheduler, ranks, env_capacity, seed=5)
        seen = record_seeds(manager)
        manager.add_groups(make_tasks("webshop", "train", 4, GROUP, seed=1, max_turns=3), GROUP)
        await asyncio.wait_for(manager.wait_idle(), timeout=120)
        await shutdown(manager, pool)
        return seen

    # Different schedulers, rank counts and admission limits: other timing, same seeds.
    a = asyncio.run(seeds_of("ctb", 3, 32))
    b = asyncio.run(seeds_of("request", 1, 2))
    assert a and a == b


def test_every_evaluation_samples_its_goals_with_the_same_seeds():
    """Common random numbers: evaluations of versions 0 and 3 (same goals) draw the same
    seeds turn by turn; the samples of one goal and training turns draw their own."""

    async def eval_seeds():
        manager, _, pool = make_manager(seed=5)
        seen = record_seeds(manager)
        for version in (0, 3):
            tasks = make_tasks("webshop", "eval", 3, GROUP, seed=7, max_turns=3,
                               prefix=f"eval_v{version}")
            manager.add_groups(tasks, GROUP, is_eval=True, eval_version=version)
        manager.add_groups(make_tasks("webshop", "eval", 3, GROUP, seed=7, max_turns=3,
                                      prefix="train0"), GROUP)  # the same goals, as training
        await asyncio.wait_for(manager.wait_idle(), timeout=120)
        await shutdown(manager, pool)
        return seen

    seen = asyncio.run(eval_seeds())
    by_prefix = {p: {k[0].split("-", 1)[1] + f"/{k[1]}": s for k, s in seen.items()
                     if k[0].startswith(p)} for p in ("eval_v0", "eval_v3", "train0")}
    assert by_prefix["eval_v0"] and by_prefix["eval_v0"] == by_prefix["eval_v3"]
    assert len(set(by_prefix["eval_v0"].values())) == len(by_prefix["eval_v0"])
    assert not set(by_prefix["train0"].values()) & set(by_prefix["eval_v0"].values())


def test_snapshot_restores_ready_groups_exactly_and_restarts_inflight_tasks(tmp_path):
    tasks = make_tasks("webshop", "train", 6, GROUP, seed=2, max_turns=3)

    async def first_half():
        # One env slot: groups finish one after another, so a snapshot taken once the
        # first group is ready has both ready and in-flight (started and queued) groups.
        manager, buffer, pool = make_manager(env_capacity=1)
        manager.add_groups(tasks, GROUP)
        while not len(buffer):
            await asyncio.sleep(0.002)
        snap = resume.snapshot(manager, buffer)
        await shutdown(manager, pool)
        return snap, buffer.snapshot()

    snap, ready_before = asyncio.run(first_half())
    n = resume.counts(snap)
    assert n["ready_groups"] >= 1 and n["restarted_tasks"] >= GROUP and n["requeued_tasks"] > 0

    # Through the checkpoint's JSON metadata and back.
    state = {"w": jax.numpy.arange(4.0)}
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(1, state, ref_model={}, data_cursor=6, rollout=snap)
        ckpt.wait()
        restored = ckpt.restore(jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
    assert json.dumps(restored.rollout, sort_keys=True) == json.dumps(snap, sort_keys=True)

    async def second_half():
        manager, buffer, pool = make_manager()
        resume.restore(restored.rollout, manager, buffer)
        admitted = sum(started for _, started in manager.inflight_training_groups())
        assert manager.outstanding_groups == n["ready_groups"] + admitted  # the quota counts both
        await asyncio.wait_for(manager.wait_idle(), timeout=120)
        counters = dict(manager.counters)
        await shutdown(manager, pool)
        return buffer.take(100, 0), counters

    groups, counters = asyncio.run(second_half())
    assert counters["restarted_tasks"] == n["restarted_tasks"]
    assert counters["requeued_tasks"] == n["requeued_tasks"]
    # Restored ready groups come back first and bit for bit.
    for before, after in zip(ready_before, groups):
        assert before.group_id == after.group_id and before.min_version == after.min_version
        assert before.payload.advantages == after.payload.advantages
        for x, y in zip(before.payload.trajectories, after.payload.trajectories):
            for field in ("tokens", "loss_mask", "behaviour_logp", "policy_version"):
                got = getattr(y, field)
                np.testing.assert_array_equal(got, getattr(x, field))
                assert got.dtype == getattr(x, field).dtype
    # Every task trained exactly once across the crash: none lost, none duplicated.
    trained = [tid for g in groups for tid in g.payload.task_ids]
    assert sorted(trained) == sorted(t.task_id for t in tasks)


def test_last_rank_failure_fails_fast():
    async def go():
        dead = threading.Event()
        tok = tiny_tokenizer()
        engines = {r: DyingEngine(engine_config(), vocab_size=tok.vocab_size, dead=dead)
                   for r in range(2)}
        manager, _, pool = make_manager(engines=engines)
        dead.set()
        manager.add_groups(make_tasks("webshop", "train", 2, GROUP, seed=0, max_turns=3), GROUP)
        try:
            with pytest.raises(AllRanksFailed, match="every rollout rank has failed"):
                await asyncio.wait_for(manager.wait_idle(), timeout=60)
        finally:
            await shutdown(manager, pool)
        return manager

    manager = asyncio.run(go())
    assert manager.quarantined == {0, 1} and not manager.workers


def test_dead_worker_answers_every_later_command():
    """Neither a turn nor a weight swap sent to a dead rank may wait forever."""
    dead = threading.Event()
    tok = tiny_tokenizer()
    worker = RolloutWorker(0, DyingEngine(engine_config(), vocab_size=tok.vocab_size, dead=dead),
                           pin_after_turn=True)
    dead.set()
    answers = []
    worker.submit(Request("r0", "t0", (1, 2, 3), 4), answers.append)
    assert worker._stopped.wait(10) and worker.failed is not None
    swap = worker.update_weights(None, 1)  # queued after the dying thread's last drain
    worker.submit(Request("r1", "t1", (1, 2, 3), 4), answers.append)
    assert swap.wait(1)
    assert len(answers) == 2 and all(isinstance(a, RankFailed) for a in answers)


def test_controller_stops_on_last_rank_failure_with_its_checkpoint_intact(tmp_path,
                                                                          monkeypatch):
    """Step 1 trains and checkpoints; then every rollout rank dies: the run raises at once
    (not after a timeout) and checkpoint 1 restores and verifies."""
    from tidejax.config import run_config_from_dict

    dead = threading.Event()
    tok = tiny_tokenizer()
    model_config = tiny_config()
    monkeypatch.setattr(
        controller_module, "make_engine",
        lambda cfg, params, devices, ec: DyingEngine(ec, vocab_size=tok.vocab_size, dead=dead))
    cfg = run_config_from_dict({
        "system": "sync", "steps": 3, "group_size": 2, "batch_groups": 2,
        "min_batch_groups": 1, "max_turns": 2, "eval_every": 0, "checkpoint_every": 1,
        "model_vocab_size": None,
        "env_time_scale": 0.01, "topology": {"devices": 3, "rollout_ranks": 2},
        "rollout": {"max_new_tokens": 8}})
    pool = EnvPool(PoolConfig(capacity=16), env_factory=local_env_factory(),
                   latency=LatencyModel.default(time_scale=0.01, seed=0))
    ckpt = Checkpointer(str(tmp_path / "ckpt"))

    def checkpoint(step, state, controller, rollout):
        ckpt.save(step, state, ref_model={"source": "tiny"}, data_cursor=controller.data_cursor,
                  rollout=rollout)

    died_at = []

    def kill_ranks(record):
        died_at.append(time.monotonic())
        dead.set()

    ctrl = controller_module.Controller(cfg, model_config, tiny_params(model_config), tok, pool,
                                        jax.devices()[:3], checkpoint=checkpoint,
                                        progress=kill_ranks)
    ctrl.runner.compiler_options = FAST_COMPILE
    with pytest.raises(AllRanksFailed, match="every rollout rank has failed"):
        asyncio.run(asyncio.wait_for(ctrl.run(), timeout=600))
    assert len(died_at) == 1 and time.monotonic() - died_at[0] < 60  # no hang
    assert ctrl.manager.quarantined == {d.id for d in jax.devices()[:3]}
    ckpt.wait()
    assert ckpt.all_steps() == [1]
    abstract = ctrl.runner.actor.abstract_state()
    restored = ckpt.restore(abstract)  # verifies the fingerprint
    assert restored.step == 1 and int(restored.state.step) == 1
    assert restored.rollout is not None and restored.data_cursor == 2
    ckpt.close()

"""Weight movement between trainer and rollout: device to device, bf16 on the rollout side,
and a closed rank's engine memory released."""

import asyncio
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from tidejax.models.model import unstack_layers
from tidejax.models.testing import tiny_config, tiny_params, tiny_tokenizer

from tidejax.config import run_config_from_dict
from tidejax.envs import EnvPool, PoolConfig
from tidejax.envs.pool import local_env_factory
from tidejax.rl.testing import FAST_COMPILE
from tidejax.runtime import controller as controller_module
from tidejax.runtime.manager import RolloutManager
from tidejax.sched import ers
from tidejax.serving import EngineConfig, make_engine

DEVICES = 4


def device_bytes(device) -> int:
    return sum(s.data.nbytes for x in jax.live_arrays() for s in x.addressable_shards
               if s.device == device)


def make_controller(devices=DEVICES, **topology):
    cfg = run_config_from_dict({
        "system": "async", "steps": 1, "group_size": 2, "batch_groups": 1,
        "min_batch_groups": 1, "eval_every": 0, "checkpoint_every": 0,
        "model_vocab_size": None, "compute_dtype": "bfloat16",
        "topology": {"devices": devices, "rollout_ranks": 3, **topology},
        "engine": {"page_size": 16, "num_pages": 128, "max_slots": 2, "max_pages_per_seq": 96,
                   "prefill_buckets": [256, 768]}})
    model_config = tiny_config(dtype="bfloat16")
    pool = EnvPool(PoolConfig(capacity=4), env_factory=local_env_factory())
    ctrl = controller_module.Controller(cfg, model_config, tiny_params(tiny_config()),
                                        tiny_tokenizer(), pool, jax.devices()[:devices])
    ctrl.runner.compiler_options = FAST_COMPILE
    return ctrl


def new_manager(ctrl):
    cfg = ctrl.cfg
    return RolloutManager(ctrl.rollout_config, {}, ctrl.pool, ctrl.tokenizer, ctrl.buffer,
                          cfg.env_type, cfg.rl.advantage, seed=0, max_seq_len=cfg.row_len)


async def sync_a_new_policy(ctrl, manager):
    """Train-free version 1 (the warm start + 0.5) pushed to the ranks with every
    device-to-host transfer forbidden; returns it and its bf16 cast, on the host."""
    state = ctrl.runner.actor.init_state(0, ctrl.params_host)
    state = state.replace(params=jax.tree.map(lambda p: p + 0.5, state.params))
    ctrl.version = 1
    jax.config.update("jax_transfer_guard_device_to_host", "disallow")
    try:
        await ctrl._sync_weights(manager, state)
    finally:
        jax.config.update("jax_transfer_guard_device_to_host", "allow")
    # Engines hold the weights per layer (`unstack_layers`): compare in that form.
    return state, unstack_layers(jax.device_get(
        jax.tree.map(lambda p: p.astype(jnp.bfloat16), state.params)))


def test_sync_moves_bf16_weights_device_to_device_and_closing_a_rank_frees_it():
    ctrl = make_controller()

    async def scenario():
        manager = new_manager(ctrl)
        three = ers.Partition(rollout=3, actor=1)
        state = await ctrl._apply_partition(three, manager, None)
        state, want = await sync_a_new_policy(ctrl, manager)
        for rank, worker in manager.workers.items():
            assert worker.version == 1
            for got, expect in zip(jax.tree.leaves(worker.engine.params),
                                   jax.tree.leaves(want)):
                assert got.dtype == jnp.bfloat16
                assert got.sharding.device_set == {jax.devices()[rank]}
                np.testing.assert_array_equal(np.asarray(got), expect)
        del worker, got  # this frame must not keep a closing rank's weights alive

        closing = jax.devices()[2]
        engine = ctrl._engines[closing.id]
        held = [weakref.ref(x) for x in jax.tree.leaves((engine.params, engine._kv))]
        two = ers.Partition(rollout=2, actor=2)
        state = await ctrl._apply_partition(two, manager, state)
        assert sorted(manager.workers) == [0, 1] and closing.id not in ctrl._engines
        assert engine.params is None and engine._kv is None
        del engine
        gc.collect()
        alive = [r() for r in held if r() is not None]
        assert held and not alive, f"{len(alive)} of the closed rank's arrays are still alive"
        await manager.aclose()
        for worker in list(manager.workers.values()):
            worker.stop()

    asyncio.run(scenario())


def test_engine_casts_host_float32_weights_before_they_travel():
    config = tiny_config(dtype="bfloat16")
    engine = make_engine(config, tiny_params(tiny_config()), jax.devices()[5:6],
                         EngineConfig(page_size=16, num_pages=8, max_slots=1,
                                      max_pages_per_seq=8, prefill_buckets=(64,)))
    assert {x.dtype for x in jax.tree.leaves(engine.params)} == {jnp.dtype(jnp.bfloat16)}
    assert engine._kv.k.dtype == jnp.bfloat16
    before = device_bytes(jax.devices()[5])
    engine.release()
    gc.collect()
    assert before > 0 and device_bytes(jax.devices()[5]) == 0


def test_a_rollout_rank_of_two_devices_serves_tensor_parallel_and_moves_whole():
    """`topology.rollout_tensor = 2`: a rank is two devices; its engine shards the weights
    over both, a sync lands there device to device, and ERS moves whole ranks."""
    ctrl = make_controller(devices=6, rollout_tensor=2, rollout_ranks=2)
    assert [[d.id for d in rank] for rank in ctrl.ranks] == [[0, 1], [2, 3], [4, 5]]
    assert ctrl.initial_partition().total == 3  # partitions count ranks, not devices

    async def scenario():
        manager = new_manager(ctrl)
        state = await ctrl._apply_partition(ers.Partition(rollout=2, actor=1), manager, None)
        assert sorted(manager.workers) == [0, 2]
        assert [d.id for d in ctrl.runner.actor_devices] == [4, 5]
        state, want = await sync_a_new_policy(ctrl, manager)
        for rank, worker in manager.workers.items():
            rank_devices = {jax.devices()[rank], jax.devices()[rank + 1]}
            split = 0
            for got, expect in zip(jax.tree.leaves(worker.engine.params),
                                   jax.tree.leaves(want)):
                assert got.sharding.device_set == rank_devices
                split += got.sharding.shard_shape(got.shape) != got.shape
                np.testing.assert_array_equal(np.asarray(got), expect)
            assert split > 0  # tensor parallel: weights are split, not copied whole
            assert worker.engine._kv.k.sharding.device_set == rank_devices
        # A move takes a whole rank: the actor grows by two devices.
        state = await ctrl._apply_partition(ers.Partition(rollout=1, actor=2), manager, state)
        assert sorted(manager.workers) == [0]
        assert [d.id for d in ctrl.runner.actor_devices] == [2, 3, 4, 5]
        await manager.aclose()
        for worker in list(manager.workers.values()):
            worker.stop()

    asyncio.run(scenario())


def test_a_padded_actor_mesh_syncs_real_shaped_weights_device_to_device(monkeypatch):
    """Six actor devices do not divide the tiny model's hidden size 64: with padding
    allowed up to 15% the job stores it as 72, and the engines still get the real shapes,
    device to device."""
    from tidejax.sched import memory

    monkeypatch.setattr(memory, "MAX_STORAGE_PADDING", 0.15)
    ctrl = make_controller(devices=8, rollout_ranks=2)
    assert ctrl.job_memory.shape.stored_d_model == 72

    async def scenario():
        manager = new_manager(ctrl)
        state = await ctrl._apply_partition(ers.Partition(rollout=2, actor=6), manager, None)
        actor = ctrl.runner.actor
        assert actor.mesh.size == 6 and actor.padded
        state, _ = await sync_a_new_policy(ctrl, manager)
        want = unstack_layers(jax.tree.map(lambda p: np.asarray(p.astype(jnp.bfloat16)),
                                           actor.host_params(state.params)))
        for rank, worker in manager.workers.items():
            assert worker.version == 1
            for got, expect in zip(jax.tree.leaves(worker.engine.params),
                                   jax.tree.leaves(want)):
                assert got.shape == expect.shape and got.dtype == jnp.bfloat16
                assert got.sharding.device_set == {jax.devices()[rank]}
                np.testing.assert_array_equal(np.asarray(got), expect)
        await manager.aclose()
        for worker in list(manager.workers.values()):
            worker.stop()

    asyncio.run(scenario())

"""A job whose actor mesh the model dim does not divide: trained with padded storage,
synced to the engines at real shapes, checkpointed, restored with the padding still zero.

The tiny model's hidden size 64 does not divide a 6-device actor mesh; with padding
allowed up to 15% (the default 1% only pads billion-parameter-scale model dims) the job
stores it as 72 (`tidejax.sched.memory.storage_dim`).
"""

import asyncio

import jax
import numpy as np
from tidejax.models.testing import tiny_config, tiny_params, tiny_tokenizer

from tidejax.checkpoint import Checkpointer
from tidejax.config import run_config_from_dict
from tidejax.envs import EnvPool, PoolConfig
from tidejax.envs.latency import LatencyModel
from tidejax.envs.pool import local_env_factory
from tidejax.rl.testing import FAST_COMPILE
from tidejax.runtime import controller as controller_module
from tidejax.sched import memory


def test_a_padded_actor_mesh_trains_syncs_and_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "MAX_STORAGE_PADDING", 0.15)
    cfg = run_config_from_dict({
        "system": "async", "steps": 2, "group_size": 2, "batch_groups": 2,
        "min_batch_groups": 1, "max_turns": 2, "eval_every": 0, "checkpoint_every": 1,
        "model_vocab_size": None, "env_time_scale": 0.01,
        "topology": {"devices": 8, "rollout_ranks": 2}, "rollout": {"max_new_tokens": 8}})
    model_config = tiny_config()
    pool = EnvPool(PoolConfig(capacity=16), env_factory=local_env_factory(),
                   latency=LatencyModel.default(time_scale=0.01, seed=0))
    ckpt = Checkpointer(str(tmp_path / "ckpt"))

    def checkpoint(step, state, controller, rollout):
        ckpt.save(step, state, ref_model={"source": "tiny"}, data_cursor=controller.data_cursor,
                  rollout=rollout)

    ctrl = controller_module.Controller(cfg, model_config, tiny_params(model_config),
                                        tiny_tokenizer(), pool, jax.devices()[:8],
                                        checkpoint=checkpoint)
    ctrl.runner.compiler_options = FAST_COMPILE
    summary = asyncio.run(asyncio.wait_for(ctrl.run(), timeout=900))
    assert ctrl.job_memory.shape.stored_d_model == 72
    actor = ctrl.runner.actor
    assert actor.mesh.size == 6 and actor.padded
    assert len(summary.records) == 2 and all(r.consumed_tokens > 0 for r in summary.records)
    assert ctrl._engines
    for engine in ctrl._engines.values():  # the engines hold the real shapes
        assert not any(72 in x.shape for x in jax.tree.leaves(engine.params))
    ckpt.wait()
    restored = ckpt.restore(actor.abstract_state())
    assert restored.step == 2
    trained = jax.device_get(restored.state.params)
    moved = 0
    for leaf, shape in zip(jax.tree.leaves(trained), jax.tree.leaves(
            actor.logical_shapes, is_leaf=lambda x: isinstance(x, tuple))):
        if leaf.shape == shape:
            continue
        pad = leaf.copy()
        pad[tuple(slice(0, n) for n in shape)] = 0
        assert not pad.any()  # two updates left the padding exactly zero
        moved += 1
    assert moved > 5
    assert int(restored.state.step) == 2  # both updates ran on the padded state
    real = actor.host_params(restored.state.params)
    assert [x.shape for x in jax.tree.leaves(real)] == [
        np.shape(x) for x in jax.tree.leaves(tiny_params(model_config))]
    ckpt.close()


def test_the_sft_warm_start_trains_padded_and_caches_real_shapes(tmp_path, monkeypatch):
    from tidejax.runtime.episode import EpisodeTokens
    from tidejax.runtime.sft import load_params, sft_mesh_size, sft_warm_start

    monkeypatch.setattr(memory, "MAX_STORAGE_PADDING", 0.15)
    cfg = run_config_from_dict({
        "model_vocab_size": None, "row_len": 64, "topology": {"devices": 8},
        "sft": {"steps": 3, "batch_sequences": 6, "devices": 6, "lr": 1e-2}})
    model_config = tiny_config()
    devices = jax.devices()[:8]
    assert sft_mesh_size(cfg, model_config, devices) == 6  # 72 divides 6; 64 would not
    rng = np.random.default_rng(0)
    episodes = []
    for _ in range(12):
        tokens = rng.integers(1, model_config.vocab_size, 30).tolist()
        episodes.append(EpisodeTokens(tokens=tokens, loss_mask=[0] * 10 + [1] * 20))
    start = jax.device_get(tiny_params(model_config))
    cache = str(tmp_path / "sft.npz")
    params = sft_warm_start(cfg, model_config, start, episodes, devices, cache)
    for got, before in zip(jax.tree.leaves(params), jax.tree.leaves(start)):
        assert isinstance(got, np.ndarray) and got.shape == np.shape(before)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params),
                                                       jax.tree.leaves(start)))
    cached = load_params(cache, start)  # the cache holds the real shapes
    for a, b in zip(jax.tree.leaves(cached), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)

"""Trainer on submeshes: same loss and update on 1/2/4/6 devices, accumulation, decoupled
ref/actor on separate submeshes, SFT."""

import dataclasses
import functools

import chex
import jax
import numpy as np
import pytest
from tidejax.models import param_shardings
from tidejax.models.sharding import TRAIN_RULES
from tidejax.models.testing import tiny_config

from tidejax.rl import (
    Batch,
    LossConfig,
    OptimConfig,
    RLConfig,
    build_batch,
    loss_denominator,
    make_trainer,
)
from tidejax.rl.testing import FAST_COMPILE, random_params, random_trajectory, submesh

CFG = tiny_config()
RL = RLConfig(loss=LossConfig(kl_coef=0.1), optim=OptimConfig(lr=1e-3, eps=1e-6, warmup_steps=0,
                                                              total_steps=10))
B, T = 6, 16  # B divides every data-parallel size used here (1, 2, 3)


@functools.cache
def trainer(n_devices, offset=0):
    return make_trainer(CFG, RL, submesh(n_devices, offset), compiler_options=FAST_COMPILE)


@functools.cache
def data():
    """Two micro-batches of 6 single-sequence rows, and the same 12 sequences packed
    two per row into one batch of the same shape."""
    rng = np.random.default_rng(0)
    trajs = [random_trajectory(CFG, rng, int(rng.integers(5, 9)), group_id=i // 4)
             for i in range(12)]
    adv = rng.normal(size=12).astype(np.float32)
    mb1 = build_batch(trajs, adv, [[i] for i in range(6)], T)
    mb2 = build_batch(trajs, adv, [[i] for i in range(6, 12)], T)
    merged = build_batch(trajs, adv, [[i, i + 6] for i in range(6)], T)
    # A made-up reference: the behaviour log-probs shifted, as a stand-in for a ref model.
    ref = {id(b): b.behaviour_logp - 0.05 * b.loss_mask for b in (mb1, mb2, merged)}
    return mb1, mb2, merged, ref


@functools.cache
def two_micro_batch_step(n_devices):
    tr = trainer(n_devices)
    mb1, mb2, _, ref = data()
    denom = loss_denominator([mb1, mb2], RL.loss.loss_agg)
    state = tr.init_state(0, params=random_params(CFG))
    accum = tr.zero_accum()
    for mb in (mb1, mb2):
        accum = tr.actor_grads(state.params, tr.put(mb), tr.put(ref[id(mb)]), denom, accum)
    grads = jax.device_get(accum.grads)
    state, metrics = tr.apply_update(state, accum)
    return jax.device_get(state), jax.device_get(metrics), grads


def test_state_is_born_sharded_by_the_logical_rules():
    tr = trainer(4)
    state = tr.init_state(0, params=random_params(CFG))
    want = param_shardings(CFG, tr.mesh, TRAIN_RULES)
    jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim) or pytest.fail(str(s)),
                 state.params, want)
    # [vocab, embed]: the vocabulary claims fsdp and tensor first, so the table is never
    # all-gathered whole
    emb = state.params["embedder"]["embedding"]
    assert emb.sharding.spec == jax.sharding.PartitionSpec(("fsdp", "tensor"), None)
    mu = state.opt_state[1][0].mu["embedder"]["embedding"]  # Adam moments follow the params
    assert mu.sharding.spec == emb.sharding.spec


@pytest.mark.parametrize("n_devices", [2, 4, 6])
def test_same_loss_and_update_on_any_submesh(n_devices):
    state1, metrics1, grads1 = two_micro_batch_step(1)
    state, metrics, grads = two_micro_batch_step(n_devices)
    chex.assert_trees_all_close(metrics, metrics1, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(grads, grads1, rtol=1e-4, atol=1e-7)
    # Adam's first step is lr * g / (|g| + eps): for |g| near eps it amplifies float32
    # rounding in g, so updated params are compared to 1% of one learning-rate step.
    chex.assert_trees_all_close(state.params, state1.params, rtol=1e-5, atol=1e-2 * RL.optim.lr)
    assert int(state.step) == 1 and int(state.policy_version) == 1


def test_update_metrics_are_sane():
    _, metrics, _ = two_micro_batch_step(1)
    mb1, mb2, _, _ = data()
    assert metrics["tokens"] == mb1.loss_mask.sum() + mb2.loss_mask.sum()
    assert metrics["staleness_mean"] == 0 and metrics["staleness_max"] == 0  # all version 0
    np.testing.assert_allclose(metrics["loss"], metrics["pg_loss"] + 0.1 * metrics["kl"],
                               rtol=1e-5)
    assert 0 < metrics["grad_norm"] and 0 <= metrics["clip_frac"] <= 1
    np.testing.assert_allclose(metrics["lr"], 1e-3)


def test_accumulated_micro_batches_equal_one_packed_batch():
    tr = trainer(1)
    mb1, mb2, merged, ref = data()
    denom = loss_denominator([mb1, mb2], RL.loss.loss_agg)
    assert denom == loss_denominator([merged], RL.loss.loss_agg)
    params = tr.put_params(random_params(CFG))
    split = tr.zero_accum()
    for mb in (mb1, mb2):
        split = tr.actor_grads(params, tr.put(mb), tr.put(ref[id(mb)]), denom, split)
    whole = tr.actor_grads(params, tr.put(merged), tr.put(ref[id(merged)]), denom,
                           tr.zero_accum())
    chex.assert_trees_all_close(split.grads, whole.grads, rtol=1e-4, atol=1e-7)
    for key in ("loss", "pg_loss", "kl", "tokens", "clipped"):
        np.testing.assert_allclose(split.metrics[key], whole.metrics[key], rtol=1e-5, atol=1e-7)


def test_decoupled_ref_and_actor_on_separate_submeshes():
    """Ref on devices 4-5, actor on devices 0-3: the actor's forward runs before any
    reference log-prob exists; the backward equals the fused colocated gradient."""
    actor, ref_side = trainer(4), trainer(2, offset=4)
    mb1, *_ = data()
    params = actor.put_params(random_params(CFG))
    ref_params = ref_side.put_params(random_params(CFG, seed=1))
    logp, pullback = actor.actor_forward(params, actor.put(mb1))
    ref_logp = ref_side.ref_logprobs(ref_params, ref_side.put(mb1))
    assert ref_logp.sharding.mesh.devices.flat[0] == jax.devices()[4]
    ref_logp = actor.put(ref_logp)  # stream it across submeshes
    denom = loss_denominator([mb1], RL.loss.loss_agg)
    deferred = actor.actor_backward(pullback, logp, ref_logp, actor.put(mb1), denom,
                                    actor.zero_accum())
    fused = actor.actor_grads(params, actor.put(mb1), ref_logp, denom, actor.zero_accum())
    chex.assert_trees_all_close(deferred.grads, fused.grads, rtol=1e-6, atol=1e-9)
    chex.assert_trees_all_close(deferred.metrics, fused.metrics, rtol=1e-6)
    assert float(deferred.metrics["kl"]) > 0


def test_put_rejects_a_batch_that_does_not_split():
    with pytest.raises(ValueError, match="data-parallel"):
        trainer(6).put(np.zeros((4, T), np.int32))


def test_sft_step_lowers_the_loss():
    tr = trainer(1)
    mb1, *_ = data()
    batch = Batch.for_sft(mb1.tokens, mb1.loss_mask, mb1.segment_ids)
    state = tr.init_state(0, params=random_params(CFG))
    losses = []
    for _ in range(4):
        state, metrics = tr.sft_step(state, tr.put(batch))
        losses.append(float(metrics["loss"]))
    # Random tiny model: -log p ~ log(vocab) = 6.24 at the start.
    assert abs(losses[0] - np.log(CFG.vocab_size)) < 0.2
    assert losses[-1] < losses[0] - 0.1, losses
    assert int(state.step) == 4


@pytest.mark.slow
def test_init_from_seed_is_born_sharded():
    """Random init jitted with out_shardings: no parameter is ever materialised whole."""
    tr = trainer(6)
    state = tr.init_state(3)
    jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim) or pytest.fail(str(s)),
                 state, tr.state_shardings)
    abstract = tr.abstract_state()
    chex.assert_trees_all_equal_shapes_and_dtypes(state, abstract)
    assert int(state.step) == 0


def test_a_grpo_step_moves_log_probs_the_way_the_advantages_point():
    """On-policy data (behaviour = current log-probs): one update raises the log-prob of
    every positive-advantage sequence and lowers every negative one."""
    tr = trainer(1)
    mb1, *_ = data()
    state = tr.init_state(0, params=random_params(CFG))
    seg_adv = np.where(mb1.segment_ids > 0, 1.0, 0.0) * np.where(
        np.arange(B)[:, None] % 2 == 0, 1.0, -1.0)  # rows alternate +1 / -1
    logp_before = np.asarray(tr.ref_logprobs(state.params, tr.put(mb1)))
    batch = dataclasses.replace(mb1, advantages=seg_adv.astype(np.float32),
                                behaviour_logp=logp_before * mb1.loss_mask)
    denom = loss_denominator([batch], RL.loss.loss_agg)
    accum = tr.actor_grads(state.params, tr.put(batch), tr.put(logp_before), denom,
                           tr.zero_accum())
    state, _ = tr.apply_update(state, accum)
    logp_after = np.asarray(tr.ref_logprobs(state.params, tr.put(batch)))
    change = ((logp_after - logp_before) * mb1.loss_mask).sum(axis=1)
    assert np.all(change[::2] > 0) and np.all(change[1::2] < 0), change


def test_state_a_mesh_size_cannot_shard_is_measured_and_reported(caplog):
    """Qwen2.5-7B's model dim (3,584) does not divide over 6 devices: the trainer says how
    much state each device holds beyond an even share; 8 devices divide and stay quiet."""
    from tidejax.models import get_preset
    from tidejax.models.model import abstract_params
    from tidejax.models.sharding import make_mesh, stored_abstract, undivided_bytes

    cfg = get_preset("qwen2.5-7b").replace(num_layers=1, dtype="float32")
    six = make_mesh(jax.devices()[:6], fsdp=-1)
    lost = undivided_bytes(cfg, six, TRAIN_RULES, abstract_params(cfg))
    # An MLP kernel [L, D, F] is sharded on D; unsharded, each device keeps 5/6 of it
    # extra. The output head [D, V] shards its vocabulary (152,064 divides 6) and loses
    # nothing; the untied input table shards on D, so it loses like the kernels.
    gate = cfg.num_layers * cfg.hidden_size * cfg.intermediate_size * 4
    assert lost["['layers']['mlp']['gate_kernel']"] == gate - gate // 6
    assert "['embedder']['lm_head']" not in lost
    assert "['embedder']['embedding']" in lost
    assert undivided_bytes(cfg, make_mesh(jax.devices()[:8], fsdp=-1), TRAIN_RULES) == {}
    # stored padded to a multiple of 6, nothing is lost
    padded = stored_abstract(cfg, abstract_params(cfg), 3588)
    assert undivided_bytes(cfg, six, TRAIN_RULES, padded) == {}
    with caplog.at_level("WARNING", logger="tidejax.rl.trainer"):
        make_trainer(cfg, RLConfig(), six)
    assert "6-device trainer mesh cannot shard" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="tidejax.rl.trainer"):
        make_trainer(cfg, RLConfig(), make_mesh(jax.devices()[:8], fsdp=-1))
    assert "cannot shard" not in caplog.text

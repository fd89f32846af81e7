"""Model: preset sizes, packed segments, cached decode, chunked log-probs, sharding."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tidejax import models
from tidejax.models.dense_cache import dense_attend, init_dense_cache
from tidejax.models.testing import tiny_config, tiny_params

PUBLISHED_PARAMS = {  # billions, from the Qwen2.5 model cards
    "qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09,
    "qwen2.5-7b": 7.62, "qwen2.5-14b": 14.77,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_param_counts(name):
    count = models.param_count(models.abstract_params(models.presets[name])) / 1e9
    assert abs(count - PUBLISHED_PARAMS[name]) / PUBLISHED_PARAMS[name] < 0.01


def test_packed_segments_do_not_attend_across():
    cfg, params = tiny_config(), tiny_params()
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, cfg.vocab_size, 5), rng.integers(0, cfg.vocab_size, 7)
    packed = np.concatenate([a, b])[None]
    seg = np.array([[1] * 5 + [2] * 7])
    got = models.forward(cfg, params, packed, segment_ids=seg)
    want_a = models.forward(cfg, params, a[None])
    want_b = models.forward(cfg, params, b[None])
    np.testing.assert_allclose(got[0, :5], want_a[0], atol=1e-5)
    np.testing.assert_allclose(got[0, 5:], want_b[0], atol=1e-5)


def test_cached_decode_matches_full_forward():
    cfg, params = tiny_config(), tiny_params()
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9))
    full = models.forward(cfg, params, tokens)
    cache = init_dense_cache(cfg, batch=2, max_len=16)
    step = jax.jit(functools.partial(models.forward_with_cache, cfg, attend=dense_attend))
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    logits, cache = step(params, tokens[:, :5], pos, cache=cache, aux=pos)
    outs = [logits]
    for t in range(5, 9):
        pos = jnp.full((2, 1), t)
        logits, cache = step(params, tokens[:, t:t + 1], pos, cache=cache, aux=pos)
        outs.append(logits)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, atol=1e-5)


def test_chunked_logprobs_match_full_softmax():
    cfg, params = tiny_config(), tiny_params()
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (3, 13))
    seg = np.array([[1] * 13, [1] * 6 + [2] * 7, [1] * 10 + [0] * 3])
    logits = models.forward(cfg, params, tokens, segment_ids=seg)
    full = jax.nn.log_softmax(logits, axis=-1)
    want = np.zeros(tokens.shape, np.float32)
    want[:, 1:] = np.take_along_axis(np.asarray(full[:, :-1]), tokens[:, 1:, None], -1)[..., 0]
    want[:, 1:] *= seg[:, 1:] == seg[:, :-1]
    for chunk in (1, 4, 128):
        got = models.token_logprobs(cfg, params, tokens, segment_ids_BT=seg, chunk=chunk)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_tempered_logprobs_are_those_of_the_scaled_logits():
    """The trainer's log-probs at the rollout temperature: log softmax(logits / T)."""
    cfg, params = tiny_config(), tiny_params()
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 9))
    logits = models.forward(cfg, params, tokens)
    for temperature in (0.5, 2.0):
        full = np.asarray(jax.nn.log_softmax(logits / temperature, axis=-1))
        want = np.zeros(tokens.shape, np.float32)
        want[:, 1:] = np.take_along_axis(full[:, :-1], tokens[:, 1:, None], -1)[..., 0]
        got = models.token_logprobs(cfg, params, tokens, chunk=4, temperature=temperature)
        np.testing.assert_allclose(got, want, atol=1e-5)
    untempered = models.token_logprobs(cfg, params, tokens, chunk=4)
    assert np.abs(np.asarray(got) - np.asarray(untempered))[:, 1:].min() > 0


def test_logprob_grad_matches_full_softmax_grad():
    cfg, params = tiny_config(), tiny_params()
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 8))

    def chunked(p):
        return models.token_logprobs(cfg, p, tokens, chunk=3).sum()

    def full(p):
        lp = jax.nn.log_softmax(models.forward(cfg, p, tokens), -1)[:, :-1]
        return jnp.take_along_axis(lp, tokens[:, 1:, None], -1).sum()

    chex.assert_trees_all_close(jax.grad(chunked)(params), jax.grad(full)(params), atol=1e-5)


def test_sharded_forward_equals_single_device():
    cfg = tiny_config()
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, (4, 8))
    params = tiny_params(cfg)
    want = models.forward(cfg, params, tokens)
    for rules, (fsdp, tensor) in ((models.TRAIN_RULES, (2, 2)), (models.ROLLOUT_RULES, (1, 4))):
        mesh = models.make_mesh(jax.devices()[:4], fsdp=fsdp, tensor=tensor)
        sharded = jax.device_put(params, models.param_shardings(cfg, mesh, rules))
        got = jax.jit(functools.partial(models.forward, cfg))(sharded, tokens)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_bfloat16_params_run():
    cfg = tiny_config(dtype="bfloat16")
    params = tiny_params(cfg)
    assert jax.tree.leaves(params)[0].dtype == jnp.bfloat16
    logits = models.forward(cfg, params, np.zeros((1, 4), np.int32))
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())


@pytest.mark.parametrize("field,value", [("num_heads", 3), ("vocab_size", 0), ("dtype", "int8"),
                                         ("rope_theta", -1.0)])
def test_bad_config_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        tiny_config(**{field: value})


def test_per_layer_weights_run_unrolled_to_the_same_outputs_and_cache():
    """`unstack_layers` (the engine's layout) runs the same function as the stacked scan:
    logits and the dense cache agree to float rounding; `stack_layers` inverts it exactly."""
    from tidejax.models.model import stack_layers, unstack_layers

    cfg, params = tiny_config(), tiny_params()
    per_layer = unstack_layers(params)
    assert isinstance(per_layer["layers"], tuple) and len(per_layer["layers"]) == cfg.num_layers
    chex.assert_trees_all_equal(stack_layers(per_layer), params)
    assert unstack_layers(per_layer) is per_layer and stack_layers(params) is params
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 6))
    positions = np.broadcast_to(np.arange(6), (2, 6))
    run = jax.jit(functools.partial(models.forward_with_cache, cfg, attend=dense_attend))
    outputs = [run(p, tokens, positions, cache=init_dense_cache(cfg, 2, 8), aux=positions)
               for p in (params, per_layer)]
    chex.assert_trees_all_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)

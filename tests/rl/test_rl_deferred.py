"""Deferred KL: forward without ref_logp + backward with it == jax.grad of the fused loss."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tidejax.models.testing import tiny_config

from tidejax.rl import LossConfig, actor_backward, actor_forward, actor_grads, residual_bytes
from tidejax.rl.testing import FAST_COMPILE, random_batch, random_params


def assert_grads_close(got, want, rtol):
    """Per leaf: |got - want| <= rtol * (|want| + max|want|), i.e. relative error `rtol`
    measured against each leaf's own scale (elements near zero are judged by that scale)."""
    def check(g, w):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = np.max(np.abs(w))
        np.testing.assert_array_less(np.abs(g - w), rtol * (np.abs(w) + scale) + 1e-30)
    jax.tree.map(check, got, want)


# (dtype, loss config, remat, tolerance). bf16 params give bf16 gradients, whose rounding
# differs by one ulp between the two programs, hence the bf16 epsilon as tolerance.
CASES = {
    "f32_k3_token_mean": ("float32", LossConfig(kl_coef=0.5, kl_estimator="k3"), False, 1e-6),
    "bf16_k2_seq_sum_remat": ("bfloat16", LossConfig(kl_coef=0.5, kl_estimator="k2",
                                                     loss_agg="seq-mean-token-sum",
                                                     clip_eps_high=0.28), True, 2 ** -7),
}


@functools.cache
def run_case(name):
    dtype, loss_cfg, remat, tol = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    cfg = tiny_config(dtype=dtype)
    shape = (int(rng.integers(1, 4)), int(rng.integers(12, 33)))  # random B, T
    params = jax.tree.map(jnp.asarray, random_params(cfg, seed=int(rng.integers(100))))
    batch = jax.tree.map(jnp.asarray, random_batch(cfg, rng, *shape))
    jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    forward = jit(functools.partial(actor_forward, cfg, remat=remat))
    logp, pullback = forward(params, batch)  # no reference input exists yet
    # Behaviour log-probs near the current ones (some ratios leave the clip range), and a
    # reference that differs, so both the clip and the KL term shape the gradient.
    noise = rng.normal(0, 0.3, shape).astype(np.float32)
    batch = batch.replace(behaviour_logp=(logp + noise) * batch.loss_mask)
    ref_logp = logp + rng.normal(0, 0.5, shape).astype(np.float32)
    backward = jit(actor_backward, static_argnums=(4,))
    deferred, _ = backward(pullback, logp, ref_logp, batch, loss_cfg)
    fused = jit(functools.partial(actor_grads, cfg, loss_config=loss_cfg, remat=remat))
    want, _ = fused(params, batch, ref_logp)
    return {"deferred": deferred, "want": want, "tol": tol, "pullback": pullback,
            "backward": backward, "logp": logp, "ref_logp": ref_logp, "batch": batch,
            "loss_cfg": loss_cfg}


@pytest.mark.parametrize("name", sorted(CASES))
def test_deferred_equals_fused_grad(name):
    r = run_case(name)
    chex.assert_trees_all_equal_shapes_and_dtypes(r["deferred"], r["want"])
    assert_grads_close(r["deferred"], r["want"], r["tol"])
    chex.assert_tree_all_finite(r["deferred"])


def test_dropping_kl_fails_the_check():
    r = run_case("f32_k3_token_mean")
    no_kl, _ = r["backward"](r["pullback"], r["logp"], r["ref_logp"], r["batch"],
                             r["loss_cfg"].replace(kl_coef=0.0))
    with pytest.raises(AssertionError):
        assert_grads_close(no_kl, r["want"], r["tol"])


def test_remat_shrinks_residuals():
    cfg = tiny_config()
    params = random_params(cfg)
    batch = random_batch(cfg, np.random.default_rng(0), 4, 64)
    sizes = {remat: residual_bytes(jax.eval_shape(
        functools.partial(actor_forward, cfg, remat=remat), params, batch)[1])
        for remat in (False, True)}
    assert sizes[True] < sizes[False]

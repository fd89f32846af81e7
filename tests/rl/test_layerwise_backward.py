"""The layer-by-layer deferred backward (what the trainer runs under remat) gives the
gradients of `jax.grad` of the fused loss, added into the accumulator it is given."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tidejax.models.testing import tiny_config

from tidejax.models import make_mesh
from tidejax.rl import RLConfig, make_trainer
from tidejax.rl.config import LossConfig
from tidejax.rl.testing import FAST_COMPILE, random_batch, random_params


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_layerwise_backward_matches_the_fused_gradient(tied):
    cfg = tiny_config(tie_word_embeddings=tied)
    rl = RLConfig(remat=True, loss=LossConfig(kl_coef=0.1))
    mesh = make_mesh(jax.devices()[:2], data=1, fsdp=-1, tensor=1)
    t = make_trainer(cfg, rl, mesh, compiler_options=FAST_COMPILE)
    assert t.remat
    params = t.put_params(random_params(cfg, seed=1))
    ref = t.compute_copy(random_params(cfg, seed=2))
    rng = np.random.default_rng(0)
    # a non-zero accumulator: the backward must add into it, not overwrite it
    start = t.actor_grads(params, t.put(random_batch(cfg, rng, batch=4, length=32)),
                          jnp.zeros((4, 32)), 50.0, t.zero_accum())
    fused_start = jax.tree.map(jnp.copy, start)
    batch = t.put(random_batch(cfg, rng, batch=4, length=32))
    ref_logp = t.ref_logprobs(ref, batch)
    logp, residuals = t.actor_forward(params, batch)
    assert "layer_inputs" in residuals._fields  # the layer-by-layer path ran
    layerwise = t.actor_backward(residuals, logp, ref_logp, batch, 50.0, start)
    fused = t.actor_grads(params, batch, ref_logp, 50.0, fused_start)
    for a, b in zip(jax.tree.leaves(layerwise.grads), jax.tree.leaves(fused.grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-7)
    for key in fused.metrics:
        np.testing.assert_allclose(float(layerwise.metrics[key]), float(fused.metrics[key]),
                                   rtol=1e-5)

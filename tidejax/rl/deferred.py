"""Deferred KL: the actor's forward pass needs no reference log-probs.

RA2P's decoupled mode runs the reference model on its own submesh while the actor runs its
forward pass on another; the reference log-probs arrive later, only for the backward pass.

Form chosen: the pullback of `jax.vjp`. `actor_forward` returns `(logp_BT, pullback)` where
`pullback = jax.vjp(params -> token_logprobs(params, batch))[1]`. The pullback is a pytree
whose leaves are the residuals (the activations a normal backward keeps, plus the
parameters the backward matmuls need), so it can be returned from one jitted function and
passed into another. `actor_backward` then computes the cotangent dL/dlogp_BT from the
loss head (policy loss + kl_coef * KL, elementwise in logp, `losses.rl_loss`) once
`ref_logp_BT` is there, and applies the pullback to it.

Why this form over a `jax.custom_vjp` loss: a custom VJP's forward and backward rules live
inside one trace, so the reference input would have to exist when the fused function is
called; the split pullback makes the late arrival of `ref_logp` explicit in the function
signatures, and it is exactly the chain rule, so the gradient equals `jax.grad` of the
fused loss (`steps.actor_grads`) without a hand-written derivative of the model.
The head's cotangent is cheap, `O(B*T)`: per token
`w_t * (dpg/dlogp_t + kl_coef * dkl/dlogp_t)`, with dkl/dlogp = 1 (k1), logp - ref (k2),
1 - exp(ref - logp) (k3); we let autodiff of the head produce it so the two paths share
one definition of the loss.

Memory: the residuals are what the fused step would hold between its forward and backward
anyway: per decoder layer its input, normalised activations, q/k/v, attention
probabilities and MLP activations; the final hidden states (per-chunk logits are
recomputed, see `models.logprobs`); and the parameters the backward matmuls read. With
`remat=True` each layer keeps only its input and recomputes the rest in the backward pass
(about one extra forward of compute). Keep the pullback only until `actor_backward` has
run; dropping it frees the residuals.
"""

from __future__ import annotations

from typing import Any

import jax

from tidejax.models import ModelConfig, token_logprobs
from tidejax.rl.batch import Batch
from tidejax.rl.config import LossConfig
from tidejax.rl.losses import rl_loss

Params = dict[str, Any]
Pullback = Any  # jax.vjp's pullback: a pytree of residual arrays, callable on dL/dlogp_BT


def actor_forward(model_config: ModelConfig, params: Params, batch: Batch, *,
                  chunk: int = 128, remat: bool = False, activation_sharding=None,
                  temperature: float = 1.0) -> tuple[jax.Array, Pullback]:
    """Per-token log-probs `[B, T]` and the pullback that maps dL/dlogp to dL/dparams."""
    def logp_fn(p):
        return token_logprobs(model_config, p, batch.tokens, batch.positions, batch.segment_ids,
                              chunk=chunk, remat=remat,
                              activation_sharding=activation_sharding,
                              temperature=temperature)

    logp, pullback = jax.vjp(logp_fn, params)
    return logp, split_residuals(pullback, batch.tokens.shape[0], activation_sharding)


def split_residuals(pullback: Pullback, rows: int, activation_sharding) -> Pullback:
    """Pin each residual that carries the batch (rows on its first axis, or on its second
    under the layer axis) to the batch axes. The jitted forward returns the residuals, and
    nothing else fixes their layout: XLA left some replicated (a 0.5B forward held every
    row's float32 attention scores on each of 4 devices). Values are unchanged."""
    if activation_sharding is None:
        return pullback
    mesh, batch_axes = activation_sharding.mesh, activation_sharding.spec[0]

    def pin(x):
        for dim in (0, 1):
            if x.ndim > dim + 1 and x.shape[dim] == rows:
                spec = [None] * x.ndim
                spec[dim] = batch_axes
                return jax.lax.with_sharding_constraint(
                    x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))
        return x

    return jax.tree.map(pin, pullback)


def loss_cotangent(logp_BT, ref_logp_BT, batch: Batch, loss_config: LossConfig, denom=None
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """dL/dlogp_BT of the loss head (KL term included) and the head's metric sums."""
    grad_fn = jax.grad(rl_loss, has_aux=True)
    return grad_fn(logp_BT, ref_logp_BT, batch, loss_config, denom)


def actor_backward(pullback: Pullback, logp_BT, ref_logp_BT, batch: Batch,
                   loss_config: LossConfig, denom=None) -> tuple[Params, dict[str, jax.Array]]:
    """Gradients of the RL loss w.r.t. the params, given the forward's pullback.

    `ref_logp_BT` enters here and only here. `denom` is the step's global normaliser
    (`batch.loss_denominator`); None normalises over this micro-batch.
    """
    cotangent_BT, metrics = loss_cotangent(logp_BT, ref_logp_BT, batch, loss_config, denom)
    (grads,) = pullback(cotangent_BT)
    return grads, metrics


def residual_bytes(pullback: Pullback) -> int:
    """Bytes the pullback keeps alive between forward and backward (parameters included)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pullback))

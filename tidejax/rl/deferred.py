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

Layer by layer (`actor_forward_layerwise` / `actor_backward_layerwise`, what the trainer
runs under remat): the same residuals (each layer's input, the head's pullback, the
parameters), but the backward walks the layers in reverse itself, recomputing each one
and adding its gradients straight into the step's accumulator, which it carries through
the loop and updates in place. A pullback instead returns the whole gradient tree before
it can be added: one more float32 copy of the model per device (9.2 GiB at Qwen2.5-14B on
6 devices). Same chain rule, so the same gradients (tested against `jax.grad`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from tidejax.models import ModelConfig, token_logprobs
from tidejax.models.logprobs import logprobs_of_hidden
from tidejax.models.model import (apply_layer, embed_tokens, final_norm, packed_attend,
                                  packed_mask, pin_activations)
from tidejax.rl.batch import Batch
from tidejax.rl.config import LossConfig
from tidejax.rl.losses import merge_metrics, rl_loss
from tidejax.rl.state import Accum

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


class LayerResiduals(NamedTuple):
    """What the layer-by-layer backward needs: the parameters (the state's own buffers),
    the residual stream entering each layer `[L, B, T, D]` and the head's pullback."""

    params: Params
    layer_inputs: jax.Array
    head: Pullback


def actor_forward_layerwise(model_config: ModelConfig, params: Params, batch: Batch, *,
                            chunk: int = 128, activation_sharding=None,
                            temperature: float = 1.0) -> tuple[jax.Array, LayerResiduals]:
    """`(logp_BT, residuals)`, as `actor_forward` under remat, for the in-place backward."""
    cfg, mask = model_config, packed_mask(batch.segment_ids)

    def layer(x_BTD, layer_params):
        y, _ = apply_layer(cfg, layer_params, x_BTD, batch.positions, packed_attend, None, mask)
        return pin_activations(y, activation_sharding), x_BTD

    x = pin_activations(embed_tokens(cfg, params, batch.tokens), activation_sharding)
    x, inputs = jax.lax.scan(layer, x, params["layers"])

    def head(embedder, x_BTD):
        p = {"embedder": embedder}
        return logprobs_of_hidden(cfg, p, final_norm(cfg, p, x_BTD), batch.tokens,
                                  batch.segment_ids, chunk, temperature)

    logp, head_pullback = jax.vjp(head, params["embedder"], x)
    residuals = LayerResiduals(params, inputs, head_pullback)
    return logp, split_residuals(residuals, batch.tokens.shape[0], activation_sharding)


def actor_backward_layerwise(model_config: ModelConfig, residuals: LayerResiduals, logp_BT,
                             ref_logp_BT, batch: Batch, loss_config: LossConfig, denom,
                             accum: Accum, *, activation_sharding=None) -> Accum:
    """`accum` plus this micro-batch's gradients and metrics, each layer's gradients added
    into the accumulator as the reverse loop produces them."""
    cfg, mask = model_config, packed_mask(batch.segment_ids)
    cotangent_BT, metrics = loss_cotangent(logp_BT, ref_logp_BT, batch, loss_config, denom)
    d_embedder_head, dx = residuals.head(cotangent_BT)

    def layer(layer_params, x_BTD):
        y, _ = apply_layer(cfg, layer_params, x_BTD, batch.positions, packed_attend, None, mask)
        return pin_activations(y, activation_sharding)

    def back(carry, inputs):
        dx_BTD, grads = carry
        index, layer_params, x_BTD = inputs
        _, pullback = jax.vjp(layer, layer_params, x_BTD)
        d_params, dx_BTD = pullback(dx_BTD)
        grads = jax.tree.map(lambda g, d: g.at[index].add(d.astype(g.dtype)), grads, d_params)
        return (pin_activations(dx_BTD, activation_sharding), grads), None

    (dx, layer_grads), _ = jax.lax.scan(
        back, (dx, accum.grads["layers"]),
        (jnp.arange(cfg.num_layers), residuals.params["layers"], residuals.layer_inputs),
        reverse=True)
    _, embed_pullback = jax.vjp(lambda e: embed_tokens(cfg, {"embedder": e}, batch.tokens),
                                residuals.params["embedder"])
    (d_embedder_input,) = embed_pullback(dx)
    embedder = jax.tree.map(lambda a, h, i: a + h.astype(a.dtype) + i.astype(a.dtype),
                            accum.grads["embedder"], d_embedder_head, d_embedder_input)
    return Accum(grads={"embedder": embedder, "layers": layer_grads},
                 metrics=merge_metrics(accum.metrics, metrics))

"""Pure step functions: reference log-probs, fused actor gradients, update, SFT.

All are plain functions of arrays and frozen configs; `tidejax.rl.trainer.Trainer` jits
them once with shardings and donation. A step of several micro-batches is
`accum = zero_accum(params)`, then per micro-batch either the fused `actor_grads`
(colocated mode) or `deferred.actor_forward` + `deferred.actor_backward` (decoupled mode)
added into `accum`, then `apply_update(state, accum)`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from tidejax.models import ModelConfig, token_logprobs
from tidejax.rl.batch import Batch
from tidejax.rl.config import LossConfig, OptimConfig
from tidejax.rl.losses import rl_loss, sft_loss
from tidejax.rl.state import (
    Accum,
    TrainState,
    add_to_accum,
    lr_schedule,
    make_optimizer,
    zero_accum,
)

Params = dict[str, Any]


def ref_logprobs(model_config: ModelConfig, ref_params: Params, batch: Batch, *,
                 chunk: int = 128, activation_sharding=None, temperature: float = 1.0
                 ) -> jax.Array:
    """Reference-model log-probs `[B, T]` (forward only; no gradient flows)."""
    return jax.lax.stop_gradient(token_logprobs(
        model_config, ref_params, batch.tokens, batch.positions, batch.segment_ids,
        chunk=chunk, activation_sharding=activation_sharding, temperature=temperature))


def fused_rl_loss(params: Params, model_config: ModelConfig, batch: Batch, ref_logp_BT,
                  loss_config: LossConfig, denom=None, *, chunk: int = 128,
                  remat: bool = False, activation_sharding=None, temperature: float = 1.0
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The ordinary formulation: log-probs and loss in one forward."""
    logp = token_logprobs(model_config, params, batch.tokens, batch.positions,
                          batch.segment_ids, chunk=chunk, remat=remat,
                          activation_sharding=activation_sharding, temperature=temperature)
    return rl_loss(logp, ref_logp_BT, batch, loss_config, denom)


def actor_grads(model_config: ModelConfig, params: Params, batch: Batch, ref_logp_BT,
                loss_config: LossConfig, denom=None, *, chunk: int = 128, remat: bool = False,
                activation_sharding=None, temperature: float = 1.0
                ) -> tuple[Params, dict[str, jax.Array]]:
    """Fused actor gradients: `jax.grad` of `fused_rl_loss` (needs ref_logp up front)."""
    grad_fn = jax.grad(fused_rl_loss, has_aux=True)
    return grad_fn(params, model_config, batch, ref_logp_BT, loss_config, denom, chunk=chunk,
                   remat=remat, activation_sharding=activation_sharding,
                   temperature=temperature)


def sft_grads(model_config: ModelConfig, params: Params, batch: Batch, denom=None, *,
              chunk: int = 128, remat: bool = False, activation_sharding=None
              ) -> tuple[Params, dict[str, jax.Array]]:
    """Gradients of the masked next-token loss on `batch.loss_mask` tokens."""
    def loss_fn(p):
        logp = token_logprobs(model_config, p, batch.tokens, batch.positions,
                              batch.segment_ids, chunk=chunk, remat=remat,
                              activation_sharding=activation_sharding)
        return sft_loss(logp, batch, denom)

    return jax.grad(loss_fn, has_aux=True)(params)


def apply_update(state: TrainState, accum: Accum, optim_config: OptimConfig
                 ) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update from accumulated gradients; bumps step and policy version.

    Returns finished metrics: loss terms, clip fraction, token count, pre-clip gradient
    norm, learning rate and staleness (versions between a token's policy and this one).
    """
    tx = make_optimizer(optim_config)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), accum.grads, state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    m = accum.metrics
    tokens = jnp.maximum(m["tokens"], 1.0)
    has_tokens = m["tokens"] > 0
    metrics = {
        "loss": m["loss"], "pg_loss": m["pg_loss"], "kl": m["kl"],
        "clip_frac": m["clipped"] / tokens, "is_truncated_frac": m["truncated"] / tokens,
        "tokens": m["tokens"],
        "grad_norm": optax.global_norm(accum.grads),
        "lr": lr_schedule(optim_config)(state.step),
        "staleness_mean": jnp.where(
            has_tokens, state.policy_version - m["version_sum"] / tokens, 0.0),
        "staleness_max": jnp.where(has_tokens, state.policy_version - m["min_version"], 0),
    }
    new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1,
                              policy_version=state.policy_version + 1)
    return new_state, metrics


def sft_step(model_config: ModelConfig, state: TrainState, batch: Batch, denom=None, *,
             optim_config: OptimConfig, chunk: int = 128, remat: bool = False,
             activation_sharding=None) -> tuple[TrainState, dict[str, jax.Array]]:
    """One supervised update on `batch` (masked next-token loss)."""
    grads, metrics = sft_grads(model_config, state.params, batch, denom, chunk=chunk,
                               remat=remat, activation_sharding=activation_sharding)
    return apply_update(state, add_to_accum(zero_accum(state.params), grads, metrics),
                        optim_config)

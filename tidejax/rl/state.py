"""TrainState, the gradient accumulator, and the optimizer built from `OptimConfig`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from tidejax.rl.config import OptimConfig
from tidejax.rl.losses import empty_metrics, merge_metrics

Params = dict[str, Any]


@struct.dataclass
class TrainState:
    """Everything an update changes. `key` is raw uint32 key data (`jax.random.key_data`),
    which checkpoints as a plain array; wrap it with `jax.random.wrap_key_data` to draw."""

    params: Params
    opt_state: optax.OptState
    step: jax.Array  # optimizer updates applied, int32 []
    policy_version: jax.Array  # version of `params`, int32 []; rollout tags tokens with it
    key: jax.Array  # uint32 [2]


@struct.dataclass
class Accum:
    """Gradient and metric sums over the micro-batches of one step (grads in float32)."""

    grads: Params
    metrics: dict[str, jax.Array]


def lr_schedule(config: OptimConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then cosine to `lr * end_lr_ratio` at `total_steps`."""
    if config.total_steps is None:
        raise ValueError("OptimConfig.total_steps is None: a RunConfig sets it to the run's "
                         "steps; set it when building a trainer by hand")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.lr, warmup_steps=config.warmup_steps,
        decay_steps=config.total_steps, end_value=config.lr * config.end_lr_ratio)


def _decay_mask(params: Params) -> Params:
    # Norm scales and biases are not decayed; judge by name, since stacked layers give even
    # a norm scale two dimensions.
    def decays(path, _):
        names = [str(getattr(p, "key", p)) for p in path]
        return not any("norm" in n or n.endswith("bias") for n in names)

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW on the warmup + cosine schedule."""
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(lr_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                    weight_decay=config.weight_decay, mask=_decay_mask),
    )


def init_train_state(params: Params, config: OptimConfig, key: int | jax.Array = 0
                     ) -> TrainState:
    """Fresh optimizer state around `params`; `key` is a seed or raw uint32 key data."""
    if isinstance(key, int):
        key = jax.random.key_data(jax.random.key(key))
    return TrainState(params=params, opt_state=make_optimizer(config).init(params),
                      step=jnp.zeros((), jnp.int32), policy_version=jnp.zeros((), jnp.int32),
                      key=key)


def zero_accum(params: Params) -> Accum:
    return Accum(grads=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
                 metrics=empty_metrics())


def add_to_accum(accum: Accum, grads: Params, metrics: dict[str, jax.Array]) -> Accum:
    return Accum(grads=jax.tree.map(lambda a, g: a + g.astype(jnp.float32), accum.grads, grads),
                 metrics=merge_metrics(accum.metrics, metrics))

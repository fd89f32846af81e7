"""Test doubles for engine users: one tiny engine shape (so tests share compilations) and
random parameters whose greedy continuations are not one repeated token."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from tidejax.models.config import ModelConfig
from tidejax.models.model import Params, abstract_params
from tidejax.models.testing import tiny_config
from tidejax.serving.config import EngineConfig, SamplingParams
from tidejax.serving.engine import Engine, make_engine


def tiny_engine_config(**changes) -> EngineConfig:
    """Small pool, 4 slots, two prefill buckets: compiles in seconds on a CPU."""
    base = EngineConfig(page_size=8, num_pages=64, max_slots=4, max_pages_per_seq=16,
                        prefill_buckets=(16, 64), max_stop_tokens=4,
                        sampling=SamplingParams.greedy(max_new_tokens=16))
    return base.replace(**changes)


def random_params(config: ModelConfig | None = None, seed: int = 0, std: float = 0.16,
                  on_device: bool = False) -> Params:
    """Random parameters in the model's tree (fast: no model init).

    The default std is 8x the model's init std: at init scale the tiny model's logits are
    nearly flat and greedy decoding repeats one token, which tests nothing. Norm scales
    are 1, biases small; arrays are in the config's dtype. Drawn with numpy on the host,
    or with `on_device` by jax.random on the default device (7B shapes: seconds instead of
    minutes of host sampling and a 30 GB float32 host copy; other values for the same seed).
    """
    config = config or tiny_config()
    rng = np.random.default_rng(seed)
    dtype = config.jnp_dtype
    leaf_index = itertools.count()

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return jnp.ones(leaf.shape, dtype)
        sigma = 0.02 if "bias" in name else std
        if on_device:
            normal = jax.jit(lambda key: (sigma * jax.random.normal(key, leaf.shape))
                             .astype(dtype))
            return normal(jax.random.fold_in(jax.random.key(seed), next(leaf_index)))
        return jnp.asarray(rng.normal(0.0, sigma, leaf.shape).astype(np.float32), dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract_params(config))


def tiny_engine(engine_config: EngineConfig | None = None, params: Params | None = None,
                devices=None) -> Engine:
    config = tiny_config()
    return make_engine(config, params if params is not None else random_params(config), devices,
                       engine_config or tiny_engine_config())

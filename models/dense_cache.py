"""A contiguous per-sequence KV cache: the reference the paged engine is checked against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tidejax.models.config import ModelConfig
from tidejax.models.model import gqa_attention


def init_dense_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> dict:
    """K/V buffers `[L, B, S, K, H]`, zero-filled."""
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    dtype = dtype or config.jnp_dtype
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def dense_attend(q_BTNH, k_BTKH, v_BTKH, layer_cache, positions_BT):
    """Write this step's K/V at `positions_BT`, then attend causally over the row's cache."""
    write = jax.vmap(lambda buf, pos, new: buf.at[pos].set(new.astype(buf.dtype)))
    k_cache = write(layer_cache["k"], positions_BT, k_BTKH)
    v_cache = write(layer_cache["v"], positions_BT, v_BTKH)
    key_pos = jnp.arange(k_cache.shape[1])
    mask_BTS = key_pos[None, None, :] <= positions_BT[:, :, None]
    out = gqa_attention(q_BTNH, k_cache.astype(q_BTNH.dtype), v_cache.astype(q_BTNH.dtype), mask_BTS)
    return out, {"k": k_cache, "v": v_cache}

"""Qwen2 building blocks as Flax NNX modules.

Why NNX: it is Flax's recommended API, modules read like the architecture, and every
parameter carries its logical axis names as metadata. Hot loops never call modules
through `nnx.jit`; `models.model` keeps parameters as a plain dict (for optax, Orbax and
HF loading) and merges them into these modules inside its own jitted pure functions.

The attention *core* is not part of the layer: `DecoderLayer.__call__` takes an
`attend` callable, so training uses packed dense attention and serving plugs in a KV
cache (dense or paged) without touching the projections.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from tidejax.models.config import ModelConfig

# attend(q_BTNH, k_BTKH, v_BTKH, layer_cache, aux) -> (out_BTNH, layer_cache)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, Any, Any], tuple[jax.Array, Any]]

_INIT_STD = 0.02


def project(spec: str, x, kernel):
    """`einsum(spec, x, kernel)` accumulated in float32 and returned in `x`'s dtype.

    The same arithmetic GPUs do for a bf16 matmul; asking for it explicitly also keeps
    XLA CPU from materialising float32 copies of bf16 weights (a layer's worth per matmul,
    measured by `memory_analysis()`), so CPU compiles account memory the way GPUs use it.
    """
    return jnp.einsum(spec, x, kernel, preferred_element_type=jnp.float32).astype(x.dtype)


def _param(rngs: nnx.Rngs, shape, axes, dtype, kind: str = "normal") -> nnx.Param:
    if kind == "normal":
        value = _INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif kind == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        value = jnp.zeros(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs):
        self.scale = _param(rngs, (dim,), ("embed",), dtype, "ones")
        self.eps = eps

    def __call__(self, x):
        # Normalise in float32 (as HF does) and cast back: bf16 variance loses too much.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.scale[...].astype(jnp.float32) * x32).astype(x.dtype)


def rope(x_BTnH: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding in the half-split layout Qwen2/LLaMA use."""
    head_dim = x_BTnH.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions_BT[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x_BTnH.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTnH.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, n, k, h, dt = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_dtype
        self.q_kernel = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), dt)
        self.k_kernel = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dt)
        self.v_kernel = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dt)
        self.o_kernel = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"), dt)
        if cfg.qkv_bias:
            self.q_bias = _param(rngs, (n, h), ("heads", "head_dim"), dt, "zeros")
            self.k_bias = _param(rngs, (k, h), ("kv_heads", "head_dim"), dt, "zeros")
            self.v_bias = _param(rngs, (k, h), ("kv_heads", "head_dim"), dt, "zeros")
        self.qkv_bias = cfg.qkv_bias
        self.rope_theta = cfg.rope_theta

    def __call__(self, x_BTD, positions_BT, attend: AttendFn, layer_cache, aux):
        q = project("btd,dnh->btnh", x_BTD, self.q_kernel[...])
        k = project("btd,dkh->btkh", x_BTD, self.k_kernel[...])
        v = project("btd,dkh->btkh", x_BTD, self.v_kernel[...])
        if self.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        q = rope(q, positions_BT, self.rope_theta)
        k = rope(k, positions_BT, self.rope_theta)
        out_BTNH, layer_cache = attend(q, k, v, layer_cache, aux)
        out = project("btnh,nhd->btd", out_BTNH.astype(x_BTD.dtype), self.o_kernel[...])
        return out, layer_cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, dt = cfg.hidden_size, cfg.intermediate_size, cfg.jnp_dtype
        self.gate_kernel = _param(rngs, (d, f), ("embed", "mlp"), dt)
        self.up_kernel = _param(rngs, (d, f), ("embed", "mlp"), dt)
        self.down_kernel = _param(rngs, (f, d), ("mlp", "embed"), dt)

    def __call__(self, x_BTD):
        gate = jax.nn.silu(project("...d,df->...f", x_BTD, self.gate_kernel[...]))
        up = project("...d,df->...f", x_BTD, self.up_kernel[...])
        return project("...f,fd->...d", gate * up, self.down_kernel[...])


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_dtype, rngs)
        self.attn = Attention(cfg, rngs)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_dtype, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_BTD, positions_BT, attend: AttendFn, layer_cache, aux):
        attn_out, layer_cache = self.attn(self.input_norm(x_BTD), positions_BT, attend,
                                          layer_cache, aux)
        x_BTD = x_BTD + attn_out
        return x_BTD + self.mlp(self.post_norm(x_BTD)), layer_cache


class Embedder(nnx.Module):
    """Token embedding, final norm and output projection (tied or untied)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = cfg.jnp_dtype
        # An untied input table only feeds the lookup; its own name lets trainers shard it
        # on the model dim (see sharding.TRAIN_RULES), a tied one also makes the logits.
        table_vocab = "vocab" if cfg.tie_word_embeddings else "input_vocab"
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.hidden_size), (table_vocab, "embed"),
                                dt)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dt)
        self.tied = cfg.tie_word_embeddings

    def embed(self, tokens_BT):
        return jnp.take(self.embedding[...], tokens_BT, axis=0)

    def output_kernel_DV(self):
        return self.embedding[...].T if self.tied else self.lm_head[...]

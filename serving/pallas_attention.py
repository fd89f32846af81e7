"""Decode attention as a Pallas kernel that reads only each slot's live pages.

The engine's pool stays as it is, `[L, P, page_size, K, H]` for all layers: the kernel
takes the whole stacked pool and the layer index, so no layer slice is copied out for it
(a custom call's operand must be a buffer of its own). One program per (slot, KV head)
walks the slot's page table up to its cached length, a few pages per step, with an online
softmax in float32, then folds in the new token's key and value, which the engine writes
into the pool only after the layer loop. Pages past a slot's length are never read,
whatever the attention span.

`paged_decode_attention` runs compiled on a GPU (Triton) and in Pallas's interpreter
elsewhere (tests: parity with `gather_kernel`); the engine uses it for decode when
`EngineConfig.attention == "pallas"` and keeps the gather for prefill chunks.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

# Triton's dot needs at least 16 rows: a KV head's query group (7 at Qwen2.5-7B) is padded.
_MIN_ROWS = 16
_PAGES_PER_BLOCK = 4  # at most; a divisor of the page table's width
_NEG_INF = -1e30  # finite: a slot with no cached token must not compute exp(-inf + inf)


def _decode_kernel(layer_ref, length_ref, table_ref, q_ref, k_new_ref, v_new_ref, k_pool_ref,
                   v_pool_ref, out_ref, *, page_size: int, pages_per_block: int):
    """One slot, one KV head: q `[G, H]` over the slot's cached pages, `pages_per_block`
    pages per step, then the new token."""
    layer = layer_ref[0]
    length = length_ref[0]
    q = q_ref[...]  # [G, H], pre-scaled by 1/sqrt(H), in the pool's dtype
    rows, head_dim = q.shape
    block = pages_per_block * page_size  # keys per step

    def one_block(i, carry):
        out, row_max, row_sum = carry
        pages = table_ref[pl.ds(i * pages_per_block, pages_per_block)]
        k = k_pool_ref[layer, pages].reshape(block, head_dim)
        v = v_pool_ref[layer, pages].reshape(block, head_dim)
        scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [G, block]
        position = i * block + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = jnp.where(position < length, scores, _NEG_INF)
        new_max = jnp.maximum(row_max, scores.max(axis=1))
        correction = jnp.exp(row_max - new_max)
        probs = jnp.exp(scores - new_max[:, None])
        out = out * correction[:, None] + jnp.dot(probs.astype(v.dtype), v,
                                                  preferred_element_type=jnp.float32)
        return out, new_max, row_sum * correction + probs.sum(axis=1)

    carry = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _NEG_INF, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    out, row_max, row_sum = jax.lax.fori_loop(0, pl.cdiv(length, block), one_block, carry)
    # The new token: always visible to itself.
    k_new = k_new_ref[...].astype(jnp.float32)  # [H]
    v_new = v_new_ref[...].astype(jnp.float32)
    score = (q.astype(jnp.float32) * k_new[None, :]).sum(axis=1)  # [G]
    new_max = jnp.maximum(row_max, score)
    correction = jnp.exp(row_max - new_max)
    weight = jnp.exp(score - new_max)
    out = out * correction[:, None] + weight[:, None] * v_new[None, :]
    row_sum = row_sum * correction + weight
    out_ref[...] = (out / row_sum[:, None]).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def paged_decode_attention(q_BNH, k_new_BKH, v_new_BKH, k_pool_LPSKH, v_pool_LPSKH, layer,
                           page_table_BP, cached_len_B, interpret: bool = False) -> jax.Array:
    """One decode token per slot: `q_BNH` attends to its slot's first `cached_len_B` pooled
    tokens of layer `layer` (int32 scalar) and to its own new key/value. Returns `[B, N, H]`."""
    batch, heads, head_dim = q_BNH.shape
    layers, pages, page_size, kv_heads, _ = k_pool_LPSKH.shape
    group = heads // kv_heads
    rows = max(_MIN_ROWS, pl.next_power_of_2(group))
    q = (q_BNH.astype(jnp.float32) * head_dim ** -0.5).astype(q_BNH.dtype)
    q = q.reshape(batch, kv_heads, group, head_dim)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    max_pages = page_table_BP.shape[1]
    # Several pages per step: bigger loads, fewer dependent steps (a step reads up to 64
    # keys). A block past the slot's last page reads table padding (the trash page), masked.
    pages_per_block = math.gcd(max_pages, _PAGES_PER_BLOCK)
    pool_spec = pl.BlockSpec((layers, pages, page_size, None, head_dim),
                             lambda b, h: (0, 0, 0, h, 0))
    out = pl.pallas_call(
        functools.partial(_decode_kernel, page_size=page_size,
                          pages_per_block=pages_per_block),
        grid=(batch, kv_heads),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h: (0,)),  # layer
            pl.BlockSpec((None, 1), lambda b, h: (b, 0)),  # cached length
            pl.BlockSpec((None, max_pages), lambda b, h: (b, 0)),  # page table row
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h: (b, h, 0, 0)),  # q
            pl.BlockSpec((None, None, head_dim), lambda b, h: (b, h, 0)),  # new key
            pl.BlockSpec((None, None, head_dim), lambda b, h: (b, h, 0)),  # new value
            pool_spec, pool_spec,
        ],
        out_specs=pl.BlockSpec((None, None, rows, head_dim), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, rows, head_dim), q_BNH.dtype),
        interpret=interpret,
        # Triton, not Mosaic GPU: Mosaic stages whole blocks in shared memory, and a
        # block here is a KV head's whole pool, read page by page through the table.
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        name="tidejax_paged_decode",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), cached_len_B.astype(jnp.int32)[:, None],
      page_table_BP.astype(jnp.int32), q, k_new_BKH, v_new_BKH, k_pool_LPSKH, v_pool_LPSKH)
    return out[:, :, :group].reshape(batch, heads, head_dim)

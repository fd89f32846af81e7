"""Paged attention over a layer-stacked KV page pool, as a `forward_with_cache` hook.

Layout: `k_pages`/`v_pages` are `[L, P, page_size, K, H]`; a sequence's page table
`[B, Pmax]` lists the pool pages holding its positions `0 .. Pmax*page_size-1` in order.

One hook serves decode (T = 1) and prefill over a cached prefix (T = bucket): each query
attends to the sequence's `cached_len` tokens already in the pool plus, causally, the
chunk's own new keys. The hook never writes the pool: it returns the chunk's K/V as the
scan output, and `write_kv` scatters all layers' new K/V into the (donated) pool once
after the layer scan. Writing inside the scan would rebuild a layer slice per layer.

The attention core is a *kernel* chosen by name (`KERNELS`), so a Pallas / GPU paged
kernel can replace the plain-JAX gather without touching the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from tidejax.models.model import gqa_attention


class PagedAux(NamedTuple):
    """What every layer needs; reaches the hook unchanged through `forward_with_cache`."""

    k_pages: jax.Array  # [L, P, page_size, K, H], read-only here
    v_pages: jax.Array
    page_table_BP: jax.Array  # int32 pool page ids; unused entries point at any page
    cached_len_B: jax.Array  # int32 tokens of each sequence already in the pool
    kernel: str  # static: a key of KERNELS


# kernel(q_BTNH, k_new_BTKH, v_new_BTKH, k_pages_PSKH, v_pages_PSKH, page_table_BP,
#        cached_len_B) -> out_BTNH, with *_PSKH one layer's pages.
Kernel = Callable[..., jax.Array]


def gather_kernel(q_BTNH, k_new_BTKH, v_new_BTKH, k_pages_PSKH, v_pages_PSKH, page_table_BP,
                  cached_len_B) -> jax.Array:
    """Gather each sequence's pages into a contiguous `[B, Pmax*page_size, K, H]` view."""
    batch, chunk = q_BTNH.shape[:2]
    num_kv, head_dim = k_pages_PSKH.shape[2:]
    k_cached = k_pages_PSKH[page_table_BP].reshape(batch, -1, num_kv, head_dim)
    v_cached = v_pages_PSKH[page_table_BP].reshape(batch, -1, num_kv, head_dim)
    span = k_cached.shape[1]
    # Cached keys are visible below cached_len; the chunk's keys causally within it.
    cached_mask_BTS = jnp.broadcast_to(
        jnp.arange(span)[None, None, :] < cached_len_B[:, None, None], (batch, chunk, span))
    new_mask_BTT = jnp.broadcast_to(jnp.tril(jnp.ones((chunk, chunk), bool)),
                                    (batch, chunk, chunk))
    dtype = q_BTNH.dtype
    k_all = jnp.concatenate([k_cached.astype(dtype), k_new_BTKH.astype(dtype)], axis=1)
    v_all = jnp.concatenate([v_cached.astype(dtype), v_new_BTKH.astype(dtype)], axis=1)
    mask = jnp.concatenate([cached_mask_BTS, new_mask_BTT], axis=-1)
    return gqa_attention(q_BTNH, k_all, v_all, mask)


KERNELS: dict[str, Kernel] = {"gather": gather_kernel}


class PackedAux(NamedTuple):
    """A packed prefill chunk: `T` new tokens of up to `R` requests (segments) in one row."""

    k_pages: jax.Array  # [L, P, page_size, K, H], read-only here
    v_pages: jax.Array
    page_table_RP: jax.Array  # each segment's pages (only the first span pages are read)
    cached_len_R: jax.Array  # tokens of each segment already in the pool
    segment_T: jax.Array  # int32 segment of each token, -1 for padding


def packed_gather_attention(q_TNH, k_new_TKH, v_new_TKH, k_pages_PSKH, v_pages_PSKH,
                            page_table_RP, cached_len_R, segment_T) -> jax.Array:
    """Each token attends to its own segment's cached keys and, causally, to its segment's
    new keys in the chunk (tokens of a segment are contiguous and in position order)."""
    segments = page_table_RP.shape[0]
    num_kv, head_dim = k_pages_PSKH.shape[2:]
    k_cached = k_pages_PSKH[page_table_RP].reshape(1, -1, num_kv, head_dim)  # [1, R*S, K, H]
    v_cached = v_pages_PSKH[page_table_RP].reshape(1, -1, num_kv, head_dim)
    span = k_cached.shape[1] // segments
    key_segment_S = jnp.repeat(jnp.arange(segments), span)
    key_position_S = jnp.tile(jnp.arange(span), segments)
    cached_mask_TS = ((segment_T[:, None] == key_segment_S[None])
                      & (key_position_S[None] < cached_len_R[key_segment_S][None]))
    chunk = q_TNH.shape[0]
    new_mask_TT = ((segment_T[:, None] == segment_T[None]) & (segment_T[None] >= 0)
                   & jnp.tril(jnp.ones((chunk, chunk), bool)))
    dtype = q_TNH.dtype
    k_all = jnp.concatenate([k_cached.astype(dtype), k_new_TKH[None].astype(dtype)], axis=1)
    v_all = jnp.concatenate([v_cached.astype(dtype), v_new_TKH[None].astype(dtype)], axis=1)
    mask = jnp.concatenate([cached_mask_TS, new_mask_TT], axis=-1)[None]
    return gqa_attention(q_TNH[None], k_all, v_all, mask)[0]


def packed_attend(q_BTNH, k_BTKH, v_BTKH, layer, aux: PackedAux):
    """The `attend` hook of a packed prefill (B = 1); `layer` is this layer's index."""
    k_pages = jax.lax.dynamic_index_in_dim(aux.k_pages, layer, 0, keepdims=False)
    v_pages = jax.lax.dynamic_index_in_dim(aux.v_pages, layer, 0, keepdims=False)
    out = packed_gather_attention(q_BTNH[0], k_BTKH[0], v_BTKH[0], k_pages, v_pages,
                                  aux.page_table_RP, aux.cached_len_R, aux.segment_T)
    return out[None], (k_BTKH, v_BTKH)


def paged_attend(q_BTNH, k_BTKH, v_BTKH, layer, aux: PagedAux):
    """The `attend` hook. `layer` (the scanned cache slice) is this layer's index."""
    k_pages = jax.lax.dynamic_index_in_dim(aux.k_pages, layer, 0, keepdims=False)
    v_pages = jax.lax.dynamic_index_in_dim(aux.v_pages, layer, 0, keepdims=False)
    out = KERNELS[aux.kernel](q_BTNH, k_BTKH, v_BTKH, k_pages, v_pages, aux.page_table_BP,
                              aux.cached_len_B)
    return out, (k_BTKH, v_BTKH)


def write_slots(page_table_BP: jax.Array, positions_BT: jax.Array, valid_BT: jax.Array,
                page_size: int, trash_page: int) -> tuple[jax.Array, jax.Array]:
    """Pool (page, offset) for each token; invalid tokens go to the trash page."""
    index_BT = jnp.clip(positions_BT // page_size, 0, page_table_BP.shape[1] - 1)
    page_BT = jnp.take_along_axis(page_table_BP, index_BT, axis=1)
    page_BT = jnp.where(valid_BT, page_BT, trash_page)
    return page_BT, positions_BT % page_size


def write_kv(pages_LPSKH: jax.Array, new_LBTKH: jax.Array, page_BT: jax.Array,
             offset_BT: jax.Array) -> jax.Array:
    """Scatter every layer's new K (or V) into the pool; in place when the pool is donated."""
    return pages_LPSKH.at[:, page_BT, offset_BT].set(new_LBTKH.astype(pages_LPSKH.dtype))

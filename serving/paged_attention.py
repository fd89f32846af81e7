"""Paged attention over a layer-stacked KV page pool, as a `forward_with_cache` hook.

Layout: `k_pages`/`v_pages` are `[L, P, page_size, K, H]`; a sequence's page table
`[B, Pmax]` lists the pool pages holding its positions `0 .. Pmax*page_size-1` in order.

One hook serves decode (T = 1) and prefill over a cached prefix (T = bucket): each query
attends to the sequence's `cached_len` tokens already in the pool plus, causally, the
chunk's own new keys. The hook never writes the pool: it returns the chunk's K/V as the
scan output, and `write_kv` scatters all layers' new K/V into the (donated) pool once
after the layer scan. Writing inside the scan would rebuild a layer slice per layer.

The attention core is a *kernel* chosen by name (`KERNELS`): "gather" (plain JAX: each
row's pages gathered into a contiguous view) or "pallas" (decode through
`serving.pallas_attention`, which reads only live pages; prefill chunks gather).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from tidejax.models.model import gqa_attention
from tidejax.serving.pallas_attention import paged_decode_attention


class PagedAux(NamedTuple):
    """What every layer needs; reaches the hook unchanged through `forward_with_cache`."""

    k_pages: jax.Array  # [L, P, page_size, K, H], read-only here
    v_pages: jax.Array
    page_table_BP: jax.Array  # int32 pool page ids; unused entries point at any page
    cached_len_B: jax.Array  # int32 tokens of each sequence already in the pool
    kernel: Kernel  # static: `bind_kernel`'s


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


def _gather_layer(q_BTNH, k_new_BTKH, v_new_BTKH, k_pool, v_pool, layer, page_table_BP,
                  cached_len_B) -> jax.Array:
    k_pages = jax.lax.dynamic_index_in_dim(k_pool, layer, 0, keepdims=False)
    v_pages = jax.lax.dynamic_index_in_dim(v_pool, layer, 0, keepdims=False)
    return gather_kernel(q_BTNH, k_new_BTKH, v_new_BTKH, k_pages, v_pages, page_table_BP,
                         cached_len_B)


def _pallas_layer(q_BTNH, k_new_BTKH, v_new_BTKH, k_pool, v_pool, layer, page_table_BP,
                  cached_len_B, mesh: Mesh | None = None) -> jax.Array:
    """Decode tokens through the Pallas kernel (interpreted off GPUs); prefill chunks
    through the gather. On a tensor-parallel rank (`mesh` with a "tensor" axis over the
    pool's KV heads) each device runs the kernel on its own heads: a custom call is not
    partitioned by XLA, which would otherwise gather the whole pool onto every device."""
    if q_BTNH.shape[1] != 1:
        return _gather_layer(q_BTNH, k_new_BTKH, v_new_BTKH, k_pool, v_pool, layer,
                             page_table_BP, cached_len_B)

    def kernel(q, k_new, v_new, k_pool, v_pool, layer, page_table, cached_len):
        return paged_decode_attention(q, k_new, v_new, k_pool, v_pool, layer, page_table,
                                      cached_len, interpret=jax.default_backend() != "gpu")

    args = (q_BTNH[:, 0], k_new_BTKH[:, 0], v_new_BTKH[:, 0], k_pool, v_pool, layer,
            page_table_BP, cached_len_B)
    tensor = 1 if mesh is None else mesh.shape.get("tensor", 1)
    if tensor > 1 and k_pool.shape[3] % tensor == 0:
        heads = PartitionSpec(None, "tensor", None)
        pool = PartitionSpec(None, None, None, "tensor", None)
        kernel = jax.shard_map(kernel, mesh=mesh, in_specs=(
            heads, heads, heads, pool, pool, PartitionSpec(), PartitionSpec(), PartitionSpec()),
            out_specs=heads, check_vma=False)
    return kernel(*args)[:, None]


# kernel(q_BTNH, k_new_BTKH, v_new_BTKH, k_pool_LPSKH, v_pool_LPSKH, layer, page_table_BP,
#        cached_len_B) -> out_BTNH: the whole stacked pool and the layer's index, so a kernel
# that is a custom call reads the layer in place.
KERNELS: dict[str, Kernel] = {"gather": _gather_layer, "pallas": _pallas_layer}


def bind_kernel(name: str, mesh: Mesh | None = None) -> Kernel:
    """The kernel `name` for a rank on `mesh` (None: one device), as `PagedAux` carries it."""
    return functools.partial(_pallas_layer, mesh=mesh) if name == "pallas" else KERNELS[name]


class PackedAux(NamedTuple):
    """A packed prefill call: `R` rows of `C` new tokens, each row one piece of one request
    (a request's piece spans consecutive rows; only its last row pads)."""

    k_pages: jax.Array  # [L, P, page_size, K, H], read-only here
    v_pages: jax.Array
    page_table_RP: jax.Array  # each row's request's pages
    cached_len_R: jax.Array  # tokens of the row's request in the pool before this call
    segment_R: jax.Array  # int32 request of each row within the call, -1 for an empty row
    position_RC: jax.Array  # int32 position of each token in its sequence
    real_RC: jax.Array  # bool: a real token (not row padding)


def packed_gather_attention(q_RCNH, k_new_RCKH, v_new_RCKH, k_pages_PSKH, v_pages_PSKH,
                            page_table_RP, cached_len_R, segment_R, position_RC, real_RC
                            ) -> jax.Array:
    """Each row attends to its own request's cached pages (gathered per row, so a call's
    memory grows with its rows, not with the engine's slots) and to the new keys of the
    whole call that belong to the same request, causally by position."""
    rows, chunk = q_RCNH.shape[:2]
    num_kv, head_dim = k_pages_PSKH.shape[2:]
    k_cached = k_pages_PSKH[page_table_RP].reshape(rows, -1, num_kv, head_dim)
    v_cached = v_pages_PSKH[page_table_RP].reshape(rows, -1, num_kv, head_dim)
    span = k_cached.shape[1]
    cached_mask_RCS = jnp.broadcast_to(
        jnp.arange(span)[None, None, :] < cached_len_R[:, None, None], (rows, chunk, span))
    # Keys of the call: every row's new tokens, flattened; a row sees its request's only.
    key_segment_T = jnp.repeat(segment_R, chunk)
    key_position_T = position_RC.reshape(-1)
    key_real_T = real_RC.reshape(-1)
    new_mask_RCT = ((key_segment_T[None, None] == segment_R[:, None, None])
                    & key_real_T[None, None]
                    & (key_position_T[None, None] <= position_RC[:, :, None]))
    dtype = q_RCNH.dtype

    def call_keys(x_RCKH):
        flat = x_RCKH.reshape(1, rows * chunk, num_kv, head_dim).astype(dtype)
        return jnp.broadcast_to(flat, (rows, rows * chunk, num_kv, head_dim))

    k_all = jnp.concatenate([k_cached.astype(dtype), call_keys(k_new_RCKH)], axis=1)
    v_all = jnp.concatenate([v_cached.astype(dtype), call_keys(v_new_RCKH)], axis=1)
    mask = jnp.concatenate([cached_mask_RCS, new_mask_RCT], axis=-1)
    return gqa_attention(q_RCNH, k_all, v_all, mask)


def packed_attend(q_RCNH, k_RCKH, v_RCKH, layer, aux: PackedAux):
    """The `attend` hook of a packed prefill (rows as the batch); `layer` is this layer's
    index."""
    k_pages = jax.lax.dynamic_index_in_dim(aux.k_pages, layer, 0, keepdims=False)
    v_pages = jax.lax.dynamic_index_in_dim(aux.v_pages, layer, 0, keepdims=False)
    out = packed_gather_attention(q_RCNH, k_RCKH, v_RCKH, k_pages, v_pages, aux.page_table_RP,
                                  aux.cached_len_R, aux.segment_R, aux.position_RC, aux.real_RC)
    return out, (k_RCKH, v_RCKH)


def paged_attend(q_BTNH, k_BTKH, v_BTKH, layer, aux: PagedAux):
    """The `attend` hook. `layer` (the scanned cache slice) is this layer's index."""
    out = aux.kernel(q_BTNH, k_BTKH, v_BTKH, aux.k_pages, aux.v_pages, layer,
                     aux.page_table_BP, aux.cached_len_B)
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

"""Pure functional Qwen2 forward over a plain parameter dict.

Parameters are `{"embedder": {...}, "layers": {... stacked on a leading layer axis}}`;
layers run under `jax.lax.scan`, so compile time does not grow with depth. Serving holds
`layers` as a tuple of per-layer dicts instead (`unstack_layers`) and runs them unrolled:
a scan slices each layer's weights out of the stack, and XLA copies a slice that feeds a
matmul, for every layer of every decoded token (`scripts/layer_scan_probe.py`: a
memory-bound decode stack takes 1.6x as long on CPU). Each module
is rebuilt from its dict with `nnx.merge` inside the traced function (no closures over
state, nothing mutable crosses a jit boundary).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tidejax.models.config import ModelConfig
from tidejax.models.layers import AttendFn, DecoderLayer, Embedder

Params = dict[str, Any]

_NEG_INF = -1e30  # finite, so fully masked rows never produce NaN


@functools.lru_cache(maxsize=64)
def _graphdefs(config: ModelConfig):
    layer = nnx.eval_shape(lambda: DecoderLayer(config, nnx.Rngs(0)))
    embedder = nnx.eval_shape(lambda: Embedder(config, nnx.Rngs(0)))
    return nnx.split(embedder), nnx.split(layer)


def init_params(config: ModelConfig, key: jax.Array) -> Params:
    """Random parameters (normal(0.02) kernels, zero biases, unit norms)."""
    embed_key, layers_key = jax.random.split(key)

    def one_layer(k):
        return nnx.split(DecoderLayer(config, nnx.Rngs(params=k)))[1].to_pure_dict()

    layers = jax.vmap(one_layer)(jax.random.split(layers_key, config.num_layers))
    embedder = nnx.split(Embedder(config, nnx.Rngs(params=embed_key)))[1].to_pure_dict()
    return {"embedder": embedder, "layers": layers}


def abstract_params(config: ModelConfig) -> Params:
    """Shapes and dtypes of `init_params` without allocating anything."""
    return jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))


def logical_axes(config: ModelConfig) -> Params:
    """Logical axis names for every parameter, same tree as `init_params`."""
    (_, embed_state), (_, layer_state) = _graphdefs(config)

    def names(state, prefix=()):
        return jax.tree.map(lambda v: prefix + tuple(v.get_metadata()["logical_axes"]),
                            state, is_leaf=lambda x: isinstance(x, nnx.Variable))

    embed_axes = names(embed_state).to_pure_dict()
    layer_axes = names(layer_state, ("layers",)).to_pure_dict()
    return {"embedder": embed_axes, "layers": layer_axes}


@functools.lru_cache(maxsize=64)
def _logical_shapes(config: ModelConfig):
    """(embedder leaf shapes, one layer's leaf shapes) of the unpadded model."""
    shapes = jax.tree.map(lambda a: a.shape, abstract_params(config))
    return shapes["embedder"], jax.tree.map(lambda s: s[1:], shapes["layers"],
                                             is_leaf=is_shape)


def crop_to(tree, shapes):
    """`tree`'s leaves cut to `shapes` (a tree of shape tuples). Trainers store the model
    dim padded so that it shards evenly on any mesh size (`sharding.stored_abstract`); the
    model computes on the real shapes, and the gradient of the cut is zero on the padding,
    which therefore stays zero. A no-op on unpadded leaves."""
    def crop(shape, x):
        if x.shape == shape:
            return x
        return x[tuple(slice(0, n) for n in shape)]

    return jax.tree.map(crop, shapes, tree, is_leaf=is_shape)


def is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def cast_floating(tree, dtype):
    """Floating-point leaves of `tree` in `dtype` (integer leaves and same-dtype leaves
    pass through untouched, so a float32 model casts nothing)."""
    def cast(x):
        return x.astype(dtype) if (jnp.issubdtype(x.dtype, jnp.floating)
                                   and x.dtype != dtype) else x

    return jax.tree.map(cast, tree)


def param_count(params: Params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


def default_positions(tokens_BT: jax.Array, segment_ids_BT: jax.Array | None) -> jax.Array:
    """Index of each token inside its own segment (0.. for each packed sequence)."""
    batch, length = tokens_BT.shape
    t = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    if segment_ids_BT is None:
        return t
    starts = jnp.concatenate(
        [jnp.ones((batch, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    segment_start = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)
    return t - segment_start


def gqa_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS) -> jax.Array:
    """Softmax attention with grouped KV heads; scores in float32."""
    b, t, n, h = q_BTNH.shape
    kv = k_BSKH.shape[2]
    q = q_BTNH.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k_BSKH, preferred_element_type=jnp.float32)
    scores = scores * (h ** -0.5)
    scores = jnp.where(mask_BTS[:, None, None], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKH.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_BSKH,
                     preferred_element_type=jnp.float32).astype(v_BSKH.dtype)
    return out.reshape(b, t, n, h)


ATTENTION_BLOCK = 256  # query block of the causal block-skipping path
# From this row length on, query blocks run in a loop (`lax.map`) against every key, each
# block's float32 scores and probabilities recomputed in the backward pass: one block's
# are alive at a time. Unrolled with causal skipping, XLA keeps every block's at once
# (a Qwen2.5-14B backward on 6 devices, two 4,096-token rows each: about 7 GiB per device
# of scores). The loop attends to the masked upper triangle too, about 7% more of a 14B
# layer's FLOPs at 4,096 tokens; below this length the triangle is a few MiB per head and
# skipping it saves more (small models, where attention is most of a layer's FLOPs).
ATTENTION_LOOP_FROM = 2048


def packed_attend(q, k, v, layer_cache, mask_BTS):
    """Training attention: causal within each packed segment, no cache.

    Long rows go block by block: below `ATTENTION_LOOP_FROM`, query block i only meets
    keys [0, end of block i), so the fully masked upper triangle is never computed; from
    it on, blocks loop over all keys with one block's scores alive (same result).
    """
    length = q.shape[1]
    if length <= ATTENTION_BLOCK or length % ATTENTION_BLOCK:
        return gqa_attention(q, k, v, mask_BTS), layer_cache
    if length >= ATTENTION_LOOP_FROM:
        return _looped_blocks(q, k, v, mask_BTS), layer_cache
    outs = []
    for start in range(0, length, ATTENTION_BLOCK):
        end = start + ATTENTION_BLOCK
        outs.append(gqa_attention(q[:, start:end], k[:, :end], v[:, :end],
                                  mask_BTS[:, start:end, :end]))
    return jnp.concatenate(outs, axis=1), layer_cache


def _looped_blocks(q_BTNH, k_BSKH, v_BSKH, mask_BTS) -> jax.Array:
    batch, length = q_BTNH.shape[:2]
    blocks = length // ATTENTION_BLOCK

    def split(x):  # [B, T, ...] -> [blocks, B, ATTENTION_BLOCK, ...]
        return x.reshape(batch, blocks, ATTENTION_BLOCK, *x.shape[2:]).swapaxes(0, 1)

    @jax.checkpoint
    def block(q_block, mask_block):
        return gqa_attention(q_block, k_BSKH, v_BSKH, mask_block)

    out = jax.lax.map(lambda xs: block(*xs), (split(q_BTNH), split(mask_BTS)))
    return out.swapaxes(0, 1).reshape(q_BTNH.shape)


def packed_mask(segment_ids_BT: jax.Array) -> jax.Array:
    length = segment_ids_BT.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    same = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    return same & causal[None]


def unstack_layers(params: Params) -> Params:
    """`layers` as a tuple of per-layer dicts (a no-op when it already is one)."""
    if isinstance(params["layers"], tuple):
        return params
    count = jax.tree.leaves(params["layers"])[0].shape[0]
    layers = tuple(jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(count))
    return {**params, "layers": layers}


def stack_layers(params: Params) -> Params:
    """The inverse of `unstack_layers` (a no-op on stacked parameters)."""
    if not isinstance(params["layers"], tuple):
        return params
    return {**params, "layers": jax.tree.map(lambda *a: jnp.stack(a), *params["layers"])}


def run_layers(config: ModelConfig, params: Params, tokens_BT, positions_BT,
               attend: AttendFn, cache: Any, aux: Any, remat: bool = False,
               activation_sharding=None):
    """Embed, run the decoder stack under scan, final norm. Returns (hidden_BTD, cache).

    Computes in `config.dtype` whatever dtype `params` are stored in: a trainer keeps
    float32 master weights and runs bf16 matmuls, the gradient flowing back through the
    cast in float32. Each layer is cast inside the scan, so only one layer's low-precision
    copy is alive at a time. `activation_sharding` pins the residual stream `[B, T, D]` at
    every layer boundary (the trainer passes its batch sharding, so activations stay split
    over the batch axes instead of being replicated or all-reduced).
    """
    def pin(x_BTD):
        return pin_activations(x_BTD, activation_sharding)

    x = pin(embed_tokens(config, params, tokens_BT))

    def body(x_BTD, layer_inputs):
        layer_params, layer_cache = layer_inputs
        x_BTD, layer_cache = apply_layer(config, layer_params, x_BTD, positions_BT, attend,
                                         layer_cache, aux)
        return pin(x_BTD), layer_cache

    if remat:
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    if isinstance(params["layers"], tuple):  # per-layer weights: unrolled, nothing sliced
        outputs = []
        for index, layer_params in enumerate(params["layers"]):
            x, out = body(x, (layer_params, jax.tree.map(lambda a, i=index: a[i], cache)))
            outputs.append(out)
        # As a scan's, the outputs exist only once every layer has run. Unrolled, the last
        # layer's new K/V do not depend on its attention, so nothing orders that layer's
        # read of a KV pool before a caller's in-place write of these outputs into it, and
        # XLA copies the whole pool to keep the read safe (per decoded token). Adding a zero
        # computed from `x` orders them; `x != x` keeps it zero when `x` holds inf or NaN.
        # (An optimization barrier did not remove the copies: XLA CPU, jax 0.10.2.)
        # The zero is made in each output's (float) dtype: XLA folds an integer `* 0`.
        probe = x.reshape(-1)[0]
        is_nan = probe != probe
        stacked = jax.tree.map(lambda *a: jnp.stack(a) + is_nan.astype(a[0].dtype) * 0,
                               *outputs)
        return final_norm(config, params, x), stacked
    x, cache = jax.lax.scan(body, x, (params["layers"], cache))
    return final_norm(config, params, x), cache


def pin_activations(x_BTD, activation_sharding):
    """`x_BTD` constrained to `activation_sharding` (None: left to the compiler)."""
    if activation_sharding is None:
        return x_BTD
    return jax.lax.with_sharding_constraint(x_BTD, activation_sharding)


def _embedder(config: ModelConfig, params: Params):
    (embed_def, _), _ = _graphdefs(config)
    return nnx.merge(embed_def, cast_floating(
        crop_to(params["embedder"], _logical_shapes(config)[0]), config.jnp_dtype))


def embed_tokens(config: ModelConfig, params: Params, tokens_BT) -> jax.Array:
    """Token embeddings `[B, T, D]` in the compute dtype (needs only `params["embedder"]`)."""
    return _embedder(config, params).embed(tokens_BT)


def final_norm(config: ModelConfig, params: Params, x_BTD) -> jax.Array:
    return _embedder(config, params).final_norm(x_BTD)


def apply_layer(config: ModelConfig, layer_params: Params, x_BTD, positions_BT,
                attend: AttendFn, layer_cache: Any, aux: Any):
    """One decoder layer in the compute dtype: `(x_BTD, layer_cache)`. Stored (padded)
    weights are cut here, inside a rematerialised body, so the residuals a backward keeps
    are the stored arrays themselves."""
    _, (layer_def, _) = _graphdefs(config)
    layer = nnx.merge(layer_def, cast_floating(
        crop_to(layer_params, _logical_shapes(config)[1]), config.jnp_dtype))
    return layer(x_BTD, positions_BT, attend, layer_cache, aux)


def output_kernel(config: ModelConfig, params: Params) -> jax.Array:
    return _embedder(config, params).output_kernel_DV()


def hidden_states(config: ModelConfig, params: Params, tokens_BT, positions_BT=None,
                  segment_ids_BT=None, remat: bool = False, activation_sharding=None
                  ) -> jax.Array:
    """Final-norm hidden states `[B, T, D]` over packed sequences."""
    tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
    if segment_ids_BT is None:
        segment_ids_BT = jnp.ones_like(tokens_BT)
    if positions_BT is None:
        positions_BT = default_positions(tokens_BT, segment_ids_BT)
    hidden, _ = run_layers(config, params, tokens_BT, positions_BT, packed_attend, None,
                           packed_mask(segment_ids_BT), remat=remat,
                           activation_sharding=activation_sharding)
    return hidden


def forward(config: ModelConfig, params: Params, tokens, positions=None, segment_ids=None):
    """Logits `[B, T, V]` (float32) for packed sequences.

    `segment_ids` lets several sequences share a row: a token attends only to earlier
    tokens of its own segment. `positions` default to the index inside each segment.
    """
    hidden = hidden_states(config, params, tokens, positions, segment_ids)
    return jnp.einsum("btd,dv->btv", hidden, output_kernel(config, params),
                      preferred_element_type=jnp.float32)


def forward_with_cache(config: ModelConfig, params: Params, tokens_BT, positions_BT,
                       attend: AttendFn, cache: Any, aux: Any):
    """Serving entry point: logits for `tokens_BT` given a layer-stacked KV `cache`.

    `attend` writes this step's K/V into its layer's slice of `cache` and attends over
    what is cached; `aux` (page tables, lengths, ...) reaches every layer unchanged.
    """
    hidden, cache = run_layers(config, params, jnp.asarray(tokens_BT, jnp.int32),
                               positions_BT, attend, cache, aux)
    logits = jnp.einsum("btd,dv->btv", hidden, output_kernel(config, params),
                        preferred_element_type=jnp.float32)
    return logits, cache

"""Per-slot token sampling: greedy, temperature, top-k, top-p, with behaviour log-probs.

Every slot carries its own parameters as arrays, so one compiled function serves any
mix of requests. The log-prob returned is `log softmax(logits / T)[token]` (T = 1 for
greedy) *before* top-k/top-p truncation: the quantity the trainer recomputes from its
own forward at the same temperature, which is what importance ratios compare against.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


def seed_key_data(seed: jax.Array) -> jax.Array:
    """Raw uint32 key data of a request's seed (traceable; stored per decode slot)."""
    return jax.random.key_data(jax.random.key(seed))


def _filter_top_k_top_p(scaled_BV, top_k_B, top_p_B):
    """Mask (to -inf) tokens outside top-k, then outside the top-p nucleus of what is left."""
    vocab = scaled_BV.shape[-1]
    sorted_BV = -jnp.sort(-scaled_BV, axis=-1)  # descending
    rank_V = jnp.arange(vocab)
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, vocab), vocab)
    sorted_BV = jnp.where(rank_V[None] < k_B[:, None], sorted_BV, _NEG_INF)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    # A token stays if the mass strictly ahead of it is below top_p; the first always stays.
    keep_BV = (mass_before_BV < top_p_B[:, None]) & (rank_V[None] < k_B[:, None])
    keep_BV = keep_BV.at[:, 0].set(True)
    threshold_B = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1)
    return jnp.where(scaled_BV >= threshold_B[:, None], scaled_BV, _NEG_INF)


def sampling_mode(rows: Iterable[tuple[float, int, float]]) -> tuple[bool, bool]:
    """(filter, draw) for `sample_tokens` from the host's (temperature, top_k, top_p) of
    every row: filter if any sampled row asks for top-k/top-p, draw unless all are greedy."""
    rows = list(rows)
    filtering = any(t > 0 and (k > 0 or p < 1.0) for t, k, p in rows)
    return filtering, any(t > 0 for t, _, _ in rows)


def sample_tokens(logits_BV: jax.Array, key_data_B2: jax.Array, positions_B: jax.Array,
                  temperature_B: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array,
                  mode: tuple[bool, bool] = (True, True)) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row. Returns (tokens_B int32, logprobs_B float32).

    The key for row b is `fold_in(key_data_B2[b], positions_B[b])`: the stream depends on
    the request's seed and the token's position only. `mode` (static, from
    `sampling_mode` over the rows' parameters, which the host knows) skips the vocab sort
    when no row filters and the draws when every row is greedy; (True, True) is right for
    any rows.
    """
    logits_BV = logits_BV.astype(jnp.float32)
    greedy_B = temperature_B <= 0
    scaled_BV = logits_BV / jnp.where(greedy_B, 1.0, temperature_B)[:, None]
    # No `lax.cond` (its predicate is copied to the host on GPU): the host decides from
    # parameters it set. Batch-wide, as the former cond's predicate, so tokens are the same
    # bit for bit (a row without top-k/top-p is filtered too when another row asks for it).
    filtering, drawing = mode
    filtered_BV = _filter_top_k_top_p(scaled_BV, top_k_B, top_p_B) if filtering else scaled_BV

    def draw(key_data, position, row_V):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), position)
        return jax.random.categorical(key, row_V)

    argmax_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    sampled_B = (jax.vmap(draw)(key_data_B2, positions_B, filtered_BV).astype(jnp.int32)
                 if drawing else argmax_B)
    tokens_B = jnp.where(greedy_B, argmax_B, sampled_B)
    logp_BV = jax.nn.log_softmax(scaled_BV, axis=-1)
    logprobs_B = jnp.take_along_axis(logp_BV, tokens_B[:, None], axis=-1)[:, 0]
    return tokens_B, logprobs_B

"""Per-token log-probabilities without a full `[B, T, V]` float32 softmax alive."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tidejax.models.config import ModelConfig
from tidejax.models.model import Params, hidden_states, output_kernel


def logprobs_from_hidden(hidden_BTD, kernel_DV, targets_BT, chunk: int = 128,
                         temperature: float = 1.0) -> jax.Array:
    """log p(targets | hidden) computed `chunk` tokens at a time, from `logits / temperature`
    (the distribution a sampler at that temperature draws from).

    Each chunk's `[B, chunk, V]` logits live only inside a rematerialised scan body, so
    forward and backward both peak at one chunk of logits instead of all T.
    """
    batch, length, dim = hidden_BTD.shape
    chunk = max(1, min(chunk, length))
    pad = (-length) % chunk
    if pad:
        hidden_BTD = jnp.pad(hidden_BTD, ((0, 0), (0, pad), (0, 0)))
        targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
    n_chunks = hidden_BTD.shape[1] // chunk
    h_chunks = hidden_BTD.reshape(batch, n_chunks, chunk, dim).swapaxes(0, 1)
    t_chunks = targets_BT.reshape(batch, n_chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one(h_BCD, t_BC):
        logits = jnp.einsum("bcd,dv->bcv", h_BCD, kernel_DV, preferred_element_type=jnp.float32)
        if temperature != 1.0:
            logits = logits / temperature
        picked = jnp.take_along_axis(logits, t_BC[..., None], axis=-1)[..., 0]
        return picked - jax.nn.logsumexp(logits, axis=-1)

    out = jax.lax.map(lambda xs: one(*xs), (h_chunks, t_chunks))
    return out.swapaxes(0, 1).reshape(batch, -1)[:, :length]


def token_logprobs(config: ModelConfig, params: Params, tokens_BT, positions_BT=None,
                   segment_ids_BT=None, chunk: int = 128, remat: bool = False,
                   activation_sharding=None, temperature: float = 1.0) -> jax.Array:
    """`logp[b, t] = log p(tokens[b, t] | tokens[b, <t] of its segment)`, float32 `[B, T]`.

    Aligned with the tokens (not shifted), so a loss mask that marks generated tokens
    applies directly. The first token of each segment has no context and gets 0.
    `temperature` (a Python float) scales the logits as the rollout sampler did.
    """
    tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
    if segment_ids_BT is None:
        segment_ids_BT = jnp.ones_like(tokens_BT)
    hidden = hidden_states(config, params, tokens_BT, positions_BT, segment_ids_BT, remat=remat,
                           activation_sharding=activation_sharding)
    return logprobs_of_hidden(config, params, hidden, tokens_BT, segment_ids_BT, chunk,
                              temperature)


def logprobs_of_hidden(config: ModelConfig, params: Params, hidden_BTD, tokens_BT,
                       segment_ids_BT, chunk: int = 128, temperature: float = 1.0
                       ) -> jax.Array:
    """`token_logprobs` from the final-norm hidden states (needs `params["embedder"]`)."""
    logp_next = logprobs_from_hidden(hidden_BTD[:, :-1], output_kernel(config, params),
                                     tokens_BT[:, 1:], chunk, temperature)
    continues = segment_ids_BT[:, 1:] == segment_ids_BT[:, :-1]
    logp_next = jnp.where(continues, logp_next, 0.0)
    return jnp.concatenate([jnp.zeros_like(logp_next[:, :1]), logp_next], axis=1)

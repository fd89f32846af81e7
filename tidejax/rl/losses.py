"""Token-level RL losses: clipped policy loss, KL estimators, aggregation, SFT loss.

Everything here is elementwise in the per-token log-probs `logp_BT`, which is what lets
the actor run its forward pass first and apply this "loss head" only in its backward
pass (see `tidejax.rl.deferred`).

Aggregation divides by a normaliser `denom`. Pass the *global* one (over every micro-batch
of the step, `batch.loss_denominator`) so that summed micro-batch gradients equal the
gradient of the whole step's loss; left as None it is computed from this batch alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tidejax.rl.batch import Batch, num_sequences
from tidejax.rl.config import LossConfig

_INT32_MAX = jnp.iinfo(jnp.int32).max


def kl_penalty(logp_BT, ref_logp_BT, estimator: str) -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3).

    With `log_r = ref_logp - logp`: k1 = -log_r (unbiased, can be negative),
    k2 = log_r**2 / 2 (low variance, biased), k3 = exp(log_r) - 1 - log_r (unbiased, >= 0).
    """
    log_r = ref_logp_BT - logp_BT
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return jnp.expm1(log_r) - log_r
    raise ValueError(f"unknown kl_estimator {estimator!r}; choose k1, k2 or k3")


def policy_loss(logp_BT, behaviour_logp_BT, advantages_BT, clip_eps_low: float,
                clip_eps_high: float, proximal_logp_BT=None, is_weight_cap: float = 2.0
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """PPO clipped surrogate per token. Returns (loss_BT, clipped_BT, truncated_BT).

    Without `proximal_logp_BT` the ratio pi_theta / pi_behaviour is clipped (standard PPO,
    right when the tokens are on-policy). With it, decoupled PPO (AReaL, Fu et al. 2025):
    the ratio pi_theta / pi_proximal is clipped and each token is weighted by the importance
    weight pi_proximal / pi_behaviour, truncated at `is_weight_cap`. A stale token then still
    moves the policy, in proportion to how likely the trained policy makes it, instead of
    losing its gradient to a clip measured against the old weights (and when the proximal
    policy is the one being trained, nothing bounds that move). `clipped_BT` marks
    tokens whose gradient the clip zeroed; `truncated_BT` tokens whose weight hit the cap.
    """
    if proximal_logp_BT is None:
        anchor_BT, weight_BT = behaviour_logp_BT, jnp.ones_like(logp_BT)
    else:
        anchor_BT = jax.lax.stop_gradient(proximal_logp_BT)
        weight_BT = jnp.exp(anchor_BT - behaviour_logp_BT)
    truncated_BT = weight_BT > is_weight_cap
    weight_BT = jnp.minimum(weight_BT, is_weight_cap)
    ratio = jnp.exp(logp_BT - anchor_BT)
    unclipped = ratio * advantages_BT
    clipped = jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages_BT
    return -weight_BT * jnp.minimum(unclipped, clipped), clipped < unclipped, truncated_BT


def token_weights(loss_mask_BT, segment_ids_BT, loss_agg: str, denom=None) -> jax.Array:
    """`w_BT` such that `sum(w * value)` is the aggregated loss.

    token-mean: every loss token weighs 1 / (loss tokens).
    seq-mean-token-sum: each sequence's token sum, averaged over sequences.
    seq-mean-token-mean: each sequence's token mean, averaged over sequences.
    """
    mask = jnp.asarray(loss_mask_BT, jnp.float32)
    if loss_agg == "token-mean":
        default = mask.sum()
    elif loss_agg in ("seq-mean-token-sum", "seq-mean-token-mean"):
        default = num_sequences(mask, segment_ids_BT)
    else:
        raise ValueError(f"unknown loss_agg {loss_agg!r}")
    denom = default if denom is None else jnp.asarray(denom, jnp.float32)
    w = mask / jnp.maximum(denom, 1.0)
    if loss_agg == "seq-mean-token-mean":
        batch, length = mask.shape
        rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, length))
        lens = jnp.zeros((batch, length + 1), jnp.float32).at[rows, segment_ids_BT].add(mask)
        w = w / jnp.maximum(lens[rows, segment_ids_BT], 1.0)
    return w


def aggregate(values_BT, loss_mask_BT, segment_ids_BT, loss_agg: str, denom=None) -> jax.Array:
    return jnp.sum(values_BT * token_weights(loss_mask_BT, segment_ids_BT, loss_agg, denom))


def rl_loss(logp_BT, ref_logp_BT, batch: Batch, config: LossConfig, denom=None
            ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The RL loss head: policy loss + kl_coef * KL, aggregated. Returns (loss, metric sums).

    Metric entries are sums over this micro-batch (already divided by `denom` where they
    are losses), so the metrics of several micro-batches add up; `min_version` takes a min.
    `ref_logp_BT` may be None when `config.kl_coef == 0`.
    """
    mask = jnp.asarray(batch.loss_mask, jnp.float32)
    w = token_weights(mask, batch.segment_ids, config.loss_agg, denom)
    # The trainer makes one optimizer update per batch, so the proximal policy (the weights
    # this update starts from) is the one being differentiated: its log-probs are logp_BT.
    proximal_BT = logp_BT if config.off_policy == "decoupled" else None
    pg_BT, clipped_BT, truncated_BT = policy_loss(
        logp_BT, batch.behaviour_logp, batch.advantages, config.clip_eps_low,
        config.clip_eps_high, proximal_BT, config.is_weight_cap)
    pg = jnp.sum(w * pg_BT)
    if config.kl_coef > 0:
        if ref_logp_BT is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        kl = jnp.sum(w * kl_penalty(logp_BT, ref_logp_BT, config.kl_estimator))
        loss = pg + config.kl_coef * kl
    else:
        kl, loss = jnp.zeros((), jnp.float32), pg
    metrics = {**token_metrics(batch), "loss": loss, "pg_loss": pg, "kl": kl,
               "clipped": jnp.sum(mask * clipped_BT), "truncated": jnp.sum(mask * truncated_BT)}
    return loss, metrics


def sft_loss(logp_BT, batch: Batch, denom=None, loss_agg: str = "token-mean"
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked next-token negative log-likelihood (the warm-start loss)."""
    loss = -aggregate(logp_BT, batch.loss_mask, batch.segment_ids, loss_agg, denom)
    zero = jnp.zeros((), jnp.float32)
    return loss, {**token_metrics(batch), "loss": loss, "pg_loss": zero, "kl": zero,
                  "clipped": zero, "truncated": zero}


def token_metrics(batch: Batch) -> dict[str, jax.Array]:
    """Token count and policy-version sums over the loss tokens (for staleness)."""
    mask = jnp.asarray(batch.loss_mask, jnp.float32)
    version = jnp.asarray(batch.policy_version)
    return {
        "tokens": mask.sum(),
        "version_sum": jnp.sum(mask * version.astype(jnp.float32)),
        "min_version": jnp.min(jnp.where(mask > 0, version, _INT32_MAX)).astype(jnp.int32),
    }


def empty_metrics() -> dict[str, jax.Array]:
    """The identity for `merge_metrics`."""
    zero = jnp.zeros((), jnp.float32)
    return {"tokens": zero, "version_sum": zero,
            "min_version": jnp.asarray(_INT32_MAX, jnp.int32),
            "loss": zero, "pg_loss": zero, "kl": zero, "clipped": zero, "truncated": zero}


def merge_metrics(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {k: jnp.minimum(a[k], b[k]) if k == "min_version" else a[k] + b[k] for k in a}

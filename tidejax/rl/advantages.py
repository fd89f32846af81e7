"""Group-relative advantages (GRPO, Dr. GRPO) and zero-variance group filtering.

Rewards arrive as a flat `[N]` vector with a group id per trajectory; groups may have
different sizes (a group can lose members to the staleness bound). Group statistics use an
`[N, N]` same-group mask, which is cheap for the few hundred trajectories of one step and
needs no static group count under jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tidejax.rl.config import AdvantageConfig


def group_mean_std(rewards_N, group_ids_N) -> tuple[jax.Array, jax.Array]:
    """Mean and population std (ddof=0) of each trajectory's group, broadcast to `[N]`."""
    rewards_N = jnp.asarray(rewards_N, jnp.float32)
    group_ids_N = jnp.asarray(group_ids_N)
    same_NN = (group_ids_N[:, None] == group_ids_N[None, :]).astype(jnp.float32)
    count_N = same_NN.sum(axis=1)
    mean_N = same_NN @ rewards_N / count_N
    # Deviations from each row's own group mean; only same-group columns count.
    dev_NN = (rewards_N[None, :] - mean_N[:, None]) ** 2
    std_N = jnp.sqrt((same_NN * dev_NN).sum(axis=1) / count_N)
    return mean_N, std_N


def grpo_advantages(rewards_N, group_ids_N, eps: float = 1e-6) -> jax.Array:
    """GRPO: `(r - group mean) / (group std + eps)`."""
    mean_N, std_N = group_mean_std(rewards_N, group_ids_N)
    return (jnp.asarray(rewards_N, jnp.float32) - mean_N) / (std_N + eps)


def drgrpo_advantages(rewards_N, group_ids_N) -> jax.Array:
    """Dr. GRPO: `r - group mean`; no std division, so easy/hard groups are not re-weighted."""
    mean_N, _ = group_mean_std(rewards_N, group_ids_N)
    return jnp.asarray(rewards_N, jnp.float32) - mean_N


def nonzero_variance(rewards_N, group_ids_N, tol: float = 1e-6) -> jax.Array:
    """True where the trajectory's group has reward std above `tol` (it carries signal)."""
    _, std_N = group_mean_std(rewards_N, group_ids_N)
    return std_N > tol


def compute_advantages(rewards_N, group_ids_N, config: AdvantageConfig
                       ) -> tuple[jax.Array, jax.Array]:
    """Advantages and a keep mask, chosen by `config.estimator`.

    With `filter_zero_variance`, trajectories of groups whose rewards are all equal get
    keep = False (their advantage is 0 anyway; dropping them saves trainer compute).
    """
    if config.estimator == "grpo":
        adv_N = grpo_advantages(rewards_N, group_ids_N, config.eps)
    else:
        adv_N = drgrpo_advantages(rewards_N, group_ids_N)
    if config.filter_zero_variance:
        keep_N = nonzero_variance(rewards_N, group_ids_N, config.zero_variance_tol)
    else:
        keep_N = jnp.ones(adv_N.shape, bool)
    return adv_N, keep_N

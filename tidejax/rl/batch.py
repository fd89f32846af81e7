"""Trajectories (host side) and the packed `[B, T]` micro-batch pytree the steps consume.

A trajectory is one multi-turn episode flattened to tokens: prompt, model turns and
environment observations. Only model-generated tokens carry loss (`loss_mask = 1`); they
also carry the behaviour log-probs and the policy version that sampled them. Packing puts
several trajectories in one row, told apart by `segment_ids` (1, 2, ... per row; 0 is
padding), so attention and log-probs never cross a trajectory boundary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Batch:
    """One packed micro-batch; every field is `[B, T]`.

    tokens, positions (index inside the segment), segment_ids (0 = padding): model inputs.
    loss_mask: 1.0 on model-generated tokens only (never the first token of a segment).
    behaviour_logp: log-prob the rollout policy gave each generated token (0 elsewhere).
    policy_version: version of the policy that generated each token (for staleness).
    advantages: the trajectory's advantage broadcast to its tokens.
    """

    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    loss_mask: jax.Array
    behaviour_logp: jax.Array
    policy_version: jax.Array
    advantages: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    @classmethod
    def for_sft(cls, tokens_BT, loss_mask_BT, segment_ids_BT=None) -> Batch:
        """A batch for supervised fine-tuning: only tokens, segments and the mask matter."""
        tokens = np.asarray(tokens_BT, np.int32)
        seg = np.ones_like(tokens) if segment_ids_BT is None else np.asarray(segment_ids_BT,
                                                                              np.int32)
        zeros = np.zeros(tokens.shape, np.float32)
        return cls(tokens=tokens, positions=segment_positions(seg), segment_ids=seg,
                   loss_mask=np.asarray(loss_mask_BT, np.float32) * (seg > 0),
                   behaviour_logp=zeros, policy_version=np.zeros_like(tokens),
                   advantages=zeros)


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One finished episode, `[L]` arrays on the host."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    behaviour_logp: np.ndarray
    policy_version: np.ndarray
    reward: float
    group_id: int

    def __post_init__(self):
        n = len(self.tokens)
        for field in ("loss_mask", "behaviour_logp", "policy_version"):
            if len(getattr(self, field)) != n:
                raise ValueError(f"Trajectory.{field} has length {len(getattr(self, field))}, "
                                 f"tokens has {n}")
        if n == 0:
            raise ValueError("Trajectory.tokens is empty")
        if self.loss_mask[0]:
            # The first token has no context inside its segment, so it has no log-prob.
            raise ValueError("Trajectory.loss_mask[0] must be 0: the first token is never "
                             "generated")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def generated_tokens(self) -> int:
        return int(np.sum(self.loss_mask))


def segment_positions(segment_ids_BT) -> np.ndarray:
    """Index of each token inside its segment (0 on padding), on the host."""
    seg = np.asarray(segment_ids_BT)
    t = np.broadcast_to(np.arange(seg.shape[1]), seg.shape)
    starts = np.ones(seg.shape, bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    start_index = np.maximum.accumulate(np.where(starts, t, 0), axis=1)
    return np.where(seg > 0, t - start_index, 0).astype(np.int32)


def build_batch(trajectories: Sequence[Trajectory], advantages: Sequence[float],
                rows: Sequence[Sequence[int]], row_len: int, num_rows: int | None = None
                ) -> Batch:
    """Pack trajectories into a `[num_rows, row_len]` numpy batch.

    `rows[r]` lists the trajectory indices that share row r (from
    `tidejax.sched.microbatch.pack_rows`); `advantages[i]` is trajectory i's advantage.
    Extra rows up to `num_rows` (a shape bucket) are padding.
    """
    num_rows = len(rows) if num_rows is None else num_rows
    if len(rows) > num_rows:
        raise ValueError(f"{len(rows)} rows do not fit num_rows={num_rows}")
    shape = (num_rows, row_len)
    tokens = np.zeros(shape, np.int32)
    seg = np.zeros(shape, np.int32)
    pos = np.zeros(shape, np.int32)
    mask = np.zeros(shape, np.float32)
    blogp = np.zeros(shape, np.float32)
    version = np.zeros(shape, np.int32)
    adv = np.zeros(shape, np.float32)
    for r, members in enumerate(rows):
        start = 0
        for s, i in enumerate(members, start=1):
            traj = trajectories[i]
            end = start + len(traj)
            if end > row_len:
                raise ValueError(f"row {r} needs {end} tokens, row_len is {row_len}")
            sl = np.s_[r, start:end]
            tokens[sl], seg[sl], pos[sl] = traj.tokens, s, np.arange(len(traj))
            mask[sl] = traj.loss_mask
            blogp[sl] = np.where(traj.loss_mask, traj.behaviour_logp, 0.0)
            version[sl] = traj.policy_version
            adv[sl] = advantages[i]
            start = end
    return Batch(tokens=tokens, positions=pos, segment_ids=seg, loss_mask=mask,
                 behaviour_logp=blogp, policy_version=version, advantages=adv)


def num_sequences(loss_mask_BT, segment_ids_BT) -> jax.Array:
    """Number of (row, segment) pairs holding at least one loss token.

    Segment ids must lie in [0, T] (packing numbers them 1, 2, ... per row).
    """
    batch, length = segment_ids_BT.shape
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, length))
    has = jnp.zeros((batch, length + 1), jnp.float32).at[rows, segment_ids_BT].max(
        (loss_mask_BT > 0).astype(jnp.float32))
    return has[:, 1:].sum()


def loss_denominator(batches: Sequence[Batch], loss_agg: str) -> float:
    """The global normaliser for a step made of several micro-batches.

    Every micro-batch's loss is divided by this one number, so summing micro-batch
    gradients gives exactly the gradient of the whole step's loss.
    """
    if loss_agg == "token-mean":
        total = sum(float(np.sum(np.asarray(b.loss_mask))) for b in batches)
    else:
        total = 0.0
        for b in batches:
            mask, seg = np.asarray(b.loss_mask) > 0, np.asarray(b.segment_ids)
            total += sum(len(np.unique(seg[r][mask[r]])) for r in range(seg.shape[0]))
    return max(total, 1.0)

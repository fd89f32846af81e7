"""Test doubles for the RL core: host-built random params, batches and trajectories.

Built with numpy from the model's abstract shapes, so a test gets parameters without
compiling the model's initialiser.
"""

from __future__ import annotations

import jax
import numpy as np

from tidejax.models import ModelConfig, abstract_params
from tidejax.rl.batch import Batch, Trajectory, segment_positions


def random_params(config: ModelConfig, seed: int = 0, std: float = 0.02):
    """Random parameters on the host: normal(std) kernels and biases, norms near 1."""
    rng = np.random.default_rng(seed)

    def one(path, leaf):
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        values = rng.normal(0.0, std, leaf.shape)
        if "norm" in name:
            values = 1.0 + 5 * values
        return np.asarray(values, dtype=leaf.dtype)

    return jax.tree_util.tree_map_with_path(one, abstract_params(config))


def random_batch(config: ModelConfig, rng: np.random.Generator, batch: int, length: int,
                 max_segments: int = 3, mask_prob: float = 0.7) -> Batch:
    """Random packed rows: up to `max_segments` segments then padding; random loss mask on
    every non-first token of a segment; per-segment advantages; behaviour log-probs 0."""
    seg = np.zeros((batch, length), np.int32)
    adv = np.zeros((batch, length), np.float32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(2, length + 1), size=max_segments, replace=True))
        start = 0
        for s, end in enumerate(np.unique(cuts), start=1):
            seg[b, start:end] = s
            adv[b, start:end] = rng.normal()
            start = end
    first = np.concatenate([np.ones((batch, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    mask = ((rng.random((batch, length)) < mask_prob) & ~first & (seg > 0)).astype(np.float32)
    tokens = rng.integers(0, config.vocab_size, (batch, length)).astype(np.int32)
    return Batch(tokens=np.where(seg > 0, tokens, 0).astype(np.int32), positions=segment_positions(seg),
                 segment_ids=seg, loss_mask=mask,
                 behaviour_logp=np.zeros((batch, length), np.float32),
                 policy_version=rng.integers(0, 3, (batch, length)).astype(np.int32),
                 advantages=adv)


def random_trajectory(config: ModelConfig, rng: np.random.Generator, length: int,
                      group_id: int = 0, prompt: int = 2, version: int = 0) -> Trajectory:
    """A prompt of `prompt` tokens followed by generated tokens with made-up log-probs."""
    mask = (np.arange(length) >= prompt).astype(np.float32)
    return Trajectory(tokens=rng.integers(0, config.vocab_size, length).astype(np.int32),
                      loss_mask=mask,
                      behaviour_logp=(mask * rng.uniform(-7.0, -5.0, length)).astype(np.float32),
                      policy_version=np.full(length, version, np.int32),
                      reward=float(rng.integers(0, 2)), group_id=group_id)


# XLA options for tests: skip LLVM's expensive optimisations. The HLO (and so the maths) is
# the same; the CPU kernels are slower but compile about twice as fast.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# Submesh layouts the tests use: device count -> (data, fsdp, tensor).
MESH_LAYOUTS = {1: (1, 1, 1), 2: (1, 2, 1), 4: (1, 2, 2), 6: (1, 3, 2)}


def submesh(n_devices: int, offset: int = 0):
    """A (data, fsdp, tensor) mesh over devices [offset, offset + n_devices)."""
    from tidejax.models import make_mesh

    data, fsdp, tensor = MESH_LAYOUTS[n_devices]
    return make_mesh(jax.devices()[offset:offset + n_devices], data, fsdp, tensor)

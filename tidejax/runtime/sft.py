"""Supervised warm start on expert episodes, cached in the run directory."""

from __future__ import annotations

import logging
import os
import time

import jax
import numpy as np

from tidejax.config import RunConfig
from tidejax.metrics import format_eta
from tidejax.models.config import ModelConfig
from tidejax.models.sharding import make_mesh
from tidejax.rl.batch import Batch
from tidejax.rl.config import OptimConfig
from tidejax.rl.trainer import make_trainer
from tidejax.runtime import layout
from tidejax.runtime.episode import EpisodeTokens
from tidejax.runtime.stop import StopRequest
from tidejax.sched import memory
from tidejax.sched.microbatch import pack_rows

log = logging.getLogger(__name__)


def save_params(params, path: str) -> None:
    flat = {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    tmp = path + ".tmp.npz"
    np.savez(tmp, **flat)
    os.replace(tmp, path)  # never leave a half-written cache behind


def load_params(path: str, like):
    data = np.load(path)
    leaves = []
    for key, leaf in jax.tree_util.tree_flatten_with_path(like)[0]:
        name = jax.tree_util.keystr(key)
        if name not in data or data[name].shape != leaf.shape:
            raise ValueError(f"{path}: cached parameter {name} is missing or mis-shaped")
        leaves.append(data[name])
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def sft_batches(episodes: list[EpisodeTokens], row_len: int, rows: int, rng: np.random.Generator):
    """Shuffled fixed-shape `[rows, row_len]` SFT batches, sequences packed into rows."""
    order = rng.permutation(len(episodes))
    lengths = [min(len(episodes[i]), row_len) for i in order]
    packed = pack_rows(lengths, row_len)
    for start in range(0, len(packed), rows):
        group = packed[start:start + rows]
        tokens = np.zeros((rows, row_len), np.int32)
        mask = np.zeros((rows, row_len), np.float32)
        seg = np.zeros((rows, row_len), np.int32)
        for r, members in enumerate(group):
            pos = 0
            for s, j in enumerate(members, start=1):
                ep = episodes[order[j]]
                n = lengths[j]
                tokens[r, pos:pos + n] = ep.tokens[:n]
                mask[r, pos:pos + n] = ep.loss_mask[:n]
                seg[r, pos:pos + n] = s
                pos += n
        yield Batch.for_sft(tokens, mask, seg)


def sft_mesh_size(cfg: RunConfig, model_config: ModelConfig, devices) -> int:
    """Devices the warm start trains on: the largest size up to `sft.devices` that divides
    the model and the batch and that the memory model says fits, else the smallest that
    fits (a 7B model does not fit on the 2 devices that suit fake CPU devices)."""
    jm = layout.job_memory(cfg, model_config, layout.capacity_bytes(cfg, devices))
    batch = memory.TrainerBatch(cfg.sft.batch_sequences, cfg.row_len, jm.remat)
    fits = [n for n in range(1, len(devices) + 1)
            if cfg.sft.batch_sequences % n == 0 and not memory.undivided(jm.shape, n)
            and memory.trainer_step(jm.shape, n, batch, "sft").fits(jm.capacity_bytes)]
    if not fits:
        raise ValueError(f"sft.batch_sequences={cfg.sft.batch_sequences}: no mesh of up to "
                         f"{len(devices)} devices divides the model and the batch and holds "
                         f"the SFT step")
    small = [n for n in fits if n <= cfg.sft.devices]
    return max(small) if small else min(fits)


def sft_warm_start(cfg: RunConfig, model_config: ModelConfig, params, episodes, devices,
                   cache_path: str, writer=None, stop: StopRequest | None = None):
    """Masked next-token training on expert episodes; cached at `cache_path`. A stop
    request abandons it between steps (raising `RunStopped`; nothing is cached)."""
    if os.path.exists(cache_path):
        log.info("SFT warm start: using cached %s", cache_path)
        return load_params(cache_path, params)
    if cfg.sft.steps == 0 or not episodes:
        return params
    optim = OptimConfig(lr=cfg.sft.lr, warmup_steps=min(5, cfg.sft.steps - 1),
                        total_steps=cfg.sft.steps + 1, weight_decay=0.0)
    rl = cfg.rl.replace(optim=optim)
    n = sft_mesh_size(cfg, model_config, devices)
    stored = layout.job_memory(cfg, model_config, 0.0).shape.stored_d_model
    # The last devices: where the actor mesh starts (rollout ranks take the first ones).
    trainer = make_trainer(model_config, rl, make_mesh(list(devices[-n:]), fsdp=-1),
                           stored_d_model=stored)
    state = trainer.init_state(cfg.sft.seed, params)
    rng = np.random.default_rng(cfg.sft.seed)
    step, loss = 0, float("nan")
    start = time.perf_counter()
    while step < cfg.sft.steps:
        for batch in sft_batches(episodes, cfg.row_len, cfg.sft.batch_sequences, rng):
            if stop is not None:
                stop.raise_if_requested()
            state, metrics = trainer.sft_step(state, trainer.put(batch))
            step += 1
            if step % 10 == 0 or step == cfg.sft.steps:
                loss = float(metrics["loss"])
                eta = (time.perf_counter() - start) / step * (cfg.sft.steps - step)
                log.info("SFT step %d/%d loss %.4f eta %s", step, cfg.sft.steps, loss,
                         format_eta(eta))
                if writer:
                    writer.write(step, "sft", {"loss": loss})
            if step >= cfg.sft.steps:
                break
    params = trainer.host_params(state.params)
    save_params(params, cache_path)
    return params

"""The GRPO job as a library: tokenizer, SFT warm start, controller run, outputs.

`tidejax.experiments.webshop` is its command line; benchmarks call `run_job` directly so
several systems share one process (and its compiled engines and trainers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import sys
import time

import jax

from tidejax import models
from tidejax.checkpoint import CheckpointError, Checkpointer
from tidejax.config import RunConfig
from tidejax.envs import EnvPool, PoolConfig, expert_demonstrations, local_env_factory
from tidejax.envs.latency import LatencyModel
from tidejax.envs.policies import action_format, env_texts, read_demonstrations
from tidejax.envs.registry import get_spec
from tidejax.metrics import MetricsWriter, TraceRecorder, format_eta
from tidejax.models.hf import read_config
from tidejax.models.tokenizer import check_matches_model
from tidejax.runtime import layout, shipped
from tidejax.runtime.cluster import Decisions
from tidejax.runtime.controller import Controller, RunSummary, StepRecord
from tidejax.runtime.episode import EpisodeTokens, add_observation, close_action, open_episode
from tidejax.runtime.layout import LayoutError
from tidejax.runtime.sft import sft_warm_start
from tidejax.runtime.stop import RunStopped, StopRequest
from tidejax.runtime.topology import Topology

log = logging.getLogger("tidejax.job")
# How long the other processes wait for the leader's warm start (SFT can take a while).
WARM_START_TIMEOUT_S = 6 * 3600


# ---------------------------------------------------------------------------- setup
def build_tokenizer(cfg: RunConfig, run_dir: str, demos) -> models.Tokenizer:
    if cfg.tokenizer_path:
        return models.load_tokenizer(cfg.tokenizer_path)
    if cfg.hf_path:
        return models.load_tokenizer(cfg.hf_path)
    path = os.path.join(run_dir, "tokenizer.json")
    if os.path.exists(path):
        return models.load_tokenizer(path)
    texts = [action_format(cfg.env_type)]
    for episode in demos:
        for obs, action in episode.turns:
            texts += [obs, action]
    if not demos:  # no expert: the env's own text (first observations of training goals)
        texts += env_texts(cfg.env_type, ENV_TEXT_GOALS, cfg.seed, env_kwargs=cfg.env_kwargs(),
                           rows=cfg.task_rows().get("train"))
    tokenizer = models.train_bpe(texts, cfg.tokenizer_vocab,
                                 added_tokens=domain_tokens(cfg))
    tokenizer.save(path)
    return tokenizer


ENV_TEXT_GOALS = 256  # training goals whose first observation trains an expert-less tokenizer


def domain_tokens(cfg: RunConfig) -> list[str]:
    """Identifiers a small model should read and write as one token each: WebShop's
    product ids (random 10-character strings that BPE would cut into many pieces)."""
    if cfg.env_type != "webshop":
        return []
    from tidejax.envs.webshop_catalogue import get_catalogue

    return sorted({p.asin for p in get_catalogue(cfg.webshop.catalogue).products})


def demo_episode_tokens(tokenizer, env_type: str, demos) -> list[EpisodeTokens]:
    """Expert episodes in exactly the token layout rollouts produce (actions are mask 1)."""
    out = []
    for demo in demos:
        ep = open_episode(tokenizer, action_format(env_type), demo.turns[0][0])
        for i, (obs, action) in enumerate(demo.turns):
            if i:
                add_observation(tokenizer, ep, obs)
            ids = tokenizer.encode(action) + [tokenizer.im_end_id]
            ep.extend_generated(ids, [0.0] * len(ids), 0)
            close_action(tokenizer, ep, ids)
        out.append(ep)
    return out


def demonstrations(cfg: RunConfig):
    """The run's SFT demonstrations: `sft.episodes` expert episodes on training goals, from
    the imperfect demonstrator when `sft.skip_options` (or its WebShop default) is set; none
    for an env without an expert (the warm start then skips SFT). `sft.demonstrations`
    names a JSONL file of chat messages to imitate instead."""
    if cfg.sft.demonstrations:
        return read_demonstrations(cfg.sft.demonstrations, cfg.env_type)
    if get_spec(cfg.env_type).expert is None:
        if cfg.sft.steps:
            log.info("env type %s declares no expert: SFT warm start skipped", cfg.env_type)
        return []
    return expert_demonstrations(cfg.env_type, max(cfg.sft.episodes, 1), seed=cfg.sft.seed,
                                 env_kwargs=cfg.env_kwargs(), expert_kwargs=cfg.expert_kwargs())


def make_pool(cfg: RunConfig) -> EnvPool:
    latency = LatencyModel.default(time_scale=cfg.env_time_scale, seed=cfg.seed)
    pool_cfg = PoolConfig(capacity=cfg.rollout.env_capacity,
                          max_open_episodes=cfg.rollout.env_max_open_episodes)
    if cfg.env_servers:
        return EnvPool(pool_cfg, addresses=list(cfg.env_servers), latency=latency)
    return EnvPool(pool_cfg, latency=latency,
                   env_factory=local_env_factory({cfg.env_type: cfg.env_kwargs()}))


# ---------------------------------------------------------------------------- outputs
def save_plots(records: list[StepRecord], evals: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(steps, [r.train_reward for r in records], label="train reward")
    axes[0].plot(steps, [r.train_success for r in records], label="train success")
    if evals:
        versions = sorted(evals)
        axes[0].errorbar(versions, [evals[v]["reward"] for v in versions],
                         yerr=[2 * evals[v]["reward_se"] for v in versions], fmt="s-",
                         capsize=3, label="eval reward (±2 se)")
        axes[0].plot(versions, [evals[v]["wins"] / max(1, evals[v]["episodes"])
                                for v in versions], "o-", label="eval success")
    axes[0].set_xlabel("step")
    axes[0].legend()
    axes[1].plot(steps, [r.goodput for r in records])
    axes[1].set_title("goodput (consumed tokens/s)")
    axes[2].step(steps, [r.partition[0] for r in records], label="rollout ranks")
    axes[2].step(steps, [r.partition[1] for r in records], label="ref ranks")
    axes[2].step(steps, [r.partition[2] for r in records], label="actor ranks")
    axes[2].legend()
    axes[2].set_title("partition")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summary_dict(summary: RunSummary) -> dict:
    out = {k: v for k, v in dataclasses.asdict(summary).items() if k not in ("records", "state")}
    out["eval_success"] = {v: t["wins"] / max(1, t["episodes"]) for v, t in summary.eval.items()}
    out["learning"] = eval_gain(summary.eval)
    return out


def eval_gain(evals: dict[int, dict]) -> dict:
    """The first and last evaluation's mean reward, their standard errors, and the gain
    with its standard error (the two evaluations' errors added in quadrature: conservative,
    since common sampling seeds make them positively correlated)."""
    if not evals:
        return {}
    first, last = evals[min(evals)], evals[max(evals)]
    gain_se = math.sqrt(first["reward_se"] ** 2 + last["reward_se"] ** 2)
    return {"first_version": min(evals), "last_version": max(evals),
            "first_reward": first["reward"], "first_reward_se": first["reward_se"],
            "last_reward": last["reward"], "last_reward_se": last["reward_se"],
            "reward_gain": last["reward"] - first["reward"], "reward_gain_se": gain_se,
            "first_episodes": first["episodes"], "last_episodes": last["episodes"]}


# ---------------------------------------------------------------------------- main
def model_config_of(cfg: RunConfig) -> models.ModelConfig:
    """The model the run trains, without reading any weights."""
    if cfg.hf_path:
        return read_config(cfg.hf_path, dtype=cfg.compute_dtype)
    model_config = models.get_preset(cfg.preset)
    if cfg.model_vocab_size is not None:
        model_config = model_config.replace(vocab_size=cfg.model_vocab_size)
    if cfg.compute_dtype is not None:
        model_config = model_config.replace(dtype=cfg.compute_dtype)
    return model_config


def warm_start(cfg: RunConfig, cache_dir: str, devices, writer=None,
               stop: StopRequest | None = None):
    """Tokenizer, model config and SFT-warm-started params (both cached in `cache_dir`);
    returns them with the seconds the warm start took."""
    sft_cache = os.path.join(cache_dir, "sft_params.npz")
    shipped.install(cfg, cache_dir)
    tokenizer_given = bool(cfg.tokenizer_path or cfg.hf_path
                           or os.path.exists(os.path.join(cache_dir, "tokenizer.json")))
    # Demonstrations feed only what is not cached yet (thousands of them in larger configs).
    need_demos = not tokenizer_given or (cfg.sft.steps > 0 and not os.path.exists(sft_cache))
    demos = demonstrations(cfg) if need_demos else []
    tokenizer = build_tokenizer(cfg, cache_dir, demos)
    if cfg.hf_path:  # read in the compute dtype: the trainer makes float32 masters of it
        model_config, params = models.load_hf(cfg.hf_path, dtype=cfg.compute_dtype)
    else:
        model_config = model_config_of(cfg)
        params = models.init_params(model_config.replace(dtype="float32"),
                                    jax.random.key(cfg.sft.seed))
    check_matches_model(tokenizer, model_config.vocab_size)
    t0 = time.perf_counter()
    params = sft_warm_start(cfg, model_config, params,
                            demo_episode_tokens(tokenizer, cfg.env_type, demos),
                            devices, sft_cache, writer, stop)
    if os.path.exists(sft_cache) and not os.path.exists(
            os.path.join(cache_dir, shipped.FINGERPRINT_FILE)):
        shipped.write_fingerprint(cfg, cache_dir)
    return tokenizer, model_config, params, time.perf_counter() - t0


def refuse_multi_process_sft_only() -> None:
    """--sft-only builds the warm start on one process's devices: refuse it across several."""
    if jax.process_count() > 1:
        raise LayoutError("--sft-only builds a warm start on one process's devices; run it as "
                          "one process")


def run_job(cfg: RunConfig, run_dir: str, resume: bool = False, show_progress: bool = True,
            compile_cache: str | None = None, cache_dir: str | None = None,
            stop: StopRequest | None = None, process_timeout_s: float = 30.0) -> dict:
    """Run the whole job; the tokenizer and SFT warm start are cached in `cache_dir`
    (default: the run directory), so systems compared side by side share them.

    When `stop` is requested the run checkpoints at its next safe boundary, writes its
    outputs and raises `RunStopped` (with the last completed step). Launched as several
    processes, each runs this with the same arguments and `run_dir` on a shared file system;
    `process_timeout_s` bounds how long one waits for the others at a stage."""
    os.makedirs(run_dir, exist_ok=True)
    cache_dir = cache_dir or run_dir
    os.makedirs(cache_dir, exist_ok=True)
    if compile_cache:  # later runs (and --resume) skip most XLA compilation
        jax.config.update("jax_compilation_cache_dir", compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    try:
        topology = Topology.of(jax.devices(), cfg.topology.devices, cfg.topology.rollout_tensor)
    except ValueError as e:
        raise ValueError(f"{e} (on CPU set --devices before jax starts)") from None
    devices = topology.devices
    # Process 0 writes the run's files; every process takes part in checkpoints.
    leader = jax.process_index() == 0
    decisions = Decisions(run_id="run", timeout_s=process_timeout_s)
    # A layout that does not divide the model or fit is refused before anything is built.
    layout.initial_partition(cfg, layout.job_memory(cfg, model_config_of(cfg),
                                                    layout.capacity_bytes(cfg, devices)),
                             cfg.topology.devices)
    if leader:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=1, default=str)
    writer = MetricsWriter(run_dir, enabled=leader)
    trace = TraceRecorder()
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), max_to_keep=cfg.keep_checkpoints)
    # The leader builds the tokenizer and warm start on its own devices into the (shared)
    # cache; the others then read them from there.
    sft_devices = [d for rank in topology.local_ranks(0) for d in rank]
    try:
        if leader:
            tokenizer, model_config, params, sft_s = warm_start(cfg, cache_dir, sft_devices,
                                                                writer, stop)
        decisions.barrier("warm_start", timeout_s=WARM_START_TIMEOUT_S)
        if not leader:
            tokenizer, model_config, params, sft_s = warm_start(cfg, cache_dir, sft_devices,
                                                                writer, stop)
    except BaseException:
        writer.close()
        raise
    ref_identity = {"source": cfg.hf_path or f"{cfg.preset}+sft", "seed": cfg.sft.seed,
                    "sft_steps": cfg.sft.steps}

    def checkpoint(step, state, controller, rollout):
        ckpt.save(step, state, ref_model=ref_identity, data_cursor=controller.data_cursor,
                  controller={"version": controller.version, "system": cfg.system,
                              "elastic": controller.elastic_meta()},
                  rollout=rollout)

    controller = Controller(cfg, model_config, params, tokenizer, make_pool(cfg), devices,
                            writer, trace, checkpoint, progress=None, stop=stop,
                            decisions=decisions)
    state, start_step, rollout = None, 0, None
    if resume and ckpt.latest_step() is not None:
        try:
            restored = ckpt.restore(controller.resume_abstract_state)
            state, start_step = restored.state, restored.step
            controller.data_cursor = int(restored.data_cursor or 0)
            rollout = restored.rollout
            controller.resume_elastic(restored.controller.get("elastic"))
            log.info("resumed from step %d (data cursor %d)", start_step,
                     controller.data_cursor)
        except CheckpointError as e:
            log.warning("no usable checkpoint (%s); starting from the warm start", e)
    try:
        summary = _run_with_progress(controller, state, start_step, cfg,
                                     show_progress and leader, rollout)
    except BaseException:
        writer.close()  # the metrics of the steps that did finish stay readable
        raise
    finally:  # a failing run still leaves its last checkpoint whole on disk
        ckpt.wait()
        ckpt.close()
    writer.close()
    out = summary_dict(summary) | {"sft_seconds": sft_s, "run_dir": run_dir}
    if leader:
        trace.save(os.path.join(run_dir, "trace.json"))
        save_plots(summary.records, summary.eval, os.path.join(run_dir, "plots.png"))
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(out, f, indent=1, default=float)
    if summary.stopped_by is not None:
        raise RunStopped(summary.stopped_by, start_step + summary.steps)
    return out


def _run_with_progress(controller, state, start_step, cfg, show_progress,
                       rollout=None) -> RunSummary:
    from rich.progress import (BarColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn(
        "{task.completed}/{task.total}"), TimeElapsedColumn(), TextColumn("eta"),
        TimeRemainingColumn(), TextColumn("{task.fields[info]}")]
    started = time.perf_counter()
    # The bar redraws in place only on a terminal; elsewhere the log lines carry progress.
    show_progress = show_progress and sys.stdout.isatty()
    with Progress(*columns, disable=not show_progress, transient=False) as progress:
        bar = progress.add_task(f"GRPO [{cfg.system}]", total=cfg.steps, completed=start_step,
                                info="")

        def on_step(r: StepRecord):
            info = (f"reward {r.train_reward:.2f} succ {r.train_success:.2f} "
                    f"goodput {r.goodput:.0f} tok/s TWT {r.twt_s:.1f}s RWT {r.rwt_s:.1f}s "
                    f"hit {r.kv_hit_rate:.2f} part {r.partition} {r.mode}")
            progress.update(bar, completed=r.step, info=info)
            eta = (time.perf_counter() - started) / (r.step - start_step) * (cfg.steps - r.step)
            log.info("step %d/%d: %s eta %s", r.step, cfg.steps, info, format_eta(eta))

        controller.progress = on_step
        return asyncio.run(_run_then_close_pool(controller, state, start_step, rollout))


async def _run_then_close_pool(controller, state, start_step, rollout) -> RunSummary:
    try:
        return await controller.run(state, start_step, rollout=rollout)
    finally:  # the job made the pool: its env threads and any env still open end with it
        await controller.pool.aclose()



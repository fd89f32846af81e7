"""GRPO on the WebShop-style environment under tidejax scheduling.

    python -m tidejax.experiments.webshop                 # tiny model, 8 fake CPU devices
    python -m tidejax.experiments.webshop --system sync   # the same job on a baseline
    python -m tidejax.experiments.webshop --resume        # continue runs/webshop/<name>

Stages: a byte-level BPE trained on the env's text (cached in the run directory), a short
SFT warm start on expert demonstrations (cached), an evaluation of the warm start, then
GRPO steps with rollout, training and resharding driven by `tidejax.runtime.Controller`.
Writes metrics.jsonl, TensorBoard events, a Perfetto trace, PNG plots, Orbax checkpoints
and summary.json into the run directory.
"""

from __future__ import annotations

import os
import sys


def _set_cpu_devices(argv: list[str]) -> None:
    # XLA reads its flags once, when jax initialises, so this must precede every jax import.
    from tidejax.platform import configure_cpu_devices

    n = 8
    for i, arg in enumerate(argv):
        if arg == "--devices" and i + 1 < len(argv):
            n = int(argv[i + 1])
        elif arg.startswith("--devices="):
            n = int(arg.split("=", 1)[1])
    configure_cpu_devices(n)


if __name__ == "__main__":
    _set_cpu_devices(sys.argv[1:])

import argparse  # noqa: E402
import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tidejax import models  # noqa: E402
from tidejax.checkpoint import CheckpointError, Checkpointer  # noqa: E402
from tidejax.config import RunConfig, load_run_config, run_config_from_dict  # noqa: E402
from tidejax.envs import EnvPool, PoolConfig, expert_demonstrations  # noqa: E402
from tidejax.envs.latency import LatencyModel  # noqa: E402
from tidejax.envs.policies import action_format  # noqa: E402
from tidejax.metrics import MetricsWriter, TraceRecorder  # noqa: E402
from tidejax.models.tokenizer import check_matches_model  # noqa: E402
from tidejax.runtime.controller import Controller, RunSummary, StepRecord  # noqa: E402
from tidejax.runtime.episode import (  # noqa: E402
    EpisodeTokens,
    add_observation,
    close_action,
    open_episode,
)
from tidejax.runtime.sft import sft_warm_start  # noqa: E402

log = logging.getLogger("tidejax.webshop")


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
    tokenizer = models.train_bpe(texts, cfg.tokenizer_vocab)
    tokenizer.save(path)
    return tokenizer


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


def make_pool(cfg: RunConfig) -> EnvPool:
    latency = LatencyModel.default(time_scale=cfg.env_time_scale, seed=cfg.seed)
    pool_cfg = PoolConfig(capacity=cfg.rollout.env_capacity)
    if cfg.env_servers:
        return EnvPool(pool_cfg, addresses=list(cfg.env_servers), latency=latency)
    return EnvPool(pool_cfg, latency=latency)


def config_from_args(args) -> RunConfig:
    base = load_run_config(args.config) if args.config else RunConfig()
    over: dict = {}
    for key in ("system", "preset", "hf_path", "tokenizer_path", "seed", "steps"):
        value = getattr(args, key)
        if value is not None:
            over[key] = value
    if args.env_servers:
        over["env_servers"] = [s for s in args.env_servers.split(",") if s]
    if args.devices is not None:
        over["topology"] = {"devices": args.devices}
    if args.sft_steps is not None:
        over["sft"] = {"steps": args.sft_steps}
    if args.quick:  # CI: a few short steps, same code paths
        over.setdefault("steps", 2)
        over.update(eval_every=2, eval_groups=2, batch_groups=2, min_batch_groups=1,
                    group_size=2, max_turns=3, env_time_scale=0.05, checkpoint_every=1)
        over["sft"] = {"steps": 2, "episodes": 8, "batch_sequences": 4}
    return run_config_from_dict(over, base)


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
    return out


# ---------------------------------------------------------------------------- main
def run(cfg: RunConfig, run_dir: str, resume: bool = False, show_progress: bool = True,
        compile_cache: str | None = None) -> dict:
    os.makedirs(run_dir, exist_ok=True)
    if compile_cache:  # later runs (and --resume) skip most XLA compilation
        jax.config.update("jax_compilation_cache_dir", compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    devices = jax.devices()[:cfg.topology.devices]
    if len(devices) < cfg.topology.devices:
        raise ValueError(f"topology.devices={cfg.topology.devices} but only {len(devices)} "
                         "devices are visible (on CPU set --devices before jax starts)")
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=1, default=str)
    demos = expert_demonstrations(cfg.env_type, max(cfg.sft.episodes, 1), seed=cfg.seed)
    tokenizer = build_tokenizer(cfg, run_dir, demos)
    if cfg.hf_path:
        model_config, params = models.load_hf(cfg.hf_path, dtype="float32")
    else:
        model_config = models.get_preset(cfg.preset)
        if cfg.model_vocab_size is not None:
            model_config = model_config.replace(vocab_size=cfg.model_vocab_size)
        params = models.init_params(model_config, jax.random.key(cfg.seed))
    check_matches_model(tokenizer, model_config.vocab_size)

    writer = MetricsWriter(run_dir, enabled=jax.process_index() == 0)
    trace = TraceRecorder()
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), max_to_keep=cfg.keep_checkpoints)
    t0 = time.perf_counter()
    params = sft_warm_start(cfg, model_config, params,
                            demo_episode_tokens(tokenizer, cfg.env_type, demos),
                            devices, os.path.join(run_dir, "sft_params.npz"), writer)
    sft_s = time.perf_counter() - t0
    ref_identity = {"source": cfg.hf_path or f"{cfg.preset}+sft", "seed": cfg.seed,
                    "sft_steps": cfg.sft.steps}

    def checkpoint(step, state, controller):
        ckpt.save(step, state, ref_model=ref_identity, data_cursor=controller.data_cursor,
                  controller={"version": controller.version, "system": cfg.system})

    controller = Controller(cfg, model_config, params, tokenizer, make_pool(cfg), devices,
                            writer, trace, checkpoint, progress=None)
    state, start_step = None, 0
    if resume and ckpt.latest_step() is not None:
        partition = controller.initial_partition()
        _, _, actor = controller._roles(partition)
        abstract = controller.runner.trainer_for(actor).abstract_state()
        try:
            restored = ckpt.restore(abstract)
            state, start_step = restored.state, restored.step
            controller.data_cursor = int(restored.data_cursor or 0)
            log.info("resumed from step %d (data cursor %d)", start_step,
                     controller.data_cursor)
        except CheckpointError as e:
            log.warning("no usable checkpoint (%s); starting from the warm start", e)
    summary = _run_with_progress(controller, state, start_step, cfg, show_progress)
    ckpt.wait()
    ckpt.close()
    trace.save(os.path.join(run_dir, "trace.json"))
    save_plots(summary.records, summary.eval, os.path.join(run_dir, "plots.png"))
    writer.close()
    out = summary_dict(summary) | {"sft_seconds": sft_s, "run_dir": run_dir}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(out, f, indent=1, default=float)
    return out


def _run_with_progress(controller, state, start_step, cfg, show_progress) -> RunSummary:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn(
        "{task.completed}/{task.total}"), TimeElapsedColumn(), TextColumn("{task.fields[info]}")]
    with Progress(*columns, disable=not show_progress, transient=False) as progress:
        bar = progress.add_task(f"GRPO [{cfg.system}]", total=cfg.steps, completed=start_step,
                                info="")

        def on_step(r: StepRecord):
            info = (f"reward {r.train_reward:.2f} succ {r.train_success:.2f} "
                    f"goodput {r.goodput:.0f} tok/s TWT {r.twt_s:.1f}s RWT {r.rwt_s:.1f}s "
                    f"hit {r.kv_hit_rate:.2f} part {r.partition} {r.mode}")
            progress.update(bar, completed=r.step, info=info)
            log.info("step %d: %s", r.step, info)

        controller.progress = on_step
        return asyncio.run(controller.run(state, start_step))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="GRPO on WebShop under tidejax scheduling")
    parser.add_argument("--system", choices=("sync", "async", "stream", "tide"))
    parser.add_argument("--steps", type=int)
    parser.add_argument("--preset", help="model preset (tiny, qwen2.5-0.5b, ..., qwen2.5-14b)")
    parser.add_argument("--hf-path", dest="hf_path", help="HF Qwen2 checkpoint directory")
    parser.add_argument("--tokenizer", dest="tokenizer_path", help="tokenizer.json path")
    parser.add_argument("--devices", type=int, help="devices to use (CPU: fake device count)")
    parser.add_argument("--env-servers", help="comma-separated env server addresses host:port")
    parser.add_argument("--config", help="JSON or TOML file of RunConfig overrides")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--sft-steps", type=int)
    parser.add_argument("--out", default=None, help="run directory (default runs/webshop/<system>)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument("--quick", action="store_true", help="a tiny run for CI smoke tests")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--compile-cache", default=os.path.join("runs", ".jax_cache"),
                        help="persistent XLA compilation cache directory ('' disables it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        force=True)
    cfg = config_from_args(args)
    run_dir = args.out or os.path.join("runs", "webshop", cfg.system)
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    out = run(cfg, run_dir, resume=args.resume, show_progress=not args.no_progress,
              compile_cache=args.compile_cache or None)
    evals = out["eval_success"]
    first, last = (evals[min(evals)], evals[max(evals)]) if evals else (float("nan"),) * 2
    print(f"system={cfg.system} steps={out['steps']} goodput={out['goodput']:.1f} "
          f"kv_hit_rate={out['kv_hit_rate']:.3f} sft_success={first:.3f} "
          f"final_success={last:.3f} run_dir={run_dir}")


if __name__ == "__main__":
    main()

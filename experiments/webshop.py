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
import logging  # noqa: E402

from tidejax.config import RunConfig, load_run_config, run_config_from_dict  # noqa: E402
from tidejax.runtime.job import run_job, warm_start  # noqa: E402
from tidejax.runtime.manager import AllRanksFailed  # noqa: E402


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
        rollout = base.topology.rollout_ranks
        if rollout >= args.devices:  # keep the default split valid on fewer devices
            rollout = max(1, args.devices // 2)
        over["topology"] = {"devices": args.devices, "rollout_ranks": rollout}
    if args.sft_steps is not None:
        over["sft"] = {"steps": args.sft_steps}
    if args.quick:  # CI: a few short steps, same code paths
        over.setdefault("steps", 2)
        over.update(eval_every=2, eval_groups=2, eval_samples=1, batch_groups=2,
                    min_batch_groups=1, group_size=2, max_turns=3, env_time_scale=0.05,
                    checkpoint_every=1)
        over["sft"] = {"steps": 2, "episodes": 8, "batch_sequences": 4}
    return run_config_from_dict(over, base)


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
    parser.add_argument("--sft-only", action="store_true",
                        help="only build the tokenizer and SFT warm start into --out, on the "
                             "visible devices (e.g. one GPU), for a later job with the same --out")
    parser.add_argument("--distributed", action="store_true",
                        help="call jax.distributed.initialize() first (multi-host launch)")
    parser.add_argument("--compile-cache", default=os.path.join("runs", ".jax_cache"),
                        help="persistent XLA compilation cache directory ('' disables it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        force=True)
    cfg = config_from_args(args)
    if args.distributed:
        import jax

        jax.distributed.initialize()
    run_dir = args.out or os.path.join("runs", "webshop", cfg.system)
    for noisy in ("bm25s", "absl"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.sft_only:
        import jax

        os.makedirs(run_dir, exist_ok=True)
        _, _, _, seconds = warm_start(cfg, run_dir, jax.devices()[:cfg.sft.devices])
        print(f"sft_seconds={seconds:.1f} backend={jax.default_backend()} run_dir={run_dir}")
        return
    try:
        out = run_job(cfg, run_dir, resume=args.resume, show_progress=not args.no_progress,
                      compile_cache=args.compile_cache or None)
    except AllRanksFailed as e:
        logging.getLogger("tidejax.job").error(
            "run stopped: %s. The last checkpoint in %s is intact; restore the rollout ranks "
            "and rerun with --resume.", e, os.path.join(run_dir, "checkpoints"))
        sys.exit(3)
    evals = out["eval_success"]
    first, last = (evals[min(evals)], evals[max(evals)]) if evals else (float("nan"),) * 2
    print(f"system={cfg.system} steps={out['steps']} goodput={out['goodput']:.1f} "
          f"kv_hit_rate={out['kv_hit_rate']:.3f} sft_success={first:.3f} "
          f"final_success={last:.3f} run_dir={run_dir}")


if __name__ == "__main__":
    main()

"""GRPO on the WebShop-style environment under tidejax scheduling.

    python -m tidejax.experiments.webshop                 # tiny model, 8 fake CPU devices
    python -m tidejax.experiments.webshop --system sync   # the same job on a baseline
    python -m tidejax.experiments.webshop --resume        # continue runs/webshop/<name>
    python -m tidejax.experiments.webshop --env-type my_pkg.envs:MyEnv  # a user's env

Any env type runs here: a built-in name, an installed plugin (entry-point group
`tidejax.envs`) or "package.module:Class"; its settings come from the config file's
`[env]` table (or --env-settings JSON). An env without an expert skips SFT.

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
import shlex  # noqa: E402

from tidejax.config import (RunConfig, absolute_path, layer_overrides,  # noqa: E402
                            read_config_file, resolve_paths, run_config_from_dict)
from tidejax.runtime.cluster import Launch, StageError, exit_now  # noqa: E402
from tidejax.runtime.job import refuse_multi_process_sft_only, run_job, warm_start  # noqa: E402
from tidejax.runtime.layout import LayoutError  # noqa: E402
from tidejax.runtime.manager import AllRanksFailed  # noqa: E402
from tidejax.runtime.stop import RunStopped, StopRequest  # noqa: E402
from tidejax.sched.systems import SYSTEMS  # noqa: E402

# `--quick`: a few short steps on the same code paths (CI smoke runs). A preset, so the
# config file and explicit flags override it field by field.
QUICK_PRESET = {"steps": 2, "eval_every": 2, "eval_groups": 2, "eval_samples": 1,
                "batch_groups": 2, "min_batch_groups": 1, "group_size": 2, "max_turns": 3,
                "env_time_scale": 0.05, "checkpoint_every": 1,
                "sft": {"steps": 2, "episodes": 8, "batch_sequences": 4}}


def flag_overrides(args) -> dict:
    """The RunConfig fields set explicitly on the command line."""
    over: dict = {}
    for key in ("system", "preset", "hf_path", "tokenizer_path", "seed", "steps", "env_type"):
        value = getattr(args, key)
        if value is not None:
            over[key] = value
    if args.env_servers:
        over["env_servers"] = [s for s in args.env_servers.split(",") if s]
    if args.env_settings is not None:
        over["env"] = env_settings_flag(args.env_settings)
    if args.devices is not None:
        over["topology"] = {"devices": args.devices}
    if args.sft_steps is not None:
        over["sft"] = {"steps": args.sft_steps}
    return over


def env_settings_flag(text: str) -> dict:
    """--env-settings: a JSON object, the `[env]` table given on the command line."""
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--env-settings is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--env-settings must be a JSON object, e.g. '{\"size\": 5}'")
    return value


def config_from_args(args) -> RunConfig:
    """Precedence, field by field: flag > config file > preset (`--quick`) > default.
    Paths come back absolute (relative ones are read against the working directory)."""
    preset = QUICK_PRESET if args.quick else {}
    from_file = read_config_file(absolute_path(args.config)) if args.config else {}
    flags = flag_overrides(args)
    merged = layer_overrides(preset, from_file, flags)
    if args.devices is not None and "rollout_ranks" not in from_file.get("topology", {}):
        # Keep the default split valid on fewer devices; a split the file chose is checked.
        rollout = merged.get("topology", {}).get("rollout_ranks",
                                                RunConfig().topology.rollout_ranks)
        if rollout >= args.devices:
            merged["topology"]["rollout_ranks"] = max(1, args.devices // 2)
    return resolve_paths(run_config_from_dict(merged))


class CurrentStderrHandler(logging.StreamHandler):
    """Logs to whatever `sys.stderr` is at each record, so the live progress bar, which
    redirects it while drawn, prints log lines above itself instead of through itself."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ assigns the stream it was given
        pass


def shown_path(path: str) -> str:
    """`path` as a newcomer would type it: relative when under the working directory."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def resume_command(argv: list[str]) -> str:
    args = [a for a in argv if a != "--resume"] + ["--resume"]
    return " ".join(["python -m tidejax.experiments.webshop", *map(shlex.quote, args)])


def outputs_line(run_dir: str) -> str:
    d = shown_path(run_dir)
    return (f"outputs in {d}/: metrics.jsonl, summary.json, plots.png (reward, goodput, "
            f"partition), trace.json (open at ui.perfetto.dev), checkpoints/; TensorBoard: "
            f"tensorboard --logdir {os.path.join(d, 'tensorboard')}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="GRPO on WebShop under tidejax scheduling")
    parser.add_argument("--system", choices=tuple(SYSTEMS))
    parser.add_argument("--steps", type=int)
    parser.add_argument("--preset", help="model preset (tiny, qwen2.5-0.5b, ..., qwen2.5-14b)")
    parser.add_argument("--hf-path", dest="hf_path", help="HF Qwen2 checkpoint directory")
    parser.add_argument("--tokenizer", dest="tokenizer_path", help="tokenizer.json path")
    parser.add_argument("--devices", type=int,
                        help="devices to use per process (CPU: fake device count)")
    parser.add_argument("--env-type", dest="env_type",
                        help="env: webshop, household, a plugin or 'package.module:Class'")
    parser.add_argument("--env-settings", dest="env_settings",
                        help="JSON object of the env's settings (the config's [env] table)")
    parser.add_argument("--env-servers", help="comma-separated env server addresses host:port")
    parser.add_argument("--config", help="JSON or TOML file of RunConfig overrides")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--sft-steps", type=int)
    parser.add_argument("--out", default=None, help="run directory (default runs/webshop/<system>)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument("--quick", action="store_true",
                        help="a preset of a few tiny steps (CI smoke runs); flags override it")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--sft-only", action="store_true",
                        help="only build the tokenizer and SFT warm start into --out, on the "
                             "visible devices (e.g. one GPU), for a later job with the same --out")
    parser.add_argument("--distributed", action="store_true",
                        help="join a multi-process job, letting jax.distributed detect the "
                             "cluster (SLURM, Open MPI, ...)")
    parser.add_argument("--coordinator", help="host:port of process 0 (multi-process launch; "
                                              "with --num-processes and --process-id)")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--process-timeout", type=int, default=30,
                        help="seconds before processes out of step or a dead peer fail the run")
    parser.add_argument("--compile-cache", default=os.path.join("runs", ".jax_cache"),
                        help="persistent XLA compilation cache directory ('' disables it)")
    return parser


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    # tidejax reports progress at INFO; libraries speak only when something is wrong (jax
    # logs each platform it probes and does not find, e.g. TPU, at INFO).
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s",
                        handlers=[CurrentStderrHandler()], force=True)
    logging.getLogger("tidejax").setLevel(logging.INFO)
    logging.getLogger("bm25s").setLevel(logging.WARNING)  # it sets itself to DEBUG
    try:
        cfg = config_from_args(args)
    except (ValueError, FileNotFoundError) as e:  # a bad field or env: named, no traceback
        print(f"tidejax: bad config: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        launch = Launch(coordinator=args.coordinator, num_processes=args.num_processes,
                        process_id=args.process_id, auto=args.distributed,
                        timeout_s=args.process_timeout)
    except ValueError as e:
        print(f"tidejax: bad launch: {e}", file=sys.stderr)
        sys.exit(2)
    # Before jax.distributed and the backend start their threads, so that none of them is
    # interrupted by a signal (tidejax/runtime/stop.py); a stop is agreed by every process
    # at the next boundary (runtime/controller.py).
    stop = StopRequest().install()
    launch.initialize()
    stop.reclaim_handlers()
    run_dir = absolute_path(args.out or os.path.join("runs", "webshop", cfg.system))
    compile_cache = absolute_path(args.compile_cache) if args.compile_cache else None
    log = logging.getLogger("tidejax.job")
    if args.sft_only:
        import jax

        os.makedirs(run_dir, exist_ok=True)
        try:
            refuse_multi_process_sft_only()
            _, _, _, seconds = warm_start(cfg, run_dir, jax.devices()[:cfg.topology.devices],
                                          stop=stop)
        except LayoutError as e:
            print(f"tidejax: cannot start: {e}", file=sys.stderr)
            sys.exit(2)
        except RunStopped as e:
            log.error("warm start stopped by %s before it finished; nothing was cached",
                      e.signal_name)
            sys.exit(128 + e.signum)
        print(f"sft_seconds={seconds:.1f} backend={jax.default_backend()} "
              f"run_dir={shown_path(run_dir)}")
        return
    try:
        out = run_job(cfg, run_dir, resume=args.resume, show_progress=not args.no_progress,
                      compile_cache=compile_cache, stop=stop,
                      process_timeout_s=launch.timeout_s)
    except LayoutError as e:  # raised before anything is built: nothing to keep
        print(f"tidejax: cannot start: {e}", file=sys.stderr)
        sys.exit(2)
    except StageError as e:  # processes out of step, or one gone: the others may hang
        log.error("run failed: %s. The last checkpoint in %s is intact; rerun every process "
                  "with --resume.", e, shown_path(os.path.join(run_dir, "checkpoints")))
        exit_now(4)
    except AllRanksFailed as e:
        log.error("run stopped: %s. The last checkpoint in %s is intact; restore the rollout "
                  "ranks and rerun with --resume.", e,
                  shown_path(os.path.join(run_dir, "checkpoints")))
        sys.exit(3)
    except RunStopped as e:
        name = e.signal_name
        if e.step is None:
            print(f"stopped by {name} during the warm start, before the first checkpoint; "
                  f"rerun to start it again: {resume_command(argv)}", file=sys.stderr)
        else:
            print(f"stopped by {name} after step {e.step} of {cfg.steps}; checkpoint in "
                  f"{shown_path(os.path.join(run_dir, 'checkpoints'))}. Resume with:\n  "
                  f"{resume_command(argv)}", file=sys.stderr)
        print(outputs_line(run_dir), file=sys.stderr)
        sys.exit(128 + e.signum)
    finally:
        stop.uninstall()
    evals = out["eval_success"]
    first, last = (evals[min(evals)], evals[max(evals)]) if evals else (float("nan"),) * 2
    gain = out["learning"]
    learning = (f"first_reward={gain['first_reward']:.3f} last_reward={gain['last_reward']:.3f} "
                f"reward_gain={gain['reward_gain']:.3f} gain_se={gain['reward_gain_se']:.3f} "
                f"eval_episodes={gain['last_episodes']} " if gain else "")
    print(f"system={cfg.system} steps={out['steps']} goodput={out['goodput']:.1f} "
          f"kv_hit_rate={out['kv_hit_rate']:.3f} sft_success={first:.3f} "
          f"final_success={last:.3f} {learning}run_dir={shown_path(run_dir)}")
    print(outputs_line(run_dir))


if __name__ == "__main__":
    main()

"""Fidelity across systems: do sync, fixed-ratio async and tide learn alike per step, and
how soon in wall-clock time does tide reach what sync reaches?

    python -m tidejax.bench.learning [--seeds 0,1,2] [--systems sync,async,tide]
                                     [--config FILE] [--variant LABEL=FILE ...]
                                     [--steps N] [--out runs/bench_learning]

Every system runs the default job's learnable configuration (or `--config`) for the same
steps from the same warm start (shared, so seeds vary only the RL run), one run at a time
in one process. Writes `learning.jsonl` (per run: every step's train reward and success
and every evaluation's reward, standard error and success, each with the wall-clock second
since the run's first step began at which that policy version existed) and
`learning_curves.png` (the mean over seeds with a band of one standard error, per step
and per second).

Last line: `tide_vs_sync_final_gap=<x> gap_se=<y> tide_time_to_sync_final=<z>`: tide's
final evaluation reward minus sync's (means over seeds), the standard error of that
difference over seeds, and the wall-clock time at which tide's mean evaluation curve first
reaches sync's mean final reward as a fraction of the time sync took to produce its final
version (linear between evaluations; inf if tide never reaches it).

`--variant LABEL=FILE` (repeatable) also runs tide with FILE's overrides on top of the base
configuration, beside the others in the same run (same seeds, warm start and machine), and
prints before the last line `variant=LABEL vs_tide_final_gap=<x> paired_se=<y>
vs_sync_final_gap=<z>`: the gap to plain tide is paired by seed (each seed's difference, its
standard error over seeds), so a change to tide is judged against tide measured alongside.
"""

from __future__ import annotations

from tidejax.platform import configure_cpu_devices

configure_cpu_devices(8)

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402

from tidejax.config import RunConfig, load_run_config, run_config_from_dict  # noqa: E402
from tidejax.metrics import read_jsonl  # noqa: E402
from tidejax.runtime.job import run_job  # noqa: E402

SYSTEMS = ("sync", "async", "tide")


def version_times(steps: list[dict]) -> dict[int, float]:
    """Seconds since the run's first step began at which each policy version existed
    (version 0 at 0; version v when step v's update and boundary ended)."""
    times, elapsed = {0: 0.0}, 0.0
    for record in sorted(steps, key=lambda r: r["step"]):
        elapsed += record["step_s"]
        times[record["version"]] = elapsed
    return times


def run_curves(run_dir: str) -> dict:
    """One run's learning curves from its metrics.jsonl."""
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    times = version_times(steps)
    return {
        "steps": [{"step": r["step"], "time_s": times[r["version"]],
                   "train_reward": r["train_reward"], "train_success": r["train_success"]}
                  for r in sorted(steps, key=lambda r: r["step"])],
        "evals": [{"version": e["version"], "time_s": times[e["version"]],
                   "reward": e["reward"], "reward_se": e["reward_se"],
                   "success": e["success"], "episodes": e["episodes"]}
                  for e in sorted(evals, key=lambda e: e["version"])],
    }


def mean_eval_curve(runs: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(versions, mean time, mean reward, standard error over seeds) at the versions every
    run evaluated."""
    common = sorted(set.intersection(*[{e["version"] for e in r["evals"]} for r in runs]))
    by_version = [{e["version"]: e for e in r["evals"]} for r in runs]
    rewards = np.array([[bv[v]["reward"] for v in common] for bv in by_version])
    times = np.array([[bv[v]["time_s"] for v in common] for bv in by_version])
    se = (rewards.std(axis=0, ddof=1) / math.sqrt(len(runs)) if len(runs) > 1
          else np.full(len(common), np.nan))
    return np.array(common), times.mean(axis=0), rewards.mean(axis=0), se


def first_time_reaching(times: np.ndarray, rewards: np.ndarray, target: float) -> float:
    """The first time a piecewise-linear reward curve reaches `target` (inf if never)."""
    if rewards[0] >= target:
        return float(times[0])
    for i in range(1, len(rewards)):
        if rewards[i] >= target:
            t0, t1, r0, r1 = times[i - 1], times[i], rewards[i - 1], rewards[i]
            return float(t0 + (target - r0) / (r1 - r0) * (t1 - t0))
    return math.inf


def compare(curves: dict[str, list[dict]]) -> dict:
    """Tide against sync: final-reward gap with its standard error over seeds, and tide's
    time to sync's final reward as a fraction of sync's time."""
    finals = {s: np.array([r["evals"][-1]["reward"] for r in runs]) for s, runs in curves.items()}
    n_tide, n_sync = len(finals["tide"]), len(finals["sync"])
    gap = float(finals["tide"].mean() - finals["sync"].mean())
    gap_se = (math.sqrt(finals["tide"].var(ddof=1) / n_tide + finals["sync"].var(ddof=1) / n_sync)
              if min(n_tide, n_sync) > 1 else math.nan)
    _, sync_t, sync_r, _ = mean_eval_curve(curves["sync"])
    _, tide_t, tide_r, _ = mean_eval_curve(curves["tide"])
    reach = first_time_reaching(tide_t, tide_r, float(sync_r[-1]))
    return {"tide_vs_sync_final_gap": gap, "gap_se": gap_se,
            "tide_time_to_sync_final": reach / sync_t[-1] if sync_t[-1] > 0 else math.nan,
            "finals": {s: f.tolist() for s, f in finals.items()}}


def paired_gap(variant: list[dict], reference: list[dict]) -> tuple[float, float]:
    """Mean and standard error over seeds of the per-seed final-reward difference (runs
    listed in the same seed order)."""
    diffs = np.array([v["evals"][-1]["reward"] - r["evals"][-1]["reward"]
                      for v, r in zip(variant, reference, strict=True)])
    se = float(diffs.std(ddof=1) / math.sqrt(len(diffs))) if len(diffs) > 1 else math.nan
    return float(diffs.mean()), se


def parse_variants(specs: list[str], base: RunConfig) -> dict[str, RunConfig]:
    """`LABEL=FILE` specs as tide configs: FILE's overrides on top of `base`."""
    variants: dict[str, RunConfig] = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"--variant {spec!r}: expected LABEL=FILE")
        if label in SYSTEMS or label in variants:
            raise ValueError(f"--variant {spec!r}: label {label!r} is a system name or repeated")
        variants[label] = load_run_config(path, base).replace(system="tide")
    return variants


def plot(curves: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for system, runs in curves.items():
        versions, times, mean, se = mean_eval_curve(runs)
        band = np.nan_to_num(se)
        for ax, x in ((axes[0], versions), (axes[1], times)):
            (line,) = ax.plot(x, mean, "o-", label=f"{system} ({len(runs)} seeds)")
            ax.fill_between(x, mean - band, mean + band, color=line.get_color(), alpha=0.2)
        steps = np.array([[s["step"] for s in r["steps"]] for r in runs])
        success = np.array([[s["train_success"] for s in r["steps"]] for r in runs])
        reward = np.array([[s["train_reward"] for s in r["steps"]] for r in runs])
        axes[2].plot(steps[0], reward.mean(axis=0), label=f"{system} reward")
        axes[2].plot(steps[0], success.mean(axis=0), "--", label=f"{system} success")
    axes[0].set(xlabel="policy version (step)", ylabel="eval reward", title="per step")
    axes[1].set(xlabel="wall-clock s since the first step", ylabel="eval reward",
                title="per second")
    axes[2].set(xlabel="step", title="train reward and success (mean over seeds)")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--config", help="RunConfig overrides (default: the default job's)")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=FILE",
                        help="also run tide with FILE's overrides on top of the base config")
    parser.add_argument("--steps", type=int, help="GRPO steps (default: the config's)")
    parser.add_argument("--out", default=os.path.join("runs", "bench_learning"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, force=True)
    logging.getLogger("tidejax").setLevel(logging.INFO)
    systems = args.systems.split(",")
    if "sync" not in systems or "tide" not in systems:
        parser.error("--systems must include sync and tide (the last line compares them)")
    base = load_run_config(args.config) if args.config else run_config_from_dict({})
    if args.steps is not None:
        base = base.replace(steps=args.steps)
    try:
        variants = parse_variants(args.variant, base)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    configs = {s: base.replace(system=s) for s in systems} | variants
    os.makedirs(args.out, exist_ok=True)
    curves: dict[str, list[dict]] = {label: [] for label in configs}
    with open(os.path.join(args.out, "learning.jsonl"), "w") as jsonl:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for system, config in configs.items():
                run_dir = os.path.join(args.out, f"{system}_s{seed}")
                shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends
                out = run_job(config.replace(seed=seed), run_dir,
                              show_progress=False,
                              compile_cache=os.path.join("runs", ".jax_cache"),
                              cache_dir=os.path.join(args.out, "warm_start"))
                curve = run_curves(run_dir)
                curves[system].append(curve)
                jsonl.write(json.dumps({"system": system, "seed": seed, **curve}) + "\n")
                jsonl.flush()
                gain = out["learning"]
                print(f"{system:5s} seed={seed} steps={out['steps']} "
                      f"first_reward={gain['first_reward']:.3f} "
                      f"final_reward={gain['last_reward']:.3f}±{gain['last_reward_se']:.3f} "
                      f"final_success={curve['evals'][-1]['success']:.3f} "
                      f"wall_s={curve['steps'][-1]['time_s']:.0f} "
                      f"goodput={out['goodput']:.1f}", flush=True)
    plot(curves, os.path.join(args.out, "learning_curves.png"))
    result = compare(curves)
    for system, finals in result["finals"].items():
        print(f"{system:5s} final rewards over seeds: "
              + " ".join(f"{f:.3f}" for f in finals) + f" mean {np.mean(finals):.3f}")
    for label in variants:
        gap_tide, paired_se = paired_gap(curves[label], curves["tide"])
        gap_sync = float(np.mean(result["finals"][label]) - np.mean(result["finals"]["sync"]))
        print(f"variant={label} vs_tide_final_gap={gap_tide:.3f} paired_se={paired_se:.3f} "
              f"vs_sync_final_gap={gap_sync:.3f}")
    print(f"tide_vs_sync_final_gap={result['tide_vs_sync_final_gap']:.3f} "
          f"gap_se={result['gap_se']:.3f} "
          f"tide_time_to_sync_final={result['tide_time_to_sync_final']:.2f}")


if __name__ == "__main__":
    main()

"""End-to-end goodput of sync, fixed-ratio async and tide on the same WebShop job.

    python -m tidejax.bench.e2e [--steps 3] [--out runs/bench_e2e]

Each system runs the same steps, batch, env latency, model, tokenizer and SFT warm start
(cached once and shared) in one process, one after another, so compiled engines and
trainers are shared too. Goodput = generated tokens the trainer consumed / wall seconds.
On fake CPU devices moving ranks gives no physical speed-up; overlapping env waits does.
The last line compares steady-state goodput (steps after the first, whose time is mostly
XLA compilation and cold start); whole-run goodput is printed beside it.
"""

from __future__ import annotations

from tidejax.platform import configure_cpu_devices

configure_cpu_devices(8)

import argparse  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402

from tidejax.metrics import read_jsonl  # noqa: E402

from tidejax.config import run_config_from_dict  # noqa: E402
from tidejax.runtime.job import run_job  # noqa: E402

SYSTEMS = ("sync", "async", "tide")
# What this benchmark has always measured: the 1,500-product shop, groups of 4, a short
# perfect-demonstrator warm start; not the default job's small learnable shop.
THROUGHPUT_JOB = {
    "group_size": 4, "eval_every": 0, "checkpoint_every": 0, "max_turns": 5,
    "webshop": {"catalogue": {"n_products": 1500, "goals_per_product": 3}},
    "sft": {"steps": 30, "episodes": 96, "batch_sequences": 8, "skip_options": 0.0},
    "rl": {"loss": {"loss_agg": "token-mean"}, "optim": {"lr": 1e-3}}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-groups", type=int, default=3)
    parser.add_argument("--out", default=os.path.join("runs", "bench_e2e"))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, force=True)
    results = {}
    for system in args.systems.split(","):
        cfg = run_config_from_dict(THROUGHPUT_JOB | {
            "system": system, "steps": args.steps, "batch_groups": args.batch_groups,
            "min_batch_groups": max(1, args.batch_groups - 1)})
        out = run_job(cfg, os.path.join(args.out, system), show_progress=False,
                      compile_cache=os.path.join("runs", ".jax_cache"),
                      cache_dir=os.path.join(args.out, "shared"))
        steps = [r for r in read_jsonl(os.path.join(args.out, system, "metrics.jsonl"))
                 if r["kind"] == "step" and r["step"] > 1]
        out["steady_goodput"] = (sum(r["consumed_tokens"] for r in steps)
                                 / max(sum(r["step_s"] for r in steps), 1e-9))
        results[system] = out
        print(f"{system:6s} steady_goodput={out['steady_goodput']:7.1f} tok/s "
              f"run_goodput={out['goodput']:7.1f} tok/s consumed={out['consumed_tokens']} "
              f"elapsed={out['elapsed_s']:.1f}s TWT={out['twt_s']:.1f}s RWT={out['rwt_s']:.1f}s "
              f"kv_hit_rate={out['kv_hit_rate']:.3f}", flush=True)
    tide = results["tide"]["steady_goodput"]
    print(f"tide_over_sync={tide / results['sync']['steady_goodput']:.2f} "
          f"tide_over_async={tide / results['async']['steady_goodput']:.2f}")


if __name__ == "__main__":
    main()

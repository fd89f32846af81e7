"""End-to-end goodput of sync, fixed-ratio async and tide on the same WebShop job.

    python -m tidejax.bench.e2e [--steps 3] [--out runs/bench_e2e]

Each system runs the same steps, batch, env latency, model, tokenizer and SFT warm start
(cached once and shared) in one process, one after another, so compiled engines and
trainers are shared too. Goodput = generated tokens the trainer consumed / wall seconds.
On fake CPU devices moving ranks gives no physical speed-up; overlapping env waits does.
"""

from __future__ import annotations

from tidejax.platform import configure_cpu_devices

configure_cpu_devices(8)

import argparse  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402

from tidejax.config import run_config_from_dict  # noqa: E402
from tidejax.runtime.job import run_job  # noqa: E402

SYSTEMS = ("sync", "async", "tide")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-groups", type=int, default=3)
    parser.add_argument("--out", default=os.path.join("runs", "bench_e2e"))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, force=True)
    results = {}
    for system in args.systems.split(","):
        cfg = run_config_from_dict({
            "system": system, "steps": args.steps, "batch_groups": args.batch_groups,
            "min_batch_groups": max(1, args.batch_groups - 1), "max_turns": 5,
            "eval_every": 0, "checkpoint_every": 0, "sft": {"steps": 30}})
        out = run_job(cfg, os.path.join(args.out, system), show_progress=False,
                      compile_cache=os.path.join("runs", ".jax_cache"),
                      cache_dir=os.path.join(args.out, "shared"))
        results[system] = out
        print(f"{system:6s} goodput={out['goodput']:8.1f} tok/s consumed={out['consumed_tokens']} "
              f"elapsed={out['elapsed_s']:.1f}s TWT={out['twt_s']:.1f}s RWT={out['rwt_s']:.1f}s "
              f"kv_hit_rate={out['kv_hit_rate']:.3f}", flush=True)
    tide = results["tide"]["goodput"]
    print(f"tide_over_sync={tide / results['sync']['goodput']:.2f} "
          f"tide_over_async={tide / results['async']['goodput']:.2f}")


if __name__ == "__main__":
    main()

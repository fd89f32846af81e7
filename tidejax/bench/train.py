"""Trainer throughput: fused actor step vs the deferred-KL forward + backward pair, and the
reference forward. `python -m tidejax.bench.train [--batch 8 --length 256]`.

Each variant is timed in interleaved rounds (so background load hits all alike) and the
median round is reported. The last line is `deferred_over_fused_time=<x>`: the deferred
pair must not add compute, so x should stay near 1 (target <= 1.1).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from tidejax.models import get_preset, make_mesh
from tidejax.rl import RLConfig, loss_denominator, make_trainer, residual_bytes
from tidejax.rl.testing import random_batch, random_params


def _time(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--micro-batches", type=int, default=2,
                        help="micro-batches accumulated per timed round")
    parser.add_argument("--remat", action="store_true")
    args = parser.parse_args(argv)

    config = get_preset(args.preset)
    rl = RLConfig(remat=True if args.remat else None)  # None: the size-based default
    mesh = make_mesh(jax.devices()[:1])
    trainer = make_trainer(config, rl, mesh)
    rng = np.random.default_rng(0)
    params = trainer.put_params(random_params(config))
    batches = [random_batch(config, rng, args.batch, args.length)
               for _ in range(args.micro_batches)]
    denom = loss_denominator(batches, rl.loss.loss_agg)
    batches = [trainer.put(b) for b in batches]
    refs = [trainer.ref_logprobs(params, b) for b in batches]
    tokens = args.batch * args.length * args.micro_batches

    def reference():
        return [trainer.ref_logprobs(params, b) for b in batches]

    def fused():
        accum = trainer.zero_accum()
        for b, r in zip(batches, refs):
            accum = trainer.actor_grads(params, b, r, denom, accum)
        return accum

    def deferred():
        # The runtime's decoupled order: forward first (no ref needed), backward when the
        # reference log-probs arrive.
        accum = trainer.zero_accum()
        for b, r in zip(batches, refs):
            logp, pullback = trainer.actor_forward(params, b)
            accum = trainer.actor_backward(pullback, logp, r, b, denom, accum)
        return accum

    variants = {"fused actor step": fused, "deferred fwd+bwd": deferred,
                "reference forward": reference}
    for fn in variants.values():  # compile and warm up
        _time(fn)
        _time(fn)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(_time(fn))

    _, pullback = trainer.actor_forward(params, batches[0])
    print(f"preset={args.preset} batch={args.batch}x{args.length} "
          f"micro_batches={args.micro_batches} remat={args.remat} "
          f"devices={jax.devices()[0].platform}x1 rounds={args.rounds}")
    print(f"residuals per micro-batch: {residual_bytes(pullback) / 2**20:.1f} MiB "
          f"(parameters included)")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in medians.items():
        print(f"{name:>18}: {tokens / seconds:12,.0f} tokens/s  ({seconds * 1e3:8.1f} ms "
              f"per {args.micro_batches} micro-batches)")
    ratio = medians["deferred fwd+bwd"] / medians["fused actor step"]
    print(f"deferred_over_fused_time={ratio:.3f}")
    return ratio


if __name__ == "__main__":
    main()

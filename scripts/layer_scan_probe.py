"""Does slicing stacked layer weights inside `lax.scan` cost a copy of each layer's weights?

A decode-shaped MLP stack (batch 8, one token per layer pass, 8 tokens per call in a
`fori_loop`, as the engine's multi-token decode) run two ways on the default device:
layers scanned over stacked weights (the model's layout) and unrolled over per-layer
arrays. Both read each weight once per token; if XLA copies the scanned slice, the scan
moves about three times the bytes. Prints each variant's time and weight-read bandwidth,
then `scan_over_unrolled_time=<x>`.

    python scripts/layer_scan_probe.py                                   # CPU size
    python scripts/layer_scan_probe.py --layers 8 --d 3584 --f 18944 --dtype bfloat16  # GPU
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--f", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8, help="decode steps per call")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 2)
    stacked = {"up": (0.02 * jax.random.normal(keys[0], (args.layers, args.d, args.f))).astype(dtype),
               "down": (0.02 * jax.random.normal(keys[1], (args.layers, args.f, args.d))).astype(dtype)}
    # Per-layer arrays of their own (copies, so nothing aliases the stack).
    per_layer = [jax.tree.map(lambda a, i=i: a[i].copy(), stacked) for i in range(args.layers)]

    def layer(x, weights):
        return x + jax.nn.gelu(x @ weights["up"]) @ weights["down"]

    @jax.jit
    def scanned(x, weights):
        def token(_, x):
            return jax.lax.scan(lambda h, w: (layer(h, w), None), x, weights)[0]
        return jax.lax.fori_loop(0, args.tokens, token, x)

    @jax.jit
    def unrolled(x, weights):
        def token(_, x):
            for w in weights:
                x = layer(x, w)
            return x
        return jax.lax.fori_loop(0, args.tokens, token, x)

    x = jnp.ones((args.batch, args.d), dtype)
    variants = {"scan over stacked": lambda: scanned(x, stacked),
                "unrolled per-layer": lambda: unrolled(x, per_layer)}
    outputs = {name: np.asarray(jax.block_until_ready(run()), np.float32)
               for name, run in variants.items()}
    np.testing.assert_allclose(*outputs.values(), rtol=2e-2, atol=2e-2)
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.rounds):  # interleaved rounds, fastest kept
        for name, run in variants.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            best[name] = min(best[name], time.perf_counter() - start)
    weight_bytes = 2 * args.layers * args.d * args.f * dtype.itemsize * args.tokens
    print(f"backend={jax.default_backend()} layers={args.layers} d={args.d} f={args.f} "
          f"dtype={dtype.name} batch={args.batch} tokens/call={args.tokens}")
    for name, seconds in best.items():
        print(f"{name}: {seconds * 1e3:.2f} ms per call, "
              f"{weight_bytes / seconds / 1e9:.1f} GB/s of weight reads")
    print(f"scan_over_unrolled_time={best['scan over stacked'] / best['unrolled per-layer']:.2f}")


if __name__ == "__main__":
    main()

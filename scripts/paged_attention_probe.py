"""Decode attention alone: the engine's gather kernel against two Pallas GPU kernels.

One decode step's attention for `--slots` rows at Qwen2.5-7B head shapes (28 query heads,
4 KV heads, head dim 128), each row holding a random number of cached tokens. The engine's
`gather_kernel` reads its `[P, S, K, H]` pool and takes the new token's K/V beside it; the
Pallas kernel (`jax.experimental.pallas.ops.gpu.paged_attention`) reads a `[K, P, S, H]`
pool into which the new token was written first (vLLM's order). Checks they agree, then
(on a GPU) times both and prints the bytes of live K/V each step must read per second.
tidejax's own kernel (`serving.pallas_attention`, the engine's `attention="pallas"`) reads the
engine's pool as it is and takes the new token beside it. On a CPU the Pallas kernels run
in interpret mode: parity only, at `--pages 8`.

    python scripts/paged_attention_probe.py --slots 4 --pages 8     # CPU parity
    python scripts/paged_attention_probe.py                          # GPU: parity + timing

Last line: `pallas_over_gather_time=<x> gather_gbps=<y> pallas_gbps=<z>
tidejax_over_gather_time=<x> tidejax_gbps=<y>` (nan on CPU).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged

from tidejax.serving.pallas_attention import paged_decode_attention
from tidejax.serving.paged_attention import gather_kernel


def median_seconds(fn, rounds: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--pages", type=int, default=128, help="pages per row (x16 tokens)")
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    page_size, dtype = 16, jnp.dtype(args.dtype)
    B, N, K, H, pages = args.slots, args.heads, args.kv_heads, args.head_dim, args.pages
    rng = np.random.default_rng(0)
    num_pages = B * pages
    # Each row's cached length leaves room for the new token inside its pages.
    cached = rng.integers(1, pages * page_size - 1, B).astype(np.int32)
    table = rng.permutation(num_pages).reshape(B, pages).astype(np.int32)
    k_pool = rng.normal(size=(num_pages, page_size, K, H)).astype(np.float32)
    v_pool = rng.normal(size=k_pool.shape).astype(np.float32)
    q = rng.normal(size=(B, 1, N, H)).astype(np.float32)
    k_new = rng.normal(size=(B, 1, K, H)).astype(np.float32)
    v_new = rng.normal(size=(B, 1, K, H)).astype(np.float32)

    def as_device(x):
        return jnp.asarray(x, dtype)

    gather = jax.jit(gather_kernel)
    gather_args = [as_device(q), as_device(k_new), as_device(v_new), as_device(k_pool),
                   as_device(v_pool), jnp.asarray(table), jnp.asarray(cached)]
    expected = gather(*gather_args)

    # The Pallas layout: the new token written at its position first, K heads outermost.
    rows = np.arange(B)
    page_of_new = table[rows, cached // page_size]
    k_written, v_written = k_pool.copy(), v_pool.copy()
    k_written[page_of_new, cached % page_size] = k_new[:, 0]
    v_written[page_of_new, cached % page_size] = v_new[:, 0]
    k_kpsh = as_device(k_written.transpose(2, 0, 1, 3))
    v_kpsh = as_device(v_written.transpose(2, 0, 1, 3))
    k_splits = min(16, pages)
    pallas = jax.jit(lambda q, k, v, t, n: pallas_paged.paged_attention(
        q, k, v, t, n, k_splits=k_splits, pages_per_compute_block=min(8, pages // k_splits),
        interpret=not on_gpu))
    # The Pallas kernel does not scale the scores; the engine's attention does (1/sqrt(H)).
    pallas_args = [as_device(q[:, 0] / np.sqrt(H)), k_kpsh, v_kpsh, jnp.asarray(table),
                   jnp.asarray(cached + 1)]
    got = pallas(*pallas_args)
    want = np.asarray(expected[:, 0], np.float32)
    error = np.linalg.norm(np.asarray(got, np.float32) - want) / np.linalg.norm(want)
    print(f"backend={jax.default_backend()} slots={B} pages/row={pages} heads={N}/{K}x{H} "
          f"dtype={dtype.name}: relative difference {error:.2e}")
    assert error < (2e-2 if dtype == jnp.bfloat16 else 1e-4), error
    # tidejax's own kernel reads the engine's [L, P, S, K, H] pool (here L = 1) as it is and
    # folds the new token in itself.
    ours = jax.jit(lambda q, k_new, v_new, k_pool, v_pool, table, cached: paged_decode_attention(
        q, k_new, v_new, k_pool, v_pool, jnp.int32(0), table, cached, interpret=not on_gpu))
    ours_args = [as_device(q[:, 0]), as_device(k_new[:, 0]), as_device(v_new[:, 0]),
                 as_device(k_pool[None]), as_device(v_pool[None]), jnp.asarray(table),
                 jnp.asarray(cached)]
    try:  # never yet run on a GPU: a failure must not lose the other timings
        ours_error = (np.linalg.norm(np.asarray(ours(*ours_args), np.float32) - want)
                      / np.linalg.norm(want))
        print(f"tidejax kernel: relative difference {ours_error:.2e}")
        assert ours_error < (2e-2 if dtype == jnp.bfloat16 else 1e-4), ours_error
    except Exception as error:  # noqa: BLE001
        print(f"tidejax kernel failed: {type(error).__name__}: {str(error)[:500]}")
        if not on_gpu:
            raise
        ours = None
    if not on_gpu:
        print("pallas_over_gather_time=nan gather_gbps=nan pallas_gbps=nan "
              "tidejax_over_gather_time=nan tidejax_gbps=nan")
        return
    live_bytes = 2 * float((cached + 1).sum()) * K * H * dtype.itemsize
    t_gather = median_seconds(lambda: gather(*gather_args), args.rounds)
    t_pallas = median_seconds(lambda: pallas(*pallas_args), args.rounds)
    t_ours = (median_seconds(lambda: ours(*ours_args), args.rounds) if ours is not None
              else float("nan"))
    print(f"gather {t_gather * 1e3:.3f} ms, pallas {t_pallas * 1e3:.3f} ms, tidejax "
          f"{t_ours * 1e3:.3f} ms for {live_bytes / 1e6:.1f} MB of live K/V")
    print(f"pallas_over_gather_time={t_pallas / t_gather:.3f} "
          f"gather_gbps={live_bytes / t_gather / 1e9:.1f} pallas_gbps={live_bytes / t_pallas / 1e9:.1f} "
          f"tidejax_over_gather_time={t_ours / t_gather:.3f} "
          f"tidejax_gbps={live_bytes / t_ours / 1e9:.1f}")


if __name__ == "__main__":
    main()

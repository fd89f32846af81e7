"""CTB vs request-level continuous batching on live engines: KV hits, prefill, throughput.

    python -m tidejax.bench.ctb [--groups 12] [--ranks 2]

The same multi-turn WebShop workload (real paged engines, tiny model, env latency on)
runs twice: once with request-level scheduling (every turn's KV released to the engine's
LRU cache) and once with CTB (tasks keep their KV pinned across env waits; admission,
pause and resume by `tidejax.sched.ctb`). No trainer runs: this isolates rollout.

A third run measures about what scheduling alone can reach on this workload:
request-level scheduling again, on engines with KV pages for every token every task can
hold, so nothing is evicted (its evicted pages are printed: 0). What it still prefills is
new context (prompts, observations). Its hit rate and prefill over the baseline's are
`no_evict_hit_ratio` and `no_evict_prefill_ratio`; CTB can pass them by a little, since a
pinned task keeps its last partial page, which the LRU cache does not hold.
"""

from __future__ import annotations

from tidejax.platform import configure_cpu_devices

configure_cpu_devices(8)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from tidejax import models  # noqa: E402
from tidejax.envs import EnvPool, PoolConfig, expert_demonstrations, make_tasks  # noqa: E402
from tidejax.envs.latency import LatencyModel  # noqa: E402
from tidejax.runtime.buffer import GlobalBuffer  # noqa: E402
from tidejax.runtime.job import build_tokenizer  # noqa: E402
from tidejax.runtime.config import RolloutConfig  # noqa: E402
from tidejax.runtime.manager import RolloutManager  # noqa: E402
from tidejax.runtime.rollout import RolloutWorker  # noqa: E402
from tidejax.serving import EngineConfig, make_engine  # noqa: E402


async def run_once(scheduler, engines, tokenizer, groups, group_size, seed, time_scale):
    pool = EnvPool(PoolConfig(capacity=64), latency=LatencyModel.default(time_scale=time_scale,
                                                                          seed=seed))
    for engine in engines:
        engine.flush()
    before = [e.metrics() for e in engines]
    workers = {i: RolloutWorker(i, e, pin_after_turn=scheduler == "ctb")
               for i, e in enumerate(engines)}
    cfg = RolloutConfig(scheduler=scheduler, max_new_tokens=24, env_capacity=64,
                        staleness_bound=100, batch_groups=groups)
    manager = RolloutManager(cfg, workers, pool, tokenizer,
                             GlobalBuffer(100, 4096), "webshop", seed=seed, max_seq_len=1536)
    tasks = make_tasks("webshop", "train", groups, group_size, seed=seed, max_turns=5)
    start = time.perf_counter()
    manager.add_groups(tasks, group_size)
    await manager.wait_idle()
    wall = time.perf_counter() - start
    for w in workers.values():
        w.stop()
    await pool.aclose()
    after = [e.metrics() for e in engines]
    prefill = sum(a.prefill_tokens_computed - b.prefill_tokens_computed
                  for a, b in zip(after, before))
    padded = sum(a.prefill_tokens_padded - b.prefill_tokens_padded for a, b in zip(after, before))
    generated = manager.counters["generated_tokens"]
    return {"hit_rate": manager.hit_rate(), "prefill_tokens": prefill,
            "prefill_padding": 1 - prefill / padded if padded else 0.0,
            "gen_tok_s": generated / wall, "wall_s": wall, "generated": generated,
            "pauses": manager.counters["pauses"], "rehomed": manager.counters["rehomed"],
            "evicted_pages": sum(a.evicted_pages - b.evicted_pages
                                 for a, b in zip(after, before))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--num-pages", type=int, default=256)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-buckets", default="256,768",
                        help="comma-separated prefill buckets (the job's default: 256,768)")
    args = parser.parse_args(argv)
    try:
        buckets = tuple(int(b) for b in args.prefill_buckets.split(","))
    except ValueError:
        parser.error(f"--prefill-buckets: not comma-separated ints: {args.prefill_buckets!r}")
    logging.basicConfig(level=logging.WARNING, force=True)
    demos = expert_demonstrations("webshop", 32, seed=args.seed)
    import tempfile

    from tidejax.config import RunConfig
    from tidejax.envs.webshop import WebShopConfig

    # product-id tokens of the 1,500-product shop the demonstrations come from
    tokenizer = build_tokenizer(RunConfig(webshop=WebShopConfig()), tempfile.mkdtemp(), demos)
    config = models.presets["tiny"].replace(vocab_size=2048)
    params = models.init_params(config, jax.random.key(args.seed))
    seq_pages = 96  # max_pages_per_seq: 1,536 tokens (run_once's max_seq_len) of 16
    ec = EngineConfig(page_size=16, num_pages=args.num_pages, max_slots=8,
                      max_pages_per_seq=seq_pages, prefill_buckets=buckets)
    # the no-eviction reference: every task's longest context, all on one rank
    roomy = dataclasses.replace(
        ec, num_pages=max(args.num_pages, args.groups * args.group_size * seq_pages))
    results = {}
    for name, scheduler, engine_config in (("request", "request", ec), ("ctb", "ctb", ec),
                                            ("no-evict", "request", roomy)):
        if name != "ctb":  # new engines: compile every shape, then warm the loop up
            engines = [make_engine(config, params, [d], engine_config)
                       for d in jax.devices()[:args.ranks]]
            for engine in engines:
                engine.warm_up()
            asyncio.run(run_once("request", engines, tokenizer, 2, 2, args.seed + 1, 0.01))
        r = asyncio.run(run_once(scheduler, engines, tokenizer, args.groups, args.group_size,
                                 args.seed, args.time_scale))
        results[name] = r
        print(f"{name:8s} hit_rate={r['hit_rate']:.3f} prefill_tokens={r['prefill_tokens']} "
              f"gen_tok_s={r['gen_tok_s']:.1f} wall={r['wall_s']:.1f}s pauses={r['pauses']} "
              f"rehomed={r['rehomed']} prefill_padding={r['prefill_padding']:.3f} "
              f"evicted_pages={r['evicted_pages']}", flush=True)
    req, ctb, ref = results["request"], results["ctb"], results["no-evict"]

    def ratio(run, key, base=req):
        return run[key] / max(base[key], 1e-9)

    print(f"ctb_hit_ratio={ratio(ctb, 'hit_rate'):.2f} "
          f"prefill_ratio={ratio(ctb, 'prefill_tokens'):.2f} "
          f"gen_throughput_ratio={ratio(ctb, 'gen_tok_s'):.2f} "
          f"no_evict_hit_ratio={ratio(ref, 'hit_rate'):.2f} "
          f"no_evict_prefill_ratio={ratio(ref, 'prefill_tokens'):.2f}")


if __name__ == "__main__":
    main()

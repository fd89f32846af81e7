"""Fixed shapes: varied calls compile nothing new; decode updates the KV pool in place."""

import jax
import numpy as np
from tidejax.models.config import get_preset
from tidejax.serving import EngineConfig, Request, RequestLoop, SamplingParams
from tidejax.serving.steps import TRACE_COUNTS
from tidejax.serving.testing import tiny_engine, tiny_engine_config

from tidejax.bench.compiled_memory import engine_peaks


def varied_requests(rng, count, start):
    samplings = [SamplingParams.greedy(), SamplingParams(temperature=0.7, seed=3),
                 SamplingParams(temperature=1.0, top_k=5, seed=4),
                 SamplingParams(temperature=1.3, top_p=0.8, stop_token_ids=(1, 2, 3), seed=5)]
    for i in range(count):
        n = int(rng.integers(1, 90))  # both buckets, and chunked past the largest
        prompt = rng.integers(0, 512, n).tolist()
        yield Request(start + i, f"task{i % 7}", prompt, int(rng.integers(2, 22)),
                      samplings[i % len(samplings)])


def test_compilations_stay_flat_over_hundreds_of_calls():
    engine = tiny_engine(tiny_engine_config(attention_span="live", decode_steps_per_call=2))
    engine.warm_up()
    warm = engine.compile_counts()
    # Three sampling modes (greedy, sampled, top-k/top-p) x each prefill bucket (packed, the
    # default: no span); x generate at each attention span (1, 2, 4, 8, 16 pages) for 2
    # tokens per call and for one.
    assert warm["packed_prefill"] == 3 * 2 and warm["generate"] == 3 * 2 * 5
    loop = RequestLoop(engine)
    rng = np.random.default_rng(0)
    for request in varied_requests(rng, 12, 0):  # warm-up: each bucket and step traced
        loop.submit(request)
    list(loop.run())
    traced, compiled = dict(TRACE_COUNTS), engine.compile_counts()
    before = engine.metrics()

    for request in varied_requests(rng, 100, 1000):
        loop.submit(request)
    finished = list(loop.run())

    after = engine.metrics()
    assert len(finished) == 100
    assert after.prefill_calls - before.prefill_calls >= 100
    assert after.decode_steps - before.decode_steps >= 200
    assert dict(TRACE_COUNTS) == traced
    assert engine.compile_counts() == compiled
    names = ("prefill", "packed_prefill", "generate")
    assert {name: compiled[name] for name in names} == {name: warm[name] for name in names}
    engine.pool.check()


def test_decode_updates_the_kv_pool_in_place():
    """A decode dispatch (8 tokens) holds no pool-sized temporary: compiled ahead of time
    in float32 (so XLA CPU adds no bf16 upcasts), its temporaries barely move when the pool
    grows eightfold. A copy of the pool would add at least the pool's growth."""
    config = get_preset("qwen2.5-0.5b").replace(num_layers=2, dtype="float32")
    temps, pools = [], []
    for pages in (1024, 8192):
        ec = EngineConfig(num_pages=pages, max_slots=16, max_pages_per_seq=64,
                          prefill_buckets=(64,), decode_steps_per_call=8)
        peak = engine_peaks(config, ec, jax.devices()[:1])["decode"]
        pools.append(2 * config.num_layers * (pages + 1) * ec.page_size
                     * config.num_kv_heads * config.head_dim * 4)
        temps.append(peak.compiled - pools[-1])  # the pool is donated: in and out once
    assert abs(temps[1] - temps[0]) < 0.05 * (pools[1] - pools[0]), (temps, pools)


def test_packed_prefill_memory_stays_near_one_request_prefill_at_64_slots():
    """A packed prefill call (rows of the largest bucket) needs about what a one-request
    prefill of that bucket needs, however many decode slots the engine has: each row
    gathers its own request's pages. (Packing by segment ids over all slots' pages, the
    design before, made every token score slots x span keys: 56.7 GiB for one layer's
    attention at 7B heads, 64 slots, span 4,096, a 1,024-token call.)"""
    config = get_preset("qwen2.5-0.5b").replace(num_layers=2, dtype="float32")
    peaks = {}
    for packing in (False, True):
        ec = EngineConfig(num_pages=1024, max_slots=64, max_pages_per_seq=64,
                          prefill_buckets=(256,), prefill_packing=packing)
        peaks[packing] = engine_peaks(config, ec, jax.devices()[:1])["prefill"].compiled
    assert peaks[True] <= 1.15 * peaks[False], peaks

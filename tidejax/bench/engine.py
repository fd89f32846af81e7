"""Engine benchmark: decode throughput against a bare dense-cache forward, and the KV hit
rate of request-level continuous batching on a synthetic multi-turn agentic trace.

    python -m tidejax.bench.engine                          # tiny preset, CPU, < 2 min
    python -m tidejax.bench.engine --preset qwen2.5-0.5b    # random weights, for a GPU

Throughput. Every slot decodes for the whole timed window. The engine step is what a
serving loop pays per token: host page bookkeeping, one jitted paged generate (greedy,
like the baseline), and one device-to-host copy of the packed results. The baseline is a
bare jitted `forward_with_cache` with the dense reference cache (`dense_attend`) over the
same attention span, argmax fed back on device, read only at the end.

Hit rate. Tasks come in GRPO groups sharing a prompt; each turn generates, then the task
waits for its environment (measured in decode steps, a virtual clock) and comes back with
its whole history plus an observation. The pool holds a quarter of the final contexts, so
serving other requests during a wait evicts the paused task's pages (TideRL's C1). The
same trace is also run with a naive pin-while-waiting policy to show the mechanism; it is
a demonstration of the hooks, not CTB.

Against the hardware. The bytes one decode step must read (weights once, plus each slot's
live K/V) over the engine's step time, as a fraction of the device's memory bandwidth:
HBM bandwidth from a table for accelerators, a measured numpy copy on a CPU. Host time per
step is the CPU time of the thread driving a `RequestLoop` (`time.thread_time`: device
work runs on other threads) per decode step (one token for every slot). Prefill padding
is the share of padded prefill tokens on a WebShop-shaped multi-turn trace (first prompt
~400 tokens, ~350-token observations appended per turn, the job's (256, 768) buckets),
packed in rows (the default, the last line's) and one request per call
(`prefill_packing=False`).

The last line is `engine_overhead_ratio=<engine tok/s / bare tok/s> request_level_hit_rate=<x>
roofline_fraction=<x> host_ms_per_step=<y> prefill_padding=<z>`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import heapq
import time

import jax
import jax.numpy as jnp
import numpy as np

from tidejax.models import forward_with_cache, get_preset
from tidejax.models.config import ModelConfig
from tidejax.models.dense_cache import dense_attend, init_dense_cache
from tidejax.models.model import stack_layers
from tidejax.serving import (
    Completion,
    EngineConfig,
    EngineView,
    Request,
    RequestLevelPolicy,
    RequestLoop,
    SamplingParams,
    make_engine,
)
from tidejax.serving.sampling import sampling_mode
from tidejax.serving.testing import random_params


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    preset: str = "tiny"
    slots: int = 8
    page_size: int = 16
    max_pages_per_seq: int = 32
    prompt_len: int = 32
    warmup_steps: int = 16
    timed_steps: int = 96  # per round
    rounds: int = 3
    groups: int = 16
    group_size: int = 4
    turns: int = 4
    pool_fraction: float = 0.25  # pool tokens / summed final contexts of all tasks
    seed: int = 0

    def __post_init__(self):
        for name in ("slots", "page_size", "max_pages_per_seq", "prompt_len", "timed_steps",
                     "rounds", "groups", "group_size", "turns"):
            if getattr(self, name) <= 0:
                raise ValueError(f"BenchConfig.{name} must be positive")
        if self.prompt_len + self.warmup_steps + self.rounds * self.timed_steps + 2 > \
                self.page_size * self.max_pages_per_seq:
            raise ValueError("BenchConfig: prompt + steps exceed max_pages_per_seq * page_size")
        if not 0 < self.pool_fraction <= 4:
            raise ValueError("BenchConfig.pool_fraction must be in (0, 4]")


# ---------------------------------------------------------------- throughput
def engine_decoder(config: ModelConfig, params, bench: BenchConfig, sampling: SamplingParams,
                   stacked_layers: bool = False, **engine_changes):
    """A function `run(steps) -> seconds` of `Engine.generate` with every slot busy
    (`decode_steps_per_call` tokens per call; `steps` is rounded to whole calls). With
    `stacked_layers` decode gets the weights stacked (the layers scanned, as before the
    engine held them per layer) instead of the engine's own per-layer copy."""
    b = bench
    engine_config = EngineConfig(page_size=b.page_size, num_pages=b.slots * b.max_pages_per_seq,
                                 max_slots=b.slots, max_pages_per_seq=b.max_pages_per_seq,
                                 prefill_buckets=(b.prompt_len,), sampling=sampling,
                                 **engine_changes)
    engine = make_engine(config, params, jax.devices()[:1], engine_config)
    per_call = engine_config.decode_steps_per_call
    engine.warm_up(modes=[sampling_mode([(sampling.temperature, sampling.top_k,
                                          sampling.top_p)])], steps_per_call=[per_call])
    rng = np.random.default_rng(b.seed)
    box = [engine.init_decode_state()]
    total = b.warmup_steps + b.rounds * b.timed_steps + 2 + 8 * 8
    for slot in range(b.slots):
        prompt = rng.integers(0, config.vocab_size, b.prompt_len).tolist()
        request = sampling.replace(max_new_tokens=total, seed=slot)
        box[0] = engine.insert(engine.prefill(engine.params, prompt, sampling=request), box[0],
                               slot)

    weights = stack_layers(engine.params) if stacked_layers else engine.params

    def run(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(-(-steps // per_call)):
            box[0], result = engine.generate(weights, box[0])
            host = result.to_host()  # what a serving loop reads every call
        elapsed = time.perf_counter() - start
        assert host.valid.all(), "a slot stopped inside the timed window"
        return elapsed

    run(b.warmup_steps)
    return run


def bare_decoder(config: ModelConfig, params, bench: BenchConfig):
    """A function `run(steps) -> seconds` of a jitted dense-cache decode step."""
    b = bench
    span = b.page_size * b.max_pages_per_seq

    # Parameters are an argument, not a closure: closed-over arrays become constants baked
    # into the program (15 GB at 7B: the compile never ends).
    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(params, tokens_B, cache, positions_B):
        pos = positions_B[:, None]
        logits, cache = forward_with_cache(config, params, tokens_B[:, None], pos, dense_attend,
                                           cache, pos)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache, positions_B + 1

    box = [jnp.zeros((b.slots,), jnp.int32), init_dense_cache(config, b.slots, span),
           jnp.full((b.slots,), b.prompt_len, jnp.int32)]

    def run(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            box[:] = step(params, *box)
        box[0].block_until_ready()
        return time.perf_counter() - start

    run(b.warmup_steps)
    return run


DECODERS = ("engine", "bare", "engine_live_span", "engine_one_per_call", "engine_sampled",
            "engine_stacked_layers", "engine_pallas")
# Off GPUs the Pallas kernel runs in Pallas's interpreter: a parity check, not a speed.
GPU_ONLY_DECODERS = ("engine_pallas",)


def decode_rates(config: ModelConfig, params, bench: BenchConfig,
                 names: tuple[str, ...] = DECODERS) -> dict[str, float]:
    """Tokens/s of each decoder in `names`, rounds interleaved and the fastest round kept,
    so load from other processes on a shared machine biases none of them (nan: not run)."""
    greedy = SamplingParams.greedy()
    builders = {
        "engine": lambda: engine_decoder(config, params, bench, greedy),
        "bare": lambda: bare_decoder(config, params, bench),
        "engine_live_span": lambda: engine_decoder(config, params, bench, greedy,
                                                   attention_span="live"),
        "engine_one_per_call": lambda: engine_decoder(config, params, bench, greedy,
                                                      decode_steps_per_call=1),
        "engine_sampled": lambda: engine_decoder(config, params, bench,
                                                 SamplingParams(temperature=1.0)),
        "engine_stacked_layers": lambda: engine_decoder(config, params, bench, greedy,
                                                        stacked_layers=True),
        "engine_pallas": lambda: engine_decoder(config, params, bench, greedy,
                                                attention="pallas"),
    }
    decoders = {}
    for name in DECODERS:
        if name not in names:
            continue
        try:
            decoders[name] = builders[name]()
        except Exception as error:  # noqa: BLE001 - one decoder failing must not lose the rest
            if name in ("engine", "bare"):
                raise
            print(f"decoder {name} failed, reported as nan: {type(error).__name__}: "
                  f"{str(error)[:500]}", flush=True)
    best = dict.fromkeys(decoders, float("inf"))
    for _ in range(bench.rounds):
        for name, run in decoders.items():
            best[name] = min(best[name], run(bench.timed_steps))
    return {name: bench.slots * bench.timed_steps / best[name] if name in best else float("nan")
            for name in DECODERS}


# ---------------------------------------------------------------- against the hardware
# Peak memory bandwidth (bytes/s) by device kind, from vendor data sheets; first match wins.
HBM_BANDWIDTH = (
    ("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100-SXM4-80GB", 2.039e12),
    ("A100", 1.555e12), ("L40S", 0.864e12), ("L4", 0.3e12), ("A10", 0.6e12),
    ("TPU v5p", 2.765e12), ("TPU v5 lite", 0.819e12), ("TPU v5e", 0.819e12),
    ("TPU v4", 1.2e12), ("TPU v6", 1.64e12),
)


def copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Host memory bandwidth (bytes/s): read + write of a large numpy copy, best of a few."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def device_bandwidth() -> tuple[float, str]:
    """(bytes/s, where the figure comes from) for the default device."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return copy_bandwidth(), "measured numpy copy"
    for name, bandwidth in HBM_BANDWIDTH:
        if name.lower() in device.device_kind.lower():
            return bandwidth, f"table ({name})"
    return float("nan"), f"unknown device kind {device.device_kind!r}"


def step_bytes(config: ModelConfig, params, slots: int, mean_length: float) -> float:
    """Bytes a decode step must read: every weight once plus each slot's live K and V."""
    itemsize = jnp.dtype(config.jnp_dtype).itemsize
    weights = sum(x.size for x in jax.tree.leaves(params)) * itemsize
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
    return weights + slots * mean_length * kv_per_token


def host_ms_per_step(config: ModelConfig, params, bench: BenchConfig,
                     engine_config: EngineConfig) -> tuple[float, float]:
    """(host CPU ms, wall ms) per decode step of a `RequestLoop` with every slot busy."""
    b = bench
    engine = make_engine(config, params, jax.devices()[:1], engine_config)
    loop = RequestLoop(engine)
    rng = np.random.default_rng(b.seed + 2)
    steps = b.warmup_steps + b.timed_steps
    for slot in range(b.slots):
        loop.submit(Request(slot, None, rng.integers(0, config.vocab_size, b.prompt_len).tolist(),
                            steps + 64, SamplingParams.greedy(seed=slot)))
    while loop.metrics().decode_tokens < b.warmup_steps * b.slots:
        loop.step()
    tokens_before = loop.metrics().decode_tokens
    cpu, wall = time.thread_time(), time.perf_counter()
    while loop.metrics().decode_tokens - tokens_before < b.timed_steps * b.slots:
        assert not loop.step(), "a request finished inside the timed window"
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    token_steps = (loop.metrics().decode_tokens - tokens_before) / b.slots
    return 1e3 * cpu / token_steps, 1e3 * wall / token_steps


def webshop_shaped_padding(config: ModelConfig, params, engine_config: EngineConfig,
                           tasks: int = 16, turns: int = 3, seed: int = 0) -> float:
    """Share of padded prefill tokens serving a WebShop-shaped multi-turn trace: pinned
    tasks (CTB's resume path) whose turns append ~350-token observations."""
    rng = np.random.default_rng(seed)
    engine = make_engine(config, params, jax.devices()[:1], engine_config)
    loop = RequestLoop(engine)
    context = {t: rng.integers(0, config.vocab_size, int(rng.integers(300, 500))).tolist()
               for t in range(tasks)}
    for turn in range(turns):
        for task, tokens in context.items():
            loop.pin(task)
            loop.submit(Request(f"{task}/{turn}", task, tokens, 24,
                                SamplingParams(temperature=1.0, seed=task)))
        for done in loop.run():
            observation = rng.integers(0, config.vocab_size, int(rng.integers(250, 450)))
            context[done.task_id] = context[done.task_id] + list(done.token_ids) + \
                observation.tolist()
    metrics = engine.metrics()
    return 1 - metrics.prefill_tokens_computed / metrics.prefill_tokens_padded


# ---------------------------------------------------------------- multi-turn trace
@dataclasses.dataclass(frozen=True)
class Turn:
    max_new: int
    wait_steps: int  # env wait after the turn
    observation: tuple[int, ...]  # appended to the context before the next turn


def make_trace(vocab: int, bench: BenchConfig) -> dict[str, tuple[tuple[int, ...], list[Turn]]]:
    """task id -> (first prompt, turns). Group members share the first prompt."""
    rng = np.random.default_rng(bench.seed + 1)
    trace = {}
    for g in range(bench.groups):
        prompt = tuple(rng.integers(0, vocab, int(rng.integers(48, 97))).tolist())
        for m in range(bench.group_size):
            turns = [Turn(int(rng.integers(8, 25)), int(rng.integers(5, 41)),
                          tuple(rng.integers(0, vocab, int(rng.integers(8, 33))).tolist()))
                     for _ in range(bench.turns)]
            trace[f"g{g}m{m}"] = (prompt, turns)
    return trace


def peak_context(trace) -> int:
    return sum(len(p) + sum(t.max_new + len(t.observation) for t in turns)
               for p, turns in trace.values())


class PinWhileWaiting(RequestLevelPolicy):
    """Demo of the hooks only (not CTB): resumed turns first, new tasks admitted only under
    a token cap, and a task with more turns pinned during its env wait while under the cap."""

    def __init__(self, more_turns: set[str], started: set[str], cap: float):
        super().__init__(watermark_pages=1)
        self.more_turns, self.started, self.cap = more_turns, started, cap

    def _held(self, view: EngineView) -> float:
        u = view.usage
        return (u.pinned_tokens + u.used_tokens) / u.total_tokens

    def admission_order(self, waiting, view):
        resumed = [r for r in waiting if r.task_id in self.started]
        fresh = [r for r in waiting if r.task_id not in self.started]
        return resumed + (fresh if self._held(view) <= self.cap else [])

    def keep_pinned(self, completion: Completion, view: EngineView) -> bool:
        self.started.add(completion.task_id)
        return completion.task_id in self.more_turns and self._held(view) <= self.cap


def run_trace(config: ModelConfig, params, bench: BenchConfig, pin_demo: bool) -> tuple[float, int]:
    """Serve the trace; returns (KV hit rate, decode steps)."""
    b = bench
    trace = make_trace(config.vocab_size, b)
    num_pages = max(b.max_pages_per_seq + b.slots,
                    int(b.pool_fraction * peak_context(trace) / b.page_size))
    engine_config = EngineConfig(page_size=b.page_size, num_pages=num_pages, max_slots=b.slots,
                                 max_pages_per_seq=b.max_pages_per_seq,
                                 prefill_buckets=(64, 256),
                                 sampling=SamplingParams(temperature=1.0))
    engine = make_engine(config, params, jax.devices()[:1], engine_config)
    more_turns = set(trace)
    policy = PinWhileWaiting(more_turns, set(), cap=0.7) if pin_demo else None
    loop = RequestLoop(engine, policy=policy)
    context = {task: list(prompt) for task, (prompt, _) in trace.items()}
    turn_index = dict.fromkeys(trace, 0)
    arrivals = [(0, task) for task in trace]  # (tick, task): all tasks start at once
    heapq.heapify(arrivals)
    tick, seq = 0, 0
    while arrivals or not loop.idle:
        while arrivals and arrivals[0][0] <= tick:
            _, task = heapq.heappop(arrivals)
            turn = trace[task][1][turn_index[task]]
            seq += 1
            loop.submit(Request(f"{task}/{turn_index[task]}", task, context[task], turn.max_new,
                                SamplingParams(temperature=1.0, seed=seq)))
        if loop.idle:
            tick = arrivals[0][0]
            continue
        for done in loop.step():
            task = done.task_id
            turn = trace[task][1][turn_index[task]]
            context[task] += list(done.token_ids)
            turn_index[task] += 1
            if turn_index[task] == len(trace[task][1]):
                more_turns.discard(task)
                continue
            context[task] += list(turn.observation)
            if turn_index[task] == len(trace[task][1]) - 1:
                more_turns.discard(task)  # its last turn needs no pinning afterwards
            heapq.heappush(arrivals, (tick + 1 + turn.wait_steps, task))
        tick += engine_config.decode_steps_per_call  # the clock counts decode steps (tokens)
    engine.pool.check()
    return loop.metrics().kv_hit_rate, loop.metrics().steps


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--timed-steps", type=int, default=96, help="per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-trace", action="store_true", help="throughput only")
    parser.add_argument("--layers", type=int, default=None,
                        help="override the preset's depth (a memory-bound CPU run)")
    parser.add_argument("--dtype", default=None, help="override the preset's dtype")
    parser.add_argument("--decoders", default=None,
                        help=f"comma-separated subset of {','.join(DECODERS)} (default: all; "
                             f"off GPUs all but {','.join(GPU_ONLY_DECODERS)}; engine and bare "
                             "are always run: the last line needs them)")
    parser.add_argument("--skip-padding", action="store_true",
                        help="no WebShop-shaped prefill padding (host-side arithmetic, the same "
                             "on any device; prints nan)")
    args = parser.parse_args(argv)
    if args.decoders is None:
        args.decoders = ",".join(d for d in DECODERS if jax.default_backend() == "gpu"
                                 or d not in GPU_ONLY_DECODERS)
    names = set(args.decoders.split(",")) | {"engine", "bare"}
    if names - set(DECODERS):
        parser.error(f"--decoders: unknown {sorted(names - set(DECODERS))}; choose from {DECODERS}")
    bench = BenchConfig(preset=args.preset, slots=args.slots, timed_steps=args.timed_steps,
                        rounds=args.rounds)
    config = get_preset(bench.preset)
    config = config.replace(num_layers=args.layers or config.num_layers,
                            dtype=args.dtype or config.dtype)
    # Presets above tiny draw on the device: a 7B host draw takes minutes and 30 GB.
    params = random_params(config, bench.seed, std=0.02 if bench.preset != "tiny" else 0.16,
                           on_device=bench.preset != "tiny")
    print(f"backend={jax.default_backend()} devices={jax.device_count()} preset={bench.preset} "
          f"layers={config.num_layers} dtype={config.dtype} slots={bench.slots} span={bench.page_size * bench.max_pages_per_seq}")
    rates = decode_rates(config, params, bench, tuple(names))
    engine_rate, bare_rate, sampled_rate = rates["engine"], rates["bare"], rates["engine_sampled"]
    print(f"decode tok/s: engine(greedy)={engine_rate:.0f} bare_dense(argmax)={bare_rate:.0f} "
          f"engine(temperature=1)={sampled_rate:.0f} engine(live span)="
          f"{rates['engine_live_span']:.0f} engine(1 token/call)={rates['engine_one_per_call']:.0f} "
          f"engine(stacked layers)={rates['engine_stacked_layers']:.0f} "
          f"engine(pallas decode attention)={rates['engine_pallas']:.0f}")
    hit_rate = float("nan")
    if not args.skip_trace:
        hit_rate, steps = run_trace(config, params, bench, pin_demo=False)
        pinned_rate, pinned_steps = run_trace(config, params, bench, pin_demo=True)
        print(f"multi-turn trace ({bench.groups}x{bench.group_size} tasks, {bench.turns} turns, "
              f"pool={bench.pool_fraction:.0%} of final contexts): request_level hit_rate="
              f"{hit_rate:.3f} ({steps} steps); pin_while_waiting demo hit_rate="
              f"{pinned_rate:.3f} ({pinned_steps} steps)")
    host_config = EngineConfig(page_size=bench.page_size, num_pages=bench.slots * bench.max_pages_per_seq,
                               max_slots=bench.slots, max_pages_per_seq=bench.max_pages_per_seq,
                               prefill_buckets=(bench.prompt_len,))
    host_ms, wall_ms = host_ms_per_step(config, params, bench, host_config)
    mean_length = bench.prompt_len + bench.warmup_steps + bench.rounds * bench.timed_steps / 2
    read_bytes = step_bytes(config, params, bench.slots, mean_length)
    bandwidth, source = device_bandwidth()
    step_s = bench.slots / engine_rate
    roofline = read_bytes / step_s / bandwidth
    print(f"decode step reads {read_bytes / 1e6:.2f} MB (weights + live KV at mean length "
          f"{mean_length:.0f}); bandwidth {bandwidth / 1e9:.1f} GB/s ({source}); engine step "
          f"{step_s * 1e3:.3f} ms = {roofline:.4f} of the memory roofline")
    print(f"request loop: host {host_ms:.3f} ms CPU per decode step (wall {wall_ms:.3f} ms)")
    padding = float("nan")
    if not args.skip_padding:
        trace_config = EngineConfig(page_size=16, num_pages=2048, max_slots=bench.slots,
                                    max_pages_per_seq=96, prefill_buckets=(256, 768))
        padding = webshop_shaped_padding(config, params, trace_config)
        unpacked = webshop_shaped_padding(config, params,
                                          trace_config.replace(prefill_packing=False))
        print(f"webshop-shaped trace: prefill padding {padding:.3f} of prefill tokens packed "
              f"in rows of {trace_config.prefill_row_tokens} (the default; the last line's), "
              f"{unpacked:.3f} one request per call (prefill_packing=False)")
    print(f"engine_overhead_ratio={engine_rate / bare_rate:.3f} request_level_hit_rate={hit_rate:.3f} "
          f"roofline_fraction={roofline:.4f} host_ms_per_step={host_ms:.3f} "
          f"prefill_padding={padding:.3f}")


if __name__ == "__main__":
    main()

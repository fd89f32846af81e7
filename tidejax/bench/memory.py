"""Memory benchmark: every step the job runs, compiled ahead of time at 7B and 14B shapes
on 8 fake devices, beside the memory model's prediction (`tidejax.sched.memory`).

    python -m tidejax.bench.memory                 # qwen2.5-7b and qwen2.5-14b, 8 x 80 GB
    python -m tidejax.bench.memory --calibrate     # refit the model's coefficients
    python -m tidejax.bench.memory --config my.toml # your own run configuration

For each preset it reads its shipped GPU configuration (`experiments/configs/`), asks the
memory model which partitions the job may choose (ERS and the start-up check use the same
answer), compiles each distinct role those partitions need - the actor mesh's SFT, fused,
deferred forward and backward, colocated reference and optimizer steps, a decoupled
reference mesh's forward, a rollout rank's prefill and decode - and prints the per-device
peak beside the prediction. A partition fits when the largest of its roles' compiled peaks
is within the capacity (the config's `memory_fraction` of `--device-memory-gib`). When
the model admits no partition, the smallest actor mesh that divides the model is compiled
anyway, to show by how much it misses.

Nothing is materialised: steps lower on abstract arrays with the job's shardings. Each
role compiles at the model's full depth (the trainer's layers run under `lax.scan`, so
depth costs little compile time: both presets in about 90 s on 2 cores); `--layers a,b`
compiles two shallow depths and extrapolates affinely instead
(`compiled_memory.extrapolate`), which misjudged the CPU-only upcasts of the reference
forward (model error 1.18 from (2, 3) layers against 0.04 at full depth). The figures are
XLA CPU's buffer assignment.

Last line: `fits_7b=<k>/<n> fits_14b=<k>/<n> worst_peak_gib=<x> model_error=<y>`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tidejax.bench import compiled_memory as cm  # noqa: E402
from tidejax.config import RunConfig, load_run_config  # noqa: E402
from tidejax.models.config import ModelConfig, get_preset  # noqa: E402
from tidejax.rl.config import RLConfig  # noqa: E402
from tidejax.runtime.job import model_config_of  # noqa: E402
from tidejax.runtime.layout import job_memory  # noqa: E402
from tidejax.sched import memory  # noqa: E402
from tidejax.serving.config import EngineConfig  # noqa: E402

GIB = memory.GIB
# The shipped run configs are package data of tidejax.experiments: located, not imported
# (benchmarks sit below experiments in the README's import direction).
CONFIG_DIR = os.path.join(
    importlib.util.find_spec("tidejax.experiments").submodule_search_locations[0], "configs")
GPU_CONFIGS = {"qwen2.5-7b": "gpu_qwen2.5-7b_8x80gb.toml",
               "qwen2.5-14b": "gpu_qwen2.5-14b_8x80gb.toml"}

# (preset, layers, trainer devices, remat, micro_batch_tokens, row_len): the shapes the
# coefficients are fitted on; engine shapes: (preset, layers, tensor, pages, slots,
# pages per sequence, prefill bucket).
# Fitted on the sizes the model plans for; tiny (a few hundred MiB of activations, where
# XLA CPU's buffer choices dominate) is only checked, at a looser tolerance, by the tests.
TRAINER_CALIBRATION = (
    ("qwen2.5-0.5b", 2, 2, False, 6144, 1536), ("qwen2.5-0.5b", 3, 2, False, 6144, 1536),
    ("qwen2.5-0.5b", 2, 4, True, 6144, 1536), ("qwen2.5-0.5b", 3, 4, True, 6144, 1536),
    ("qwen2.5-0.5b", 2, 4, False, 3072, 1536), ("qwen2.5-0.5b", 2, 8, True, 16384, 4096),
    ("qwen2.5-0.5b", 2, 8, False, 8192, 2048),
    ("qwen2.5-7b", 2, 8, True, 6144, 1536), ("qwen2.5-7b", 3, 8, True, 6144, 1536),
    ("qwen2.5-7b", 2, 4, True, 6144, 1536), ("qwen2.5-7b", 3, 4, True, 6144, 1536),
    ("qwen2.5-7b", 2, 4, True, 12288, 3072), ("qwen2.5-7b", 2, 7, True, 6144, 1536),
    ("qwen2.5-7b", 2, 8, True, 32768, 4096),
    # Full depth at the GPU config's batch, on the actor meshes its partitions use.
    ("qwen2.5-7b", 28, 4, True, 16384, 4096), ("qwen2.5-7b", 28, 7, True, 16384, 4096),
    ("qwen2.5-7b", 28, 8, True, 16384, 4096),
    # 14B at full depth on the 6-device actor mesh its GPU config uses (padded storage)
    ("qwen2.5-14b", 48, 6, True, 16384, 4096),
)
ENGINE_CALIBRATION = (
    ("qwen2.5-0.5b", 2, 1, 2048, 32, 256, 1024), ("qwen2.5-0.5b", 3, 1, 2048, 32, 256, 1024),
    ("qwen2.5-0.5b", 2, 1, 1024, 8, 128, 256),
    ("qwen2.5-7b", 2, 1, 4096, 32, 256, 1024), ("qwen2.5-7b", 3, 1, 4096, 32, 256, 1024),
    ("qwen2.5-7b", 2, 1, 2048, 64, 512, 2048), ("qwen2.5-7b", 2, 2, 4096, 32, 256, 1024),
    ("qwen2.5-7b", 2, 1, 8192, 16, 256, 256), ("qwen2.5-7b", 2, 1, 16384, 128, 128, 512),
)


def calibration_config(preset: str, layers: int) -> ModelConfig:
    """A preset at `layers` depth; tiny with the default job's 4,096-token vocabulary."""
    config = get_preset(preset).replace(num_layers=layers)
    return config.replace(vocab_size=4096) if preset == "tiny" else config


def calibration_shape(config: ModelConfig, devices: int = 8) -> memory.ModelShape:
    """The memory model's shape of `config`, its trainer storage padded as a job on
    `devices` devices pads it (`runtime.layout.job_memory`)."""
    return memory.ModelShape.of(config).stored_for(range(1, devices + 1))


# ---------------------------------------------------------------------------- compiling
def compile_actor(model_config: ModelConfig, rl: RLConfig, devices: int, batch, layers,
                  stored_d_model: int | None = None) -> dict[str, int]:
    def measure(config):
        return cm.trainer_peaks(config, rl, jax.devices()[:devices], batch.rows,
                                batch.row_len, stored_d_model)

    return cm.extrapolate(measure, model_config, layers)


def compile_ref(model_config: ModelConfig, rl: RLConfig, devices: int, batch, layers,
                stored_d_model: int | None = None) -> cm.Peak:
    def measure(config):
        return {"ref": cm.ref_peak(config, rl, jax.devices()[:devices], batch.rows,
                                   batch.row_len, stored_d_model)}

    return cm.extrapolate(measure, model_config, layers)["ref"]


def compile_engine(model_config: ModelConfig, engine: EngineConfig, tensor: int, layers
                   ) -> dict[str, int]:
    def measure(config):
        return cm.engine_peaks(config, engine, jax.devices()[:tensor])

    return cm.extrapolate(measure, model_config, layers)


# ---------------------------------------------------------------------------- fitting
# Coefficients physics fixes rather than fits: a gradient step holds the whole new
# gradient tree (sharded) before it joins the accumulator or the update, and the update's
# Adam arithmetic one more. Fitting them instead trades them against features that do not
# grow with depth, and the fit then falls apart at the real depth.
FIXED = {step: {"grads": 1.0} for step in ("sft", "fused", "backward", "update")}


def _fit(features: list[dict[str, float]], targets: list[float], weights: list[float],
         fixed: dict[str, float]) -> dict[str, float]:
    """Non-negative least squares on relative error over the features not `fixed`, by
    dropping the most negative coefficient until none is left."""
    names = [k for k in features[0] if k not in fixed]
    x = np.array([[f[k] for k in names] for f in features])
    y = np.asarray(targets) - np.array([sum(v * f[k] for k, v in fixed.items())
                                        for f in features])
    w = np.asarray(weights)
    active = list(range(len(names)))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    return {**{names[i]: float(c) for i, c in zip(active, coef) if c > 0}, **fixed}


def _fit_step(rows, step: str, known, features) -> dict[str, float]:
    """Fit one step's coefficients over `rows` and print the in-sample errors."""
    targets = [peaks[step] - known(row) for *row, peaks in rows]
    feats = [features(row) for *row, _ in rows]
    coeffs = _fit(feats, targets, [1.0 / peaks[step] for *_, peaks in rows],
                  FIXED.get(step, {}))
    errors = [(sum(c * f.get(k, 0.0) for k, c in coeffs.items()) - t) / peaks[step]
              for f, t, (*_, peaks) in zip(feats, targets, rows)]
    print(f"fit {step}: max in-sample error {max(map(abs, errors)):.3f}", flush=True)
    return coeffs


def _cached(cache: dict, key: tuple, measure) -> dict[str, int]:
    """Compiled peaks less CPU upcasts for `key`, from `cache` (which keeps both figures)
    or by compiling."""
    name = json.dumps(key)
    if name not in cache:
        cache[name] = {k: list(v) for k, v in measure().items()}
    return {k: cm.Peak(*v).gpu_like for k, v in cache[name].items()}


def calibrate(cache_path: str | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """Fit the coefficients; compiled peaks are kept in `cache_path` (JSON) so a refit after
    adding a shape compiles only the new one."""
    cache = {}
    if cache_path and os.path.exists(cache_path):
        with open(cache_path) as f:
            cache = json.load(f)
    rows = []  # (shape, devices, batch, measured peaks incl. "ref")
    for key in TRAINER_CALIBRATION:
        preset, layers, devices, remat, mbt, row_len = key
        config = calibration_config(preset, layers)
        batch = memory.TrainerBatch(memory.trainer_rows(mbt, row_len, devices), row_len, remat)
        rl = RLConfig(remat=remat)
        shape = calibration_shape(config)

        def measure():
            stored = shape.stored_d_model
            peaks = compile_actor(config, rl, devices, batch, None, stored)
            return {**peaks, "ref": compile_ref(config, rl, devices, batch, None, stored)}

        peaks = _cached(cache, ("trainer", *key), measure)
        rows.append((shape, devices, batch, peaks))
        print(f"calibration {preset} L={layers} devices={devices} remat={remat}: "
              f"{ {k: round(v / GIB, 2) for k, v in peaks.items()} }", flush=True)

    def known(row, step):
        shape, devices, batch = row
        if step == "ref":
            return memory.ref_step(shape, devices, batch, coeffs={}).total
        return memory.trainer_step(shape, devices, batch, step, coeffs={}).total

    trainer = {step: _fit_step(rows, step, lambda row, s=step: known(row, s),
                               lambda row, s=step: memory.step_features(*row, s))
               for step in (*memory.TRAINER_STEPS, "ref")}
    engine_rows = []
    for key in ENGINE_CALIBRATION:
        preset, layers, tensor, pages, slots, per_seq, bucket = key
        config = calibration_config(preset, layers)
        ec = EngineConfig(page_size=16, num_pages=pages, max_slots=slots,
                          max_pages_per_seq=per_seq, prefill_buckets=(bucket,))
        peaks = _cached(cache, ("engine", *key),
                        lambda: compile_engine(config, ec, tensor, None))
        engine_rows.append((memory.ModelShape.of(config), tensor, memory.EngineShape.of(ec),
                            peaks))
    if cache_path:
        with open(cache_path, "w") as f:
            json.dump(cache, f, indent=1)
    engine = {step: _fit_step(
        engine_rows, step,
        lambda row, s=step: memory.engine_step(*row, s, coeffs={}).total,
        lambda row: memory.engine_features(*row)) for step in memory.ENGINE_STEPS}
    return {"trainer": trainer, "engine": engine}


# ---------------------------------------------------------------------------- the check
def gpu_config(preset: str) -> RunConfig:
    """The preset's shipped GPU configuration (another preset: the 7B one's settings)."""
    name = GPU_CONFIGS.get(preset, GPU_CONFIGS["qwen2.5-7b"])
    return load_run_config(os.path.join(CONFIG_DIR, name)).replace(preset=preset)


def check_preset(preset: str, device_gib: float, layers, out: list) -> dict:
    return check_config(preset, gpu_config(preset), get_preset(preset), device_gib, layers,
                        out)


def check_config(preset: str, cfg: RunConfig, model_config: ModelConfig, device_gib: float,
                 layers, out: list) -> dict:
    """Compile every role of every partition `cfg` may choose; `preset` names it."""
    capacity = cfg.memory_fraction * device_gib * GIB
    jm = job_memory(cfg, model_config, capacity)
    n = cfg.topology.devices
    partitions = jm.partitions(n, cfg.topology.min_rollout)
    actor_sizes = sorted({a for _, _, a in partitions})
    ref_sizes = sorted({f for _, f, _ in partitions if f})
    if not partitions:  # show how far the largest dividing mesh beside a rollout rank misses
        k = jm.rollout_tensor  # actor meshes are whole ranks
        dividing = [d for d in range(k, n - k + 1, k) if not memory.undivided(jm.shape, d)]
        actor_sizes = [max(dividing)]
    rl = cfg.trainer_rl()  # what the job's trainer is built with (schedule, temperature)
    errors, compiled = [], {}

    def record(role, size, step, peak: cm.Peak, predicted):
        measured = peak.gpu_like
        err = (predicted - measured) / measured
        errors.append(abs(err))
        out.append({"preset": preset, "role": role, "devices": size, "step": step,
                    "compiled_gib": peak.compiled / GIB, "cpu_upcast_gib": peak.upcast / GIB,
                    "peak_gib": measured / GIB, "model_gib": predicted / GIB, "error": err})
        print(f"  {role:7s} {size} dev {step:13s} compiled {peak.compiled / GIB:6.1f} GiB, "
              f"less CPU upcasts {measured / GIB:6.1f} GiB; model {predicted / GIB:6.1f} GiB "
              f"({err:+.1%})", flush=True)

    print(f"{preset}: capacity {capacity / GIB:.1f} GiB per device; the model admits "
          f"{len(partitions)} partitions (rollout ranks, ref devices, actor devices): "
          f"{partitions}; a rollout rank holds up to "
          f"{memory.max_pages(jm.shape, jm.rollout_tensor, jm.engine, capacity)} KV pages "
          f"(the config asks {cfg.engine.num_pages})", flush=True)
    for a in actor_sizes:
        batch = jm.batch(a)
        peaks = compile_actor(model_config, rl, a, batch, layers, jm.shape.stored_d_model)
        for step, measured in peaks.items():
            record("actor", a, step, measured,
                   memory.trainer_step(jm.shape, a, batch, step).total)
        compiled[("actor", a)] = max(p.gpu_like for p in peaks.values())
        if jm.ref_stays_beside(a):  # the job keeps the reference's copy on this mesh too
            ref_bytes = jm.ref_copy_bytes(a)
            compiled[("actor", a)] += ref_bytes
            print(f"  actor   {a} dev keeps the reference resident: +{ref_bytes / GIB:.1f} GiB "
                  f"-> {compiled[('actor', a)] / GIB:.1f} GiB", flush=True)
    for f in ref_sizes:
        batch = jm.batch(f)
        measured = compile_ref(model_config, rl, f, batch, layers, jm.shape.stored_d_model)
        record("ref", f, "ref", measured, memory.ref_step(jm.shape, f, batch).total)
        compiled[("ref", f)] = measured.gpu_like
    tensor = jm.rollout_tensor
    engine = compile_engine(model_config, cfg.engine, tensor, layers)
    for step, measured in engine.items():
        record("rollout", tensor, step, measured,
               memory.engine_step(jm.shape, tensor, jm.engine, step).total)
    compiled[("rollout", tensor)] = max(p.gpu_like for p in engine.values())
    fits = 0
    for r, f, a in partitions:
        peak = max(compiled[("actor", a)], compiled[("rollout", tensor)],
                   compiled[("ref", f)] if f else 0)
        ok = peak <= capacity
        fits += ok
        print(f"  partition rollout={r}x{tensor} ref={f} actor={a}: compiled peak "
              f"{peak / GIB:.1f} GiB {'fits' if ok else 'DOES NOT FIT'}", flush=True)
    if not partitions:
        a = actor_sizes[0]
        print(f"  no partition fits: the largest dividing actor mesh that leaves a rollout "
              f"rank ({a} devices) compiles to {compiled[('actor', a)] / GIB:.1f} GiB; "
              f"{jm.problems(1, a)}", flush=True)
    return {"fits": fits, "n": len(partitions), "worst": max(compiled.values()),
            "error": max(errors)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="qwen2.5-7b,qwen2.5-14b")
    parser.add_argument("--config", default=None,
                        help="check this run configuration (JSON/TOML, as the job reads it; "
                             "its device_memory_gib wins over --device-memory-gib) instead "
                             "of the shipped GPU ones; with --hf-path only config.json is read")
    parser.add_argument("--device-memory-gib", type=float, default=80.0)
    parser.add_argument("--layers", default="",
                        help="compile at these two depths (e.g. 2,3) and extrapolate; "
                             "default: the model's full depth")
    parser.add_argument("--out", default=None, help="write the rows as JSONL here (with "
                        "--calibrate: the compiled peaks, reused by the next --calibrate)")
    parser.add_argument("--calibrate", action="store_true",
                        help="fit the memory model's coefficients and print them")
    args = parser.parse_args(argv)
    if args.calibrate:
        print(json.dumps(calibrate(args.out), indent=1))
        return
    layers = tuple(int(x) for x in args.layers.split(",")) if args.layers else None
    start = time.perf_counter()
    rows, results = [], {}
    if args.config:
        cfg = load_run_config(args.config)
        if cfg.topology.devices > len(jax.devices()):
            raise SystemExit(f"{args.config}: topology.devices={cfg.topology.devices}, but "
                             f"this check compiles on {len(jax.devices())} fake devices")
        results["config"] = check_config(
            os.path.basename(args.config), cfg, model_config_of(cfg),
            cfg.device_memory_gib or args.device_memory_gib, layers, rows)
    else:
        for preset in args.presets.split(","):
            results[preset] = check_preset(preset, args.device_memory_gib, layers, rows)
    if args.out:
        with open(args.out, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    print(f"({time.perf_counter() - start:.0f} s)")
    tags = {"qwen2.5-7b": "7b", "qwen2.5-14b": "14b"}
    parts = [f"fits_{tags.get(p, p)}={r['fits']}/{r['n']}" for p, r in results.items()]
    worst = max(r["worst"] for r in results.values()) / GIB
    error = max(r["error"] for r in results.values())
    print(" ".join(parts) + f" worst_peak_gib={worst:.1f} model_error={error:.3f}")


if __name__ == "__main__":
    main()

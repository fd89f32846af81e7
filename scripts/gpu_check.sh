#!/usr/bin/env bash
# GPU smoke check and benchmarks for one NVIDIA GPU (run from the repository root).
#
#   bash scripts/gpu_check.sh [OUT_DIR]
#
# Needs tidejax importable (`pip install -e . --no-deps` next to a CUDA JAX) and writes each
# benchmark's output to OUT_DIR.
set -u -o pipefail
out=${1:-runs/gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

python3 - <<'EOF' 2>&1 | tee "$out/devices.txt"
import jax
print("jax", jax.__version__, "backend", jax.default_backend(), jax.devices())
EOF
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$out/devices.txt"

# Decode: paged engine vs bare dense-cache forward, Qwen2.5-0.5B shapes, random weights;
# bytes per step vs the HBM roofline, host ms per step, WebShop-shaped prefill padding.
timeout 600 python3 -m tidejax.bench.engine --preset qwen2.5-0.5b --slots 64 --skip-trace \
    2>&1 | grep -v "^W0000\|^I0000" | tee "$out/engine_0.5b.txt"
# Training: fused vs deferred-KL step, Qwen2.5-0.5B shapes.
timeout 200 python3 -m tidejax.bench.train --preset qwen2.5-0.5b --batch 8 --length 1024 \
    --rounds 5 2>&1 | grep -v "^W0000\|^I0000" | tee "$out/train_0.5b.txt"
# The whole job for two steps on this one GPU at Qwen2.5-0.5B shapes (random weights, bf16):
# sync, since one device means rollout and training take turns on it.
timeout 600 python3 -m tidejax.experiments.webshop --system sync --devices 1 \
    --preset qwen2.5-0.5b --quick --no-progress --out "$out/job_0.5b" \
    2>&1 | grep -v "^W0000\|^I0000" | tail -20 | tee "$out/job_0.5b.txt"
# The 7B rollout rank's decode and prefill compiled for this GPU (abstract arrays, nothing
# materialised; depth extrapolated from 2 and 3 layers) beside the memory model with and
# without the two KV-pool copies it adds for decode. On CPU those copies come from bf16
# programs only (f32 decode: no pool-sized temporaries at 1 or 8 tokens per call), so this
# says whether a GPU makes them.
timeout 300 python3 - <<'PY' 2>&1 | grep -v "^W0000\|^I0000" | tee "$out/engine_memory_7b.txt"
from dataclasses import replace
from tidejax.bench import memory as bench_memory
from tidejax.models.config import get_preset
from tidejax.sched import memory
cfg = bench_memory.gpu_config("qwen2.5-7b")
model_config = get_preset("qwen2.5-7b")
shape, engine = memory.ModelShape.of(model_config), memory.EngineShape.of(cfg.engine)
peaks = bench_memory.compile_engine(model_config, cfg.engine, 1, (2, 3))
for step, peak in peaks.items():
    with_copies = memory.engine_step(shape, 1, engine, step).total
    without = memory.engine_step(shape, 1, replace(engine, decode_steps_per_call=1), step).total
    print(f"7B {step} pages={cfg.engine.num_pages} compiled_gib={peak.compiled / 2**30:.2f} "
          f"model_gib={with_copies / 2**30:.2f} model_without_pool_copies_gib="
          f"{without / 2**30:.2f}", flush=True)
PY

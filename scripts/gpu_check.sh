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

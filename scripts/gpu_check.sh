#!/usr/bin/env bash
# GPU smoke check and benchmarks for one NVIDIA GPU (run from the repository root).
#
#   bash scripts/gpu_check.sh [OUT_DIR] [BUDGET_SECONDS]
#
# Installs tidejax (no dependencies: the machine's CUDA JAX and its flax, optax and orbax
# are used) into a fresh /tmp/site, with the wheels in .whl/ when present, then runs each
# check in priority order, skipping any that would not finish inside BUDGET_SECONDS
# (default 540). Each check's output goes to OUT_DIR. On the lent H200 (JAX 0.11.2,
# 2026-12-04) .whl/ needs only what the image lacks: rapidfuzz, bm25s and tensorboardX
# (the WebShop env and metrics); flax 0.12.8 does not import under JAX 0.11.2.
set -u -o pipefail
out=${1:-runs/gpu_check}
budget=${2:-540}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
filter() { grep -v "^W0000\|^I0000\|DeprecationWarning\|warnings.warn"; }

# run NAME TIMEOUT CMD...: runs CMD under TIMEOUT seconds if the budget still holds it.
run() {
    local name=$1 limit=$2; shift 2
    local left=$((budget - SECONDS))
    if ((left < limit / 2)); then
        echo "== $name: skipped (${left}s of the budget left, needs up to ${limit}s)" | tee "$out/$name.txt"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit}s, at ${SECONDS}s)"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | filter | tee "$out/$name.txt"
    echo "== $name: rc=${PIPESTATUS[0]} in $((SECONDS - start))s" | tee -a "$out/$name.txt"
}

rm -rf /tmp/site  # a warm machine keeps the last call's install
wheels=()
[[ -d .whl ]] && wheels=(.whl/*.whl)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --no-cache-dir --target /tmp/site . "${wheels[@]}" > "$out/install.txt" 2>&1 \
    || { echo "install failed"; tail -20 "$out/install.txt"; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# Run from outside the checkout: its tidejax/ would shadow the installed package, whose
# tidejax.models, .serving and .experiments come from the top-level folders.
out=$(realpath "$out")
repo=$PWD
mkdir -p /tmp/gpu_check_cwd && cd /tmp/gpu_check_cwd || exit 1

python3 - <<'EOF' 2>&1 | filter | tee "$out/devices.txt"
import importlib.metadata as md
import jax
print("jax", jax.__version__, "backend", jax.default_backend(), jax.devices())
print({name: md.version(name) for name in ("jaxlib", "flax", "optax", "orbax-checkpoint")})
EOF
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$out/devices.txt"

# Decode: paged engine vs bare dense-cache forward, random bf16 weights drawn on the device,
# 64 slots; bytes per step vs the HBM roofline, host ms per step; "stacked layers" is the
# engine fed the weights stacked (the layer scan the engine used before it held them per
# layer); "pallas" the engine decoding through its Pallas kernel (attention="pallas",
# never yet run on a GPU: a failure here is a finding). The WebShop-shaped prefill padding is host-side arithmetic, measured on the CPU
# (--skip-padding).
run engine_0.5b 170 python3 -m tidejax.bench.engine --preset qwen2.5-0.5b --slots 64 \
    --skip-trace --skip-padding
run engine_7b 200 python3 -m tidejax.bench.engine --preset qwen2.5-7b --slots 64 \
    --skip-trace --skip-padding --timed-steps 64 --rounds 2 \
    --decoders engine,bare,engine_live_span,engine_stacked_layers,engine_pallas
# Is the stacked-layer scan copying each layer's weights per token? (7B layer shapes, bf16)
run layer_scan_probe 90 python3 "$repo/scripts/layer_scan_probe.py" --layers 8 --d 3584 \
    --f 18944 --dtype bfloat16
# Decode attention alone at 7B head shapes: the engine's gather vs JAX's Pallas GPU kernel
# and tidejax's own.
run paged_attention_probe 90 python3 "$repo/scripts/paged_attention_probe.py"
# The whole job for two steps on this one GPU at Qwen2.5-0.5B shapes (random weights, bf16):
# sync, since one device means rollout and training take turns on it.
run job_0.5b 200 python3 -m tidejax.experiments.webshop --system sync --devices 1 \
    --preset qwen2.5-0.5b --quick --no-progress --out /tmp/gpu_check_job_0.5b
cp /tmp/gpu_check_job_0.5b/summary.json "$out/job_0.5b_summary.json" 2>/dev/null
# Training: fused vs deferred-KL step, Qwen2.5-0.5B shapes.
run train_0.5b 120 python3 -m tidejax.bench.train --preset qwen2.5-0.5b --batch 8 \
    --length 1024 --rounds 5
# The same under remat at 4,096-token rows: the layer-by-layer deferred backward and the
# looped attention blocks that 7B and 14B run (never yet run on a GPU).
run train_0.5b_remat_4k 120 python3 -m tidejax.bench.train --preset qwen2.5-0.5b --batch 2 \
    --length 4096 --rounds 3 --remat
# The 7B rollout rank's decode and prefill compiled for this GPU (abstract arrays, nothing
# materialised; depth extrapolated from 2 and 3 layers) beside the memory model with and
# without the two KV-pool copies it adds for decode. On CPU those copies come from bf16
# programs only (f32 decode: no pool-sized temporaries at 1 or 8 tokens per call), so this
# says whether a GPU makes them.
run engine_memory_7b 100 python3 - <<'PY'
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
# The 7B actor's steps compiled for this GPU on one device (abstract, depth extrapolated
# from 2 and 3 layers) beside the memory model: whether the GPU compile holds the float32
# copy of the saved residual stream that XLA CPU makes in the deferred backward (the CPU
# figures subtract it as a CPU-only upcast; if a GPU makes it too, 14B needs 7.5 GiB more).
run actor_memory_7b 150 python3 - <<'PY'
from tidejax.bench import memory as bench_memory
from tidejax.models.config import get_preset
from tidejax.sched import memory
cfg = bench_memory.gpu_config("qwen2.5-7b")
model_config = get_preset("qwen2.5-7b")
shape = memory.ModelShape.of(model_config)
batch = memory.TrainerBatch(memory.trainer_rows(cfg.micro_batch_tokens, cfg.row_len, 1),
                            cfg.row_len, True)
peaks = bench_memory.compile_actor(model_config, cfg.trainer_rl(), 1, batch, (2, 3))
for step, peak in peaks.items():
    model = memory.trainer_step(shape, 1, batch, step).total
    print(f"7B actor1 {step} compiled_gib={peak.compiled / 2**30:.2f} "
          f"cpu_style_upcast_gib={peak.upcast / 2**30:.2f} model_gib={model / 2**30:.2f}",
          flush=True)
PY
echo "== summary"
grep -h "^decode tok/s\|^decode step reads\|^request loop\|^engine_overhead_ratio\|rc=\|skipped\|final_\|goodput\|^7B \|deferred_over_fused\|scan_over_unrolled\|pallas_over_gather" "$out"/*.txt

#!/usr/bin/env bash
# The learning check: success rate after GRPO vs after the SFT warm start, per seed.
#
#   bash scripts/learning_check.sh OUT_ROOT SEED [SEED ...]
#
# 1. The SFT warm start of every seed, at once, on the default JAX backend (a GPU when
#    there is one; on 2 CPU cores two seeds of the default config take about 16 min).
# 2. GRPO for every seed at once on 8 fake CPU devices each (the job's CPU default),
#    reusing the cached warm start; each job gets its own share of the cores.
# Prints one `system=... sft_success=... final_success=...` line per seed, then
# `learning_check raised_success_for=K/N`; exits non-zero unless GRPO beat SFT for every seed.
set -u -o pipefail
config=${CONFIG:-experiments/configs/webshop_learning.toml}
root=$1
shift
mkdir -p "$root"
for seed in "$@"; do
    XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.2} python3 -m tidejax.experiments.webshop \
        --config "$config" --seed "$seed" --out "$root/s$seed" --sft-only --no-progress \
        >"$root/sft_s$seed.log" 2>&1 &
done
wait
grep -h "sft_seconds\|SFT step [0-9]*000/\|Error" "$root"/sft_s*.log

cores=${GRPO_CORES:-$(nproc)}  # cores for these jobs, from GRPO_FIRST_CORE on
per_job=$(( cores / $# > 0 ? cores / $# : 1 ))
first=${GRPO_FIRST_CORE:-0}
for seed in "$@"; do
    pin=()
    command -v taskset >/dev/null && pin=(taskset -c "$first-$(( first + per_job - 1 ))")
    JAX_PLATFORMS=cpu timeout "${GRPO_TIMEOUT:-0}" "${pin[@]}" \
        python3 -m tidejax.experiments.webshop --config "$config" --seed "$seed" \
        --out "$root/s$seed" --no-progress >"$root/grpo_s$seed.log" 2>&1 &
    first=$(( first + per_job ))
done
wait
raised=0
for seed in "$@"; do
    echo "seed $seed:"
    grep -h "eval v\|^system=\|Error" "$root/grpo_s$seed.log"
    line=$(grep -h "^system=" "$root/grpo_s$seed.log")
    sft=$(sed -n 's/.*sft_success=\([0-9.]*\).*/\1/p' <<<"$line")
    final=$(sed -n 's/.*final_success=\([0-9.]*\).*/\1/p' <<<"$line")
    [ -n "$sft" ] && [ -n "$final" ] && awk -v a="$final" -v b="$sft" 'BEGIN{exit !(a > b)}' \
        && raised=$(( raised + 1 ))
done
# The verdict: for how many seeds success after GRPO beat success after the warm start.
echo "learning_check raised_success_for=$raised/$#"
[ "$raised" -eq "$#" ]

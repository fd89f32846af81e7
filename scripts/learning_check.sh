#!/usr/bin/env bash
# The learning check: does GRPO raise the evaluation reward of the warm start, per seed?
#
#   bash scripts/learning_check.sh OUT_ROOT SEED [SEED ...]
#
# Runs the default job (or CONFIG=FILE) once per seed, one after another, each on the
# whole machine, with the job's own command line. Each job evaluates its first and last
# policy on the same goals with the same sampling seeds and prints the reward gain and its
# standard error (the two evaluations' errors in quadrature). Prints one line per seed,
# then the verdict `learning_check reward_rose_for=K/N`: the seeds whose reward gain is
# more than two standard errors; exits non-zero unless that holds for every seed.
set -u -o pipefail
root=${1:?usage: learning_check.sh OUT_ROOT SEED [SEED ...]}
shift
config=()
[ -n "${CONFIG:-}" ] && config=(--config "$CONFIG")
mkdir -p "$root"
rose=0
for seed in "$@"; do
    log="$root/s$seed.log"
    python3 -m tidejax.experiments.webshop "${config[@]}" --seed "$seed" --out "$root/s$seed" \
        --no-progress >"$log" 2>&1
    echo "seed $seed (exit $?):"
    grep -h "eval v\|^system=\|Error" "$log"
    line=$(grep -h "^system=" "$log")
    gain=$(sed -n 's/.*reward_gain=\([-0-9.]*\).*/\1/p' <<<"$line")
    se=$(sed -n 's/.*gain_se=\([-0-9.]*\).*/\1/p' <<<"$line")
    [ -n "$gain" ] && [ -n "$se" ] && awk -v g="$gain" -v s="$se" 'BEGIN{exit !(g > 2 * s)}' \
        && rose=$(( rose + 1 ))
done
# The verdict: for how many seeds the last evaluation's reward beat the first's by > 2 se.
echo "learning_check reward_rose_for=$rose/$#"
[ "$rose" -eq "$#" ]

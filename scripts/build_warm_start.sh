#!/usr/bin/env bash
# Build a warm start (BPE tokenizer + SFT weights) and ship it under tidejax/warm_starts/NAME.
#
#   bash scripts/build_warm_start.sh NAME [job flags ...]
#
# Runs the job's SFT stage alone (`--sft-only`) with the given flags (e.g. `--config FILE`;
# none: the default job's settings) and copies what it cached, with the fingerprint of the
# settings that made it, into the package. Any later run whose settings give the same
# fingerprint (tidejax.runtime.shipped) starts from it instead of training its own.
# The default job's warm start (tidejax/warm_starts/webshop-tiny) was built with
#   bash scripts/build_warm_start.sh webshop-tiny
# in about 25 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: build_warm_start.sh NAME [job flags ...]}
shift
build=runs/warm_start_build/$name
dest=tidejax/warm_starts/$name
# Both go first: the job would otherwise start from the very warm start being rebuilt.
rm -rf "$build" "$dest"
python3 -m tidejax.experiments.webshop --sft-only --no-progress --out "$build" "$@"
mkdir -p "$dest"
cp "$build/tokenizer.json" "$build/sft_params.npz" "$build/warm_start.json" "$dest/"
ls -l "$dest"

#!/usr/bin/env bash
# Megatron-LM's dev branch (its ChunkedOptimizerStateOffloader, #6244, in no release yet) as a tree for
#   bench_megatron.py --megatron-path .megatron_dev --variants megatron-chunked
# .megatron_dev/ is git-ignored, never committed: carry it in the device call.
#   bash scripts/megatron_dev.sh /path/to/Megatron-LM [ref, default dev]
set -euo pipefail
src=${1:?usage: bash scripts/megatron_dev.sh /path/to/Megatron-LM [ref]}
ref=${2:-dev}
out="$(cd "$(dirname "$0")/.." && pwd)/.megatron_dev"
rm -rf "$out"
mkdir -p "$out"
git -C "$src" archive "$ref" megatron/core | tar -x -C "$out"
git -C "$src" rev-parse "$ref" >"$out/COMMIT"
echo "$out: megatron/core of $ref at $(cat "$out/COMMIT")"

#!/usr/bin/env bash
# One device call: benchmarks/bench_megatron.py with megatron-core 0.19.2 from its wheel in .whl_mc/ (carry it).
#   CHUNKED_OFFLOAD_SHA=$(git rev-parse --short HEAD) TAG=name bash scripts/gpu_megatron.sh [bench_megatron options]
# With --megatron-path .megatron_dev (scripts/megatron_dev.sh; carry it), Megatron-LM's dev branch instead, for the
# megatron-chunked variant. With --te, Transformer Engine staged by ../shared/gpu/te-prepare.sh (/tmp/te-site) is put on the path; without it,
# it is not, so that Megatron's inner is torch's AdamW as in the default run. The log, without Megatron's warnings,
# goes to $OUT/bench_megatron[_TAG].log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/chunked_offload_out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mc .whl_mc/*.whl
export PYTHONPATH="src:tests:benchmarks:/tmp/mc" PYTHONUNBUFFERED=1
case " $* " in *" --te "*) export PYTHONPATH="$PYTHONPATH:/tmp/te-site" ;; esac
python3 benchmarks/bench_megatron.py "$@" 2>&1 \
  | grep -v -i -E 'deprecat|full_param_layout|MimoModel|warnings\.warn|Falling back|class Mimo|return func|absl' \
  | tee "$out/bench_megatron${TAG:+_$TAG}.log" | tail -n 30
exit "${PIPESTATUS[0]}"

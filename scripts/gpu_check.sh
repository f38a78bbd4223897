#!/usr/bin/env bash
# One device call: every cuda-marked test, then the step benchmark, with a short table at the end.
#   bash scripts/gpu_check.sh [bench_step.py arguments...]
# Runs with the machine's python3 and PYTHONPATH=src (no virtualenv, no install): what the GPU image has.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src:tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-/tmp/chunked_offload_out}
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  grep -E "MemTotal|MemAvailable" /proc/meminfo
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } 2>&1 | tee "$out/machine.txt"
python3 -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$out/pytest_cuda.log" | tail -n 30
test_rc=${PIPESTATUS[0]}
python3 examples/train_loop.py --steps 20 2>&1 | tee "$out/example.log" | tail -n 4
example_rc=${PIPESTATUS[0]}
python3 benchmarks/bench_step.py --csv "$out/bench_step.csv" "$@" 2>&1 | tee "$out/bench_step.log"
bench_rc=${PIPESTATUS[0]}
echo "== summary: cuda tests rc=$test_rc ($(tail -n 1 "$out/pytest_cuda.log")), example rc=$example_rc, bench rc=$bench_rc"

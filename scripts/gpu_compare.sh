#!/usr/bin/env bash
# One device call: this tree's benchmarks beside an older commit's, one after the other on the same machine.
#   git archive <old-sha> src benchmarks tests | tar -x -C .old     (here; .old is git-ignored, carry it)
#   CHUNKED_OFFLOAD_SHA=$(git rev-parse --short HEAD) bash scripts/gpu_compare.sh
# bench_train at 16 x 2048 (resident, overlap, in-backward with and without its checks), bench_step's AdamW on 1e9
# fp32 params at 256 MB and 1 GiB chunks, then bench_titan (torchtitan 0.2.2 from .whl/, scripts/titan-prepare.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/chunked_offload_out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 CHUNKED_OFFLOAD_SHA=${CHUNKED_OFFLOAD_SHA:-unknown}
base=${PYTHONPATH:-}
train=(--batches 16 --warmup 2 --iters 5 --variants resident,overlap,backward,backward-unchecked)
step=(--workloads adamw --chunks-mb 256,1024 --warmup 2 --iters 5)
run() {  # run SECONDS NAME TREE SCRIPT ARGS...
  local limit=$1 name=$2 tree=$3 script=$4; shift 4
  PYTHONPATH="$tree/src:$tree/tests:$tree/benchmarks${base:+:$base}" timeout "$limit" \
    python3 "$tree/benchmarks/$script.py" "$@" 2>&1 | tee "$out/$name.log" | grep -v "^ *$" | tail -n 14
}
run 150 bench_train_new . bench_train "${train[@]}" --exact-steps 2
[ -d .old ] && run 110 bench_train_old .old bench_train "${train[@]}" --skip-exact
run 150 bench_titan . bench_titan --batch 16
run 80 bench_step_new . bench_step "${step[@]}"
[ -d .old ] && run 80 bench_step_old .old bench_step "${step[@]}"

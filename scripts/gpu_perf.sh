#!/usr/bin/env bash
# One device call for the figures of the performance issues, with a short table at the end (about 4 minutes on the
# H200 with --titan, 7 with --disk too; logs under $OUT):
#   CHUNKED_OFFLOAD_SHA=$(git rev-parse --short HEAD) bash scripts/gpu_perf.sh [--slots N] [--ab] [--titan] [--disk]
#   bench_train  resident, the "auto" modes and in-backward at 8 and 16 x 2048, 1 GiB chunks, N slots (3, as in the
#                performance issues), 3 warm-up iterations ("auto" in the fast modes re-plans before the third
#                step), timing only, with profiler traces (trace_summary.py: GPU idle per iteration,
#                the main stream's busy and idle time and its longest gaps, host ms per chunk, GPU time by kernel;
#                the traces are deleted)
#   --ab         bench_train again with resident chunks copied for rollback (--rollback-copy, the code before
#                one-op updates), untraced, then the one-op run again untraced: A, B, A on one machine
#   bench_step   AdamW on 1e9 fp32 params at 256 MB and 1 GiB chunks, checked bitwise
#   --titan      bench_titan against resident loops with and without masters, timing only (carry .whl: torchtitan)
#   --disk       bench_disk with 25% and 50% of the state on disk, and the tier's pattern of files alone
# Runs with the machine's python3 and PYTHONPATH=src, as scripts/gpu_check.sh does.
set -uo pipefail
cd "$(dirname "$0")/.."
titan=0 disk=0 ab=0 slots=3
while [ $# -gt 0 ]; do
  case "$1" in
    --slots) slots=$2; shift ;;
    --titan) titan=1 ;;
    --disk) disk=1 ;;
    --ab) ab=1 ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
  shift
done
out=${OUT:-/tmp/chunked_offload_out}
mkdir -p "$out"
if [ $titan -eq 1 ] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
root=$PWD
export PYTHONPATH="$root/src:$root/tests:$root/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CHUNKED_OFFLOAD_SHA=${CHUNKED_OFFLOAD_SHA:-unknown}
cd benchmarks
summary=()
python3 bench_train.py --batches 8,16 --num-slots "$slots" --warmup 3 --iters 5 --skip-exact --trace "$out/traces" \
  --variants resident,sync-auto,overlap-auto,backward-auto,backward > "$out/bench_train.log" 2>&1
summary+=("bench_train rc=$?")
python3 trace_summary.py "$out/traces" --kernels 12 --gaps 4 > "$out/trace_summary.log" 2>&1
rm -rf "$out/traces"
if [ $ab -eq 1 ]; then
  python3 bench_train.py --batches 8,16 --num-slots "$slots" --warmup 3 --iters 5 --skip-exact --rollback-copy \
    --variants resident,sync-auto,overlap-auto,backward-auto > "$out/bench_train_rollback_copy.log" 2>&1
  summary+=("bench_train --rollback-copy rc=$?")
  python3 bench_train.py --batches 8,16 --num-slots "$slots" --warmup 3 --iters 5 --skip-exact \
    --variants resident,sync-auto,overlap-auto,backward-auto > "$out/bench_train_one_op.log" 2>&1
  summary+=("bench_train one-op, untraced rc=$?")
fi
python3 bench_step.py --workloads adamw --chunks-mb 256,1024 --iters 6 > "$out/bench_step.log" 2>&1
summary+=("bench_step rc=$?")
if [ $titan -eq 1 ]; then
  python3 bench_titan.py --skip-exact --variants resident,resident-masters,sync,overlap,overlap-auto,backward --warmup 3 \
    --iters 4 > "$out/bench_titan.log" 2>&1
  summary+=("bench_titan rc=$?")
fi
if [ $disk -eq 1 ]; then
  python3 bench_disk.py --probe-gib 2 --shares 0.25,0.5 > "$out/bench_disk.log" 2>&1
  summary+=("bench_disk rc=$?")
fi
echo "== bench_train (kept = resident iterations/s over the variant's)"
grep -E "^ +(tokens|[0-9]+ +[a-z-]+ +[0-9.]+)" "$out/bench_train.log"
[ $ab -eq 1 ] && for run in rollback_copy one_op; do echo "== bench_train, $run"
  grep -E "^ +(tokens|[0-9]+ +[a-z-]+ +[0-9.]+)" "$out/bench_train_$run.log"; done
echo "== trace_summary (the kernels' GPU time and the idle before them: trace_summary.log)"
sed '/^$/q' "$out/trace_summary.log"
echo "== bench_step"
grep -E "^adamw|^#" "$out/bench_step.log"
[ $titan -eq 1 ] && { echo "== bench_titan"; grep -A8 "^variant" "$out/bench_titan.log"; }
[ $disk -eq 1 ] && { echo "== bench_disk"; grep -E "pattern|on disk|%|exact" "$out/bench_disk.log"; }
echo "== summary"
printf '  %s\n' "${summary[@]}"

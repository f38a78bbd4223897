#!/usr/bin/env bash
# One device call: every cuda-marked test, the example and the benchmarks, with a short table at the end.
#   bash scripts/gpu_check.sh [--quick] [--no-tests] [--shard K/N] [--sanitize] [--bench NAME ...]
# Runs with the machine's python3 and PYTHONPATH=src (no virtualenv, no install): what the GPU image has.
# Wheels carried in .whl/ (see the device README) are installed into /tmp/site first; Transformer Engine staged
# with ../shared/gpu/te-prepare.sh is picked up from /tmp/te-site when present.
#   --quick     tests only (no example, no benchmarks)
#   --no-tests  skip the cuda tier (for a second call that runs the benchmarks)
#   --shard K/N run the K-th of N shards of the cuda tier (round-robin over the collected tests): the whole tier
#               took 438-600 s in one call, and a call stops at 600 s, so two calls with 1/2 and 2/2 are safer
#   --sanitize  also run compute-sanitizer (memcheck and synccheck) over the cuda tier, last (see below)
#   --bench X   run benchmarks/X.py (repeatable); default: bench_step
#   --titan-fsdp  bench_titan.py --fsdp at 8 x 2048 (torchtitan 0.2.2 from .whl/: scripts/titan-prepare.sh): overlap,
#               overlap-modules, overlap-auto and overlap-masters bitwise against the plain loop over 10 iterations,
#               each chunk's step slowed, and the share of resident iterations/s each keeps; runs with --quick too
set -uo pipefail
cd "$(dirname "$0")/.."
quick=0 tests=1 sanitize=0 benches=() tier_shard=1/1 titan_fsdp=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --no-tests) tests=0 ;;
    --sanitize) sanitize=1 ;;
    --shard) shift; tier_shard=$1 ;;
    --bench) shift; benches+=("$1") ;;
    --titan-fsdp) titan_fsdp=1 ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
  shift
done
[ ${#benches[@]} -eq 0 ] && benches=(bench_step)
out=${OUT:-/tmp/chunked_offload_out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
[ -d /tmp/te-site ] && export PYTHONPATH="/tmp/te-site:${PYTHONPATH:-}"
export PYTHONPATH="src:tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The device's copy of the tree carries git metadata that is not the checkout's: pass the commit from the checkout,
#   CHUNKED_OFFLOAD_SHA=$(git rev-parse --short HEAD) bash scripts/gpu_check.sh
export CHUNKED_OFFLOAD_SHA=${CHUNKED_OFFLOAD_SHA:-unknown}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  grep -E "MemTotal|MemAvailable" /proc/meminfo
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import transformer_engine as te; print('transformer_engine', te.__version__)" 2>&1 | tail -n 1
  python3 -c "import emerging_optimizers as e; print('emerging_optimizers', e.__version__)" 2>&1 | tail -n 1
} 2>&1 | tee "$out/machine.txt"

cuda_ids() {  # the node ids of the cuda-marked tests under $@, one a line
  python3 -m pytest --collect-only -q -m cuda -p no:cacheprovider "$@" 2>/dev/null | grep '::'
}
shard_of() {  # shard K (from 0) of N, round-robin over the ids in FILE: shard_of FILE N K
  awk -v n="$2" -v k="$3" '(NR - 1) % n == k' "$1"
}

summary=()
if [ $titan_fsdp -eq 1 ]; then
  (cd benchmarks && PYTHONPATH="$PWD/../src:$PWD/../tests:$PWD:${PYTHONPATH:-}" timeout "${TITAN_TIMEOUT:-330}" \
    python3 bench_titan.py --fsdp --batch 8 --exact-steps 10 --warmup 3 --iters 5 --csv "$out/bench_titan_fsdp.csv") \
    > "$out/bench_titan_fsdp.log" 2>&1
  summary+=("bench_titan --fsdp rc=$?")
  while IFS= read -r line; do summary+=("  $line"); done < <(grep -E "^(control|bitwise|variant|resident|overlap)" \
    "$out/bench_titan_fsdp.log")
fi

if [ $tests -eq 1 ]; then
  cuda_ids tests > "$out/cuda_ids.txt"
  mapfile -t tier < <(shard_of "$out/cuda_ids.txt" "${tier_shard#*/}" $((${tier_shard%/*} - 1)))
  echo "cuda tier, shard $tier_shard: ${#tier[@]} tests"
  python3 -m pytest -q -m cuda -p no:cacheprovider "${tier[@]}" 2>&1 | tee "$out/pytest_cuda.log" | tail -n 40
  summary+=("cuda tests rc=${PIPESTATUS[0]}: $(tail -n 1 "$out/pytest_cuda.log")")
fi


if [ $quick -eq 0 ]; then
  python3 examples/train_loop.py --steps 20 2>&1 | tee "$out/example.log" | tail -n 4
  summary+=("example train_loop rc=${PIPESTATUS[0]}")
  python3 examples/rl_offload_loop.py 2>&1 | tee -a "$out/example.log" | tail -n 2
  summary+=("example rl_offload_loop rc=${PIPESTATUS[0]}: $(tail -n 2 "$out/example.log" | head -n 1)")
  for b in "${benches[@]}"; do
    python3 "benchmarks/$b.py" --csv "$out/$b.csv" 2>&1 | tee "$out/$b.log"
    summary+=("$b rc=${PIPESTATUS[0]}")
  done
fi
if [ $sanitize -eq 1 ]; then
  # The whole cuda tier under each tool (SANITIZE_TOOLS, default both; SANITIZE_FILES narrows it to some modules).
  # Tests marked `timing` skip there: instrumented streams do not race as the hardware does, and the tool keeps
  # each inner step's frames (and the grads they hold) alive. Under memcheck the tier takes longer than one device
  # call (measured at bfb2693: 58 tests in 530 s, the other 6 in 78 s), so each tool runs it as SANITIZE_SHARDS
  # shards (default 3, round-robin over the collected tests), every tool and shard at once, spread round-robin over
  # the visible GPUs. On the one-GPU H200 (16 cores) the six processes took 466 s at most (0eb731e).
  ids="$out/sanitize_ids.txt"
  cuda_ids ${SANITIZE_FILES:-tests} > "$ids"
  # No ids (a SANITIZE_FILES that selects nothing) would run pytest with no arguments: every test, CPU ones too.
  [ -s "$ids" ] || { echo "SANITIZE_FILES=${SANITIZE_FILES:-tests} selects no cuda test"; exit 2; }
  gpus=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
  shards=${SANITIZE_SHARDS:-3} job=0 logs=()
  for tool in ${SANITIZE_TOOLS:-memcheck synccheck}; do
    for ((shard = 0; shard < shards; shard++)); do
      log="$out/sanitizer_${tool}_${shard}of${shards}.log"
      mapfile -t mine < <(shard_of "$ids" "$shards" "$shard")
      CUDA_VISIBLE_DEVICES=$((job % gpus)) CHUNKED_OFFLOAD_UNDER_SANITIZER=1 timeout "${SANITIZE_TIMEOUT:-540}" \
        compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider "${mine[@]}" \
        > "$log" 2>&1 &
      logs+=("$log") job=$((job + 1))
    done
  done
  wait
  for log in "${logs[@]}"; do
    summary+=("$(basename "$log" .log): $(grep -E 'ERROR SUMMARY' "$log" | tail -n 1 | sed 's/=* *//')")
    summary+=("  $(grep -E '[0-9]+ (passed|failed|skipped)' "$log" | tail -n 1)")
  done
fi
echo "== summary"
printf '  %s\n' "${summary[@]}"

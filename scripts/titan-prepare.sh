#!/usr/bin/env bash
# Wheels for benchmarks/bench_titan.py on a GPU host that has torch (2.11) but reaches no package registry:
# torchtitan 0.2.2 (the newest that imports on torch 2.11) and what it imports that the GPU image lacks.
#
# Run in the project's root on a machine that reaches PyPI. It fills .whl/ (git-ignored), which scripts/gpu_check.sh
# installs into /tmp/site on the GPU host; carry it there with the run call's carry=[".whl"]. About 10 MB.
# The image has pandas, pyarrow, xxhash, fsspec, huggingface-hub, tensorboard, einops and rich already.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
py=${PYTHON:-python3}
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$py" -m pip download -q --no-deps "${plat[@]}" -d .whl "torchtitan==0.2.2" tyro docstring-parser typeguard shtab \
  tomli torchdata datasets dill multiprocess
ls -la .whl
du -sh .whl

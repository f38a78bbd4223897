#!/usr/bin/env bash
# Wheels for the peers bench_train compares against, for a GPU host that has torch but reaches no package registry:
# DeepSpeed 0.19.8 (ZeRO-Offload) and torchao (CPUOffloadOptimizer), with what the GPU image lacks of their needs.
#
# Run in the project's root on a machine that reaches PyPI. It fills .whl/ (git-ignored), which scripts/gpu_check.sh
# installs into /tmp/site on the GPU host; carry it there with the run call's carry=[".whl"]. About 10 MB.
#   DeepSpeed on PyPI is an sdist: it is built here as a pure-Python wheel (DS_BUILD_OPS=0); its CPU Adam op is
#   compiled just in time by deepspeed.initialize on the GPU host (nvcc and ninja are in the image; about a minute).
#   ninja, msgpack, einops and py-cpuinfo are in the GPU image already; hjson, pydantic (v2) and a typing-extensions
#   new enough for it are not.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
py=${PYTHON:-python3}
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$py" -m pip download -q --no-deps "${plat[@]}" -d .whl hjson pydantic pydantic-core annotated-types \
  typing-inspection typing-extensions "torchao==${TORCHAO_VERSION:-0.18.0}"
# The build imports torch (setup.py reads its version), hence no build isolation: run with a python that has torch.
if ! compgen -G ".whl/deepspeed-0.19.8-*.whl" > /dev/null; then
  DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
fi
ls -la .whl
du -sh .whl

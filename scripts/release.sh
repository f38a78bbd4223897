#!/usr/bin/env bash
# Build the release files and check them: the wheel and the source distribution into dist/, their metadata checked
# with twine, then a fresh virtualenv installs the wheel (with torch) and runs the README's quick start.
#   bash scripts/release.sh            # from a clean checkout of the commit to release
# Publishing is a separate, deliberate step: python -m twine upload dist/*, then git tag v$VERSION && git push --tags.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
rm -rf dist
"$py" -m pip install -q --disable-pip-version-check build twine
"$py" -m build --outdir dist .
"$py" -m twine check --strict dist/*
version=$("$py" -c "import re, pathlib; print(re.search(r'__version__ = \"([^\"]+)\"', pathlib.Path('src/chunked_offload/__init__.py').read_text())[1])")
tmp=$(mktemp -d)
"$py" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q --disable-pip-version-check "${TORCH_SPEC:-torch}" dist/*.whl
"$tmp/venv/bin/python" - <<'PY'
import pathlib, re
readme = pathlib.Path("README.md").read_text()
code = re.search(r"```python\n(.*?)```", readme[readme.index("## Quick start"):], re.S)[1]
exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
PY
rm -rf "$tmp"
echo "dist/ holds chunked-offload $version, checked; tag it with: git tag v$version"

# The two README commands: `make bench` (the main job) and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0 installs a CPU build from local disk on the project machines; override for a CUDA build elsewhere.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv test test-fast docs docs-check bench lint clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" "pytest>=8" "pytest-xdist>=3" "hypothesis>=6" numpy expecttest accelerate pytorch-lightning transformers tqdm ruff mypy build matplotlib
	$(PY) -m pip install -q "mkdocs>=1.6" "mkdocs-material>=9.5" "mkdocstrings[python]>=0.26"
	$(PY) -m pip install -q "spmd_types==0.2.3" tyro einops safetensors triton
	$(PY) -m pip install -q --no-deps -e .
	# torchtitan 0.3 for tests/test_torchtitan.py, without its data, logging and checkpoint dependencies: last, so
	# that no later install reports them missing.
	$(PY) -m pip install -q --no-deps "torchtitan==0.3.0"
	# megatron-core 0.19.2 for tests/test_megatron.py: only a cp312 wheel is published (Requires-Python >= 3.12), and
	# its Python code runs on 3.11, so the wheel is unpacked into the venv; its one extension (the dataset helpers)
	# is not used. Without its dependencies: torch, numpy and packaging are here already.
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 "megatron-core==0.19.2" -d $(VENV)/wheels
	$(PY) -m zipfile -e $(VENV)/wheels/megatron_core-0.19.2-*.whl "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	touch $@

# The docs build strictly, then the whole suite on every core (pytest-xdist). pytest exits 5 when every collected test
# was deselected or skipped (a CPU-only run of the cuda tier): not a failure.
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(or $(JOBS),auto)
test: docs
	$(PYTEST); rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

# A first look in under a minute: everything but the modules marked slow in tests/conftest.py.
test-fast: venv
	$(PYTEST) -m "not slow"; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

# The documentation site into site/, failing on a broken link or a missing reference.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -q

# Checks every page of the built site (lists rendered, no source-comment pointers), then renders each in headless
# Chromium (Debian: apt-get install chromium) into site/shots/.
docs-check: docs
	PYTHON=$(PY) bash scripts/docs-check.sh

bench: venv
	$(PY) benchmarks/bench_step.py

lint: venv
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m ruff format --check src tests benchmarks examples
	$(PY) -m mypy
	$(PY) -m mypy examples

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site

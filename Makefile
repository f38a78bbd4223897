# The two README commands: `make bench` (the main job) and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0 installs a CPU build from local disk on the project machines; override for a CUDA build elsewhere.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv test bench lint clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" "pytest>=8" "hypothesis>=6" numpy expecttest accelerate pytorch-lightning transformers tqdm ruff mypy build
	# torchtitan 0.3 for tests/test_torchtitan.py: without its data, logging and checkpoint dependencies.
	$(PY) -m pip install -q --no-deps "torchtitan==0.3.0"
	$(PY) -m pip install -q "spmd_types==0.2.3" tyro einops safetensors triton
	$(PY) -m pip install -q --no-deps -e .
	touch $@

# pytest exits 5 when every collected test was deselected or skipped (a CPU-only run of the cuda tier): not a failure.
test: venv
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

bench: venv
	$(PY) benchmarks/bench_step.py

lint: venv
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m ruff format --check src tests benchmarks examples
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

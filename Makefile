# Two entry points for a fresh Debian machine with Python 3.11: `make demo` and `make test`.
# Prerequisites: python3.11 with venv and its headers (python3.11-dev), gcc, make.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# torch comes from its CPU wheel first so that nothing pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: venv demo test bench wheel test-pythons test-sglang-versions mutation clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# The package and its extension alone: numpy, lmdb, tqdm. All the demo needs (no torch, no test extras).
$(VENV)/.built: $(BIN)/python setup.py setup.cfg pyproject.toml $(wildcard native/*.c native/*.h)
	$(BIN)/pip install -q -e .
	touch $@

# Everything the test suite and the benchmarks need on top.
$(VENV)/.installed: $(VENV)/.built
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.built
	$(BIN)/umbp-nvme demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: $(VENV)/.installed
	$(BIN)/umbp-nvme bench engine

# dist/umbp_nvme-*.whl: manylinux wheels with the compiled extension and the docs, for machines
# without a compiler (tools/build_wheel.sh: each Python's pip wheel, then auditwheel repair).
# One per CPython in PYTHONS (default: each of 3.10-3.13 found here; a missing one is said, and stops
# the build under CI=true or when PYTHONS names it), e.g. `make wheel PYTHONS="3.11 3.12"`.
PYTHONS ?=
wheel: $(BIN)/python
	PYTHONS="$(PYTHONS)" bash tools/build_wheel.sh $(BIN)/python

# Not in .ci/run (minutes each, GBs of wheels): the store, engine and CLI tests on each CPython
# 3.10-3.13 (PYTHONS=..., TESTS=...), and tests/sglang against each supported SGLang release
# (VERSIONS=...), each in a venv of its own under /tmp. Each prints one summary line per venv.
test-pythons:
	bash tools/test_pythons.sh

test-sglang-versions:
	bash tools/test_sglang_versions.sh

# Mutation report for keys, hits, config and the segment allocator (not part of .ci/run):
# writes tools/mutation/report.md; MODULES="keys hits" for some, JOBS=2 for two workers.
MODULES ?=
JOBS ?= 1
$(VENV)/.mutation: $(VENV)/.installed setup.cfg
	$(BIN)/pip install -q -e '.[test,mutation]'
	touch $@

mutation: $(VENV)/.mutation
	$(BIN)/python tools/mutation/run.py --jobs $(JOBS) $(MODULES)

clean:
	rm -rf $(VENV) build dist *.egg-info umbp_nvme/*.so

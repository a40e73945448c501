# Two entry points for a fresh machine: `make demo` and `make test`. Both install what they need
# into .venv (the CPU build of torch is pinned by constraints.txt).
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/tierflow demo

# tierflow side by side with MosaicML Streaming and LitData (benchmarks/peers/README.md). The peers
# live in their own venv, never in .venv/CI: `.[bench]` pulls them, and with them PyPI's CUDA
# torchvision, which cannot load next to the CPU torch, so it is removed (benchmarks/peers/compat.py).
PEERS_VENV ?= .venv-peers
PEERS_BIN = $(PEERS_VENV)/bin

$(PEERS_BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_BIN)/python -m pip install -q -U pip
	$(PEERS_BIN)/python -m pip install -q -c constraints.txt -e '.[dev,bench]'
	$(PEERS_BIN)/python -m pip uninstall -q -y torchvision
	touch $@

bench-peers: $(PEERS_BIN)/.installed
	$(PEERS_BIN)/python benchmarks/peers/run.py $(ARGS)

test: $(BIN)/.installed
	$(BIN)/pytest

test-fast: $(BIN)/.installed
	$(BIN)/pytest -m "not slow"

.PHONY: install demo test test-fast bench-peers

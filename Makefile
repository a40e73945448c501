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

test: $(BIN)/.installed
	$(BIN)/pytest

test-fast: $(BIN)/.installed
	$(BIN)/pytest -m "not slow"

.PHONY: install demo test test-fast

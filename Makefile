# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install, build the embedded model family (cached), run the main job
#   make test   - create .venv, install, run the test suite (what .ci/run calls)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup demo zoo bench test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

zoo: $(STAMP)
	$(BIN)/specserve zoo build

demo: zoo
	$(BIN)/specserve demo --config configs/local.yaml

bench: zoo
	$(BIN)/specserve bench --config configs/local.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) bench_out .pytest_cache

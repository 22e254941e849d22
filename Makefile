# Two commands do all set-up on a fresh machine:
#   make serve  - create .venv, install, build the embedded model family (cached), complete held-out
#                 prompts with speed/acceptance statistics, then serve it (gRPC :9000, HTTP :8000)
#   make test   - create .venv, install, run the test suite (what .ci/run calls)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup demo serve zoo bench test clean

$(STAMP): pyproject.toml package-lock.json
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev,loadtest,bench,proto]'    # the serving set + every extra (pyproject.toml)
	@# the upstream Gateway API / cert-manager / Prometheus Operator schemas tests/k8s checks k8s/ against
	@# (package.json, pinned by package-lock.json) into node_modules/
	@if command -v npm >/dev/null 2>&1; then npm ci --no-audit --no-fund --ignore-scripts --loglevel=error; \
	else echo "make: no npm: tests/k8s skips the upstream schema check (apt-get install nodejs npm)" >&2; fi
	touch $(STAMP)

setup: $(STAMP)

zoo: $(STAMP)
	$(BIN)/specserve zoo build

demo: zoo
	$(BIN)/specserve demo --config configs/local.yaml

serve: demo
	$(BIN)/specserve up --config configs/local.yaml

bench: zoo
	$(BIN)/specserve bench --config configs/local.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) bench_out .pytest_cache

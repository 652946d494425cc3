# Two entry points (README quick start): `make demo` and `make test`.
# Both create or reuse .venv; it is rebuilt only when pyproject.toml changes.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
INPUTS_HASH := $(shell cat pyproject.toml scripts/install-env.sh | sha256sum | cut -c1-16)
STAMP := $(VENV)/.installed-$(INPUTS_HASH)

.PHONY: demo test test-unit lint env clean

env: $(STAMP)

$(STAMP): pyproject.toml scripts/install-env.sh
	bash scripts/install-env.sh $(VENV) $(PY)
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(VENV)/bin/capture-proxy demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The slowest tests are listed at the end: a full run is to stay under 30 minutes (.ci/run).
test: $(STAMP) lint
	$(VENV)/bin/python -m pytest -p no:cacheprovider --durations=20

# The in-process tier alone (tests/unit, about a minute): for quick iterations, not for CI.
test-unit: $(STAMP)
	$(VENV)/bin/python -m pytest -p no:cacheprovider -m unit

clean:
	rm -rf $(VENV) demo-out

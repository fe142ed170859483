# `make run` and `make test` work from a fresh clone with only Python 3.11+ installed.
# Without an active virtualenv they create and use .venv.
PYTHON ?= python3
ifdef VIRTUAL_ENV
  PY := python
  STAMP_DIR := $(VIRTUAL_ENV)
else
  PY := .venv/bin/python
  STAMP_DIR := .venv
endif
TEST_WORKERS ?= 2

.PHONY: run test install install-dev browser engine-cpu engine-sglang lint mutants docs migrate seed bench clean

$(STAMP_DIR)/.installed-run: pyproject.toml setup.py controlplane/imaging/_jpegrows.c
	@test -x $(PY) || $(PYTHON) -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	@touch $@

$(STAMP_DIR)/.installed-dev: pyproject.toml $(STAMP_DIR)/.installed-run
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $@

install: $(STAMP_DIR)/.installed-run
install-dev: $(STAMP_DIR)/.installed-dev

# Local defaults: a secret key generated once under var/, the product's own error pages (DEBUG
# off); override by exporting.
run: export LOCAL_SECRET_KEY ?= true
run: install
	$(PY) manage.py migrate --noinput
	$(PY) manage.py seed_demo
	$(PY) manage.py runlocal

# Browser tests drive Debian's chromium through Playwright (Playwright's own browser download
# cannot work offline). As root it is installed when missing; otherwise say what to do.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the browser tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "the browser tests need chromium: sudo apt-get install chromium" >&2; exit 1; fi; }

# vLLM's CPU build in an engine environment of its own, outside the project's (reused
# between runs; a few minutes the first time). The real-engine tests run it.
engine-cpu: install
	@$(PY) -m workers.engines.cpu.install >/dev/null

# SGLang's package over that environment, without its GPU kernels: the tests check the
# launcher's SGLang commands with SGLang's own argument parser (SGLang does not serve here).
engine-sglang: engine-cpu
	@$(PY) -m workers.engines.sglang_env >/dev/null

test: install-dev browser engine-cpu engine-sglang
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)
	@echo "the accounting tests again, in embedded mode (SQLite, no Redis):"
	DATABASE_URL=sqlite:///var/tests/embedded.sqlite3 REDIS_URL= \
		$(PY) -m pytest -n $(TEST_WORKERS) -m accounting $(PYTEST_ARGS)

# Ruff, the import layers (pyproject.toml), and the subjects of the commits after
# .ci/commits-base (at most 72 characters, then a blank line before the body).
lint: install-dev
	$(PY) -m ruff check .
	$(PY) -c "from importlinter.cli import lint_imports_command; lint_imports_command()"
	.ci/check-commits

# The documentation site: the reference pages regenerated from the code, then built into site/
# (`mkdocs serve` to read it while writing). A warning (a broken link or anchor) fails it.
mutants: install-dev
	$(PY) -m tools.mutants

docs: install-dev
	$(PY) -m docs.generate
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

$(STAMP_DIR)/.installed-bench: pyproject.toml $(STAMP_DIR)/.installed-dev
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	@touch $@

# Benchmarks print their figures; they assert nothing. The gateway and engine-path benches use
# PostgreSQL and Redis on 127.0.0.1, like the test suite; the engine-path bench runs vLLM's
# CPU build (engine-cpu).
bench: $(STAMP_DIR)/.installed-bench engine-cpu
	$(PY) -m bench.imaging
	$(PY) -m bench.gateway
	$(PY) -m bench.engine_path
	$(PY) -m bench.engine_path --pin
	$(PY) -m bench.metering
	$(PY) -m bench.request_log

clean:
	rm -rf var/ .pytest_cache site/

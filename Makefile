# The README's two commands:  `make demo`  and  `make test`.
# Both build their own virtual environment from the pinned constraints; `make test`
# also installs the system packages the tests need (systemd-container, prometheus, ...)
# when they are missing and we are root.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONSTRAINTS := requirements/constraints.txt
DEMO_ARGS ?=
# Most tests wait on real processes, restarts and windows rather than burn CPU, so six
# workers fit a 2-core CI machine (measured one after another on one: 4 workers 7:04 wall
# with 1.1 cores busy, 6 workers 5:32 with 1.6, 8 workers 4:46 with both cores saturated,
# which leaves the waits no headroom); each file stays on one worker (shared fixtures), the
# longest files start first (tests/durations.json, see tests/conftest.py). Tests marked
# `alone` measure rates or open thousands of streams: beside the other workers they
# measured the machine, not specd (CI: 54 % of a paced rate), and starved their neighbours,
# so they run afterwards, one at a time, with nothing else.
PYTEST_ARGS ?= -n 6 --dist loadfile

.PHONY: demo test lint typecheck unit system-deps constraints clean bench

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@scripts/ensure-venv "$(PYTHON)" "$(VENV)"
	$(BIN)/pip install -q --disable-pip-version-check -c $(CONSTRAINTS) -e '.[dev,tools]'
	@touch $@

demo: $(STAMP)
	$(BIN)/specd demo $(DEMO_ARGS)

system-deps:
	@scripts/install-system-deps

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

# pytest exits 5 when it collected nothing: that is a failure here, never a pass.
# The tests write bytecode even where PYTHONDONTWRITEBYTECODE is set (this machine's
# environment sets it): without it every pytest worker rewrote and compiled every test
# module again (12 s of CPU each, 5 s from the cache) and every twin or `specd` child
# compiled specd anew. The files go to the gitignored __pycache__ directories.
unit: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest $(PYTEST_ARGS) -m "not alone"
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest -n 0 -m alone

test: system-deps lint typecheck unit

bench: $(STAMP)
	$(BIN)/python -m bench

# Regenerate the pinned constraints (name==version with python markers, no index URLs) with
# uv's universal resolver, so one file serves every Python from 3.10 up.
constraints:
	@scripts/ensure-venv "$(PYTHON)" "$(VENV)"
	$(BIN)/pip install -q uv
	$(BIN)/uv pip compile -q --universal --python-version 3.10 --no-emit-index-url \
	    --extra dev --extra tools --output-file $(CONSTRAINTS) pyproject.toml

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache

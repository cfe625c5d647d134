# kvgov developer entry points. `make demo` and `make test` are the README's two commands.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
export LMCACHE_TRACK_USAGE := false

LOCK   := deploy/image/requirements.lock

.PHONY: demo serve test lint typecheck install clean image lock

$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first: 2.13.0 is a local CPU build; any other spec pulls gigabytes of CUDA packages
	$(PY) -m pip install --quiet torch==2.13.0
	# the sidecar's dependencies at the image's locked versions, so the tests run what the image
	# ships (the pins only: pip reads hashes in a constraints file as a demand to hash everything,
	# the editable kvgov and the extras included)
	sed -n 's/^\([A-Za-z0-9._-]*==[^ ]*\).*/\1/p' $(LOCK) > $(VENV)/lock-constraints.txt
	$(PY) -m pip install --quiet -c $(VENV)/lock-constraints.txt -e '.[lmcache,redis,test,dev]'
	# the real OPA engine, used by the differential policy tests (its metadata claims py>=3.14)
	$(PY) -m pip install --quiet --ignore-requires-python opa-golib-python-bindings==0.4.4
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/kvgov demo

serve: install
	$(VENV)/bin/kvgov init
	$(VENV)/bin/kvgov serve

lint: install
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

typecheck: install
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: install lint typecheck
	# the slowest tests are named at the end of every run: a suite creeping past its budget shows where
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=15

# The image's hash-locked dependencies (deploy/image/requirements.lock, build.lock; docs/deploy.md,
# "The lock"): re-resolved from the configured index, keeping the current pins unless
# UPGRADE=1. Review the diff before committing it; `make install` then follows the new lock.
lock: install
	$(PY) deploy/image/lock.py $(if $(UPGRADE),--upgrade)

# The sidecar's container image (Containerfile). No registry here: the base is built from
# Debian's packages (debootstrap, cached under build/image/); BASE=<image> uses another base.
# Prints the image's size and its start-up time to ready.
image:
	deploy/image/build.sh

clean:
	rm -rf $(VENV) .kvgov .mypy_cache .ruff_cache

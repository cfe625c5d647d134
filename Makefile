# kvgov developer entry points. `make demo` and `make test` are the README's two commands.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
export LMCACHE_TRACK_USAGE := false

.PHONY: demo serve test lint typecheck install clean image

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first: 2.13.0 is a local CPU build; any other spec pulls gigabytes of CUDA packages
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[lmcache,redis,test,dev]'
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

# The sidecar's container image (Containerfile). No registry here: the base is built from
# Debian's packages (debootstrap, cached under build/image/); BASE=<image> uses another base.
# Prints the image's size and its start-up time to ready.
image:
	deploy/image/build.sh

clean:
	rm -rf $(VENV) .kvgov .mypy_cache .ruff_cache

# The two quick-start commands: `make demo` (the main job) and `make test`.
# Each creates or reuses the virtual environment in $(VENV) and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install test test-fast test-matrix test-gpu demo clean

$(STAMP): requirements.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

# two workers, each taking whole test files (module fixtures stay shared): the suite's
# waits (process start-up, SLURM's scheduler, timeouts under test) overlap the other's work
WORKERS ?= 2
XDIST := -n $(WORKERS) --dist loadfile

test: install
	$(PY) -m pytest -q -ra --durations=25 $(XDIST) -m "not matrix" tests

# the repeated parametrisations and the studies' dry runs `make test` leaves out (a few minutes)
test-matrix: install
	$(PY) -m pytest -q -ra -m matrix tests

# the developer's loop (about 2 min here): every module's unit tests and one end-to-end
# run per entry point; the slow rest (multi-process equality matrices, launchers, the
# GPU scripts' dry runs) is in `make test` only
test-fast: install
	$(PY) -m pytest -q -ra $(XDIST) -m "not slow and not matrix" tests

# the GPU subset (CUDA tests and one multi-process test per launcher path); on a GPU
# machine without network tools/gpu_check.sh runs it with the machine's own python
test-gpu: install
	$(PY) -m pytest -q -ra -m gpu tests

demo: install
	$(PY) tools/demo.py

clean:
	rm -rf $(VENV) build *.egg-info

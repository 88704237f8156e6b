# The two quick-start commands: `make demo` (the main job) and `make test`.
# Each creates or reuses the virtual environment in $(VENV) and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install test test-fast demo clean

$(STAMP): requirements.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -q -ra --durations=25 tests

test-fast: install
	$(PY) -m pytest -q -ra -m "not slow" tests

demo: install
	$(PY) tools/demo.py

clean:
	rm -rf $(VENV) build *.egg-info

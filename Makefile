# The two entry points of the README. Both create the environment first when it is missing.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
REPORT ?= report
PYTEST := $(PY) -m pytest

.PHONY: venv conformance test clean-venv

# sglang's and speculators' declared dependency trees are CUDA-only (flashinfer, sgl-kernel, ...),
# so everything is installed from one fully pinned lock file with --no-deps: exactly these versions,
# nothing resolved at install time, the torch pin never swapped by another package.
$(VENV)/.installed: requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements.lock
	touch $@

venv: $(VENV)/.installed

# The main job: the CPU conformance lane on tiny models generated on the fly, with its report.
conformance: venv
	$(PYTEST) -m "cpu and not meta" --report $(REPORT)

# The harness self-tests and the CPU conformance lane.
test: venv
	$(PYTEST) -m cpu

clean-venv:
	rm -rf $(VENV)

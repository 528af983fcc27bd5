# The two entry points of the README. Both create the environment first when it is missing.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
REPORT ?= report
PYTEST := $(PY) -m pytest

.PHONY: venv lint conformance check test support-matrix clean-venv bench bench-baseline bench-compare

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

# Your draft, one verdict (README "Bring your own draft"): only the checks on your files, the verdict at the
# end and at the top of $(REPORT)/report.md. pytest exits 0 served as trained, 1 not, 4 bad input (make
# itself exits 2 whenever pytest does not exit 0). Optional: DATA (JSONL samples), HIDDEN (their hidden
# states), TARGET (the target's config.json), SGLANG_ARGS (the server flags), TRAINER (see --trainer),
# TRAINED_AUX (the layers training captured, e.g. embed,3,31, when config.json was rewritten for serving).
check: $(if $(DRAFT),venv)
	@test -n "$(DRAFT)" || { echo "usage: make check DRAFT=dir [DATA=file] [HIDDEN=dir] [TARGET=config.json]" \
		"[SGLANG_ARGS=\"...\"] [TRAINER=speculators|specforge|eagle3] [TRAINED_AUX=embed,3,31]" >&2; exit 4; }
	$(PYTEST) -q --draft-checkpoint="$(DRAFT)" $(if $(DATA),--training-data="$(DATA)") \
		$(if $(HIDDEN),--hidden-states="$(HIDDEN)") $(if $(TARGET),--target-config="$(TARGET)") \
		$(if $(SGLANG_ARGS),--sglang-args="$(SGLANG_ARGS)") $(if $(TRAINER),--trainer=$(TRAINER)) \
		$(if $(TRAINED_AUX),--trained-aux-layers=$(TRAINED_AUX)) --report $(REPORT)

# The linter: ruff, configured in pyproject.toml.
lint: venv
	$(VENV)/bin/ruff check .

# The linter, the harness self-tests, the CPU conformance lane and the engine lane (SGLang's real Engine).
test: venv lint
	$(PYTEST) -m "cpu or engine"

# Draft throughput (conformance/throughput/test_throughput.py). Figures are stored and compared per machine
# class under $(BENCH_BASELINES)/<class>/ (`python -m conformance.throughput.throughput` prints this host's), in
# units of the memory-roofline time measured in the same run: ratios, not seconds. On a CUDA host
# select the GPU sweep: make bench-compare BENCH_MARK="benchmark and gpu".
BENCH_BASELINES ?= benchmarks/baselines
BENCH_MARK ?= benchmark and not gpu
BENCH_SELECT ?=
BENCH_FAIL ?= median:50%
BENCH_REPORT ?=
BENCH_TESTS ?= conformance/throughput/test_throughput.py
# CPU threads per figure: one by default, so that a figure does not stall at thread barriers when
# other processes share the cores (the thread count is part of the machine class).
BENCH_THREADS ?= 1
BENCH_ARGS = $(BENCH_TESTS) -m "$(BENCH_MARK)" $(if $(BENCH_SELECT),-k "$(BENCH_SELECT)") --benchmark-enable \
	--bench-baselines=$(BENCH_BASELINES) --benchmark-columns=median,iqr,min,max,rounds \
	$(if $(BENCH_REPORT),--report=$(BENCH_REPORT))

# Measure and print the table (tokens/s, roofline fraction per adapter); nothing stored.
bench: venv
	OMP_NUM_THREADS=$(BENCH_THREADS) $(PYTEST) $(BENCH_ARGS)

# Record a new baseline for this machine class (commit the JSON it writes).
bench-baseline: venv
	OMP_NUM_THREADS=$(BENCH_THREADS) $(PYTEST) $(BENCH_ARGS) --benchmark-save=baseline

# Fail when a figure's median is worse than this class's latest baseline by more than $(BENCH_FAIL).
bench-compare: venv
	OMP_NUM_THREADS=$(BENCH_THREADS) $(PYTEST) $(BENCH_ARGS) --benchmark-compare --benchmark-compare-fail=$(BENCH_FAIL)

# Refresh the README's support matrix from the known-divergence registry.
support-matrix: venv
	$(PY) -m conformance.core.support_matrix --write-readme

clean-venv:
	rm -rf $(VENV)

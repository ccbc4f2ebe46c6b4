# Two commands on a fresh machine:  `make demo` (the CPU S3AC run) and `make test` (the test suite).
# Both create/reuse .venv and install what they need (torch 2.13.0 CPU wheel first, so nothing pulls
# a CUDA build), then the package in editable mode with its test extra.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat setup.py requirements-cpu.txt | cksum | cut -d' ' -f1)

.PHONY: demo test test-all install

$(STAMP): setup.py requirements-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c requirements-cpu.txt -e ".[test]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchrun --nproc-per-node 2 -m megatron_s3ac.trainer.cli demo examples/cpu_demo.yaml

test: $(STAMP)
	$(VENV)/bin/pytest -m "not slow and not gpu" -q

test-all: $(STAMP)
	$(VENV)/bin/pytest -q

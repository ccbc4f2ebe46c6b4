# Two commands on a fresh machine:  `make demo` (the CPU S3AC run) and `make test` (the test suite).
# Both create/reuse .venv and install what they need (torch 2.13.0 CPU wheel first, so nothing pulls
# a CUDA build), then the package in editable mode with its test extra.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat setup.py requirements-cpu.txt | cksum | cut -d' ' -f1)

.PHONY: demo test test-all install sglang-wheel

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

# The pinned sglang wheel (39 MB, read as source by tests/rollout/test_sglang_contract.py, never installed or
# imported): fetched once from the package index; offline, those tests skip and say so.
SGLANG_CACHE := $(HOME)/.cache/megatron_s3ac
sglang-wheel: $(STAMP)
	@v=$$($(PY) -c "from megatron_s3ac.rollout.sglang_engine import SGLANG_VERSION as v; print(v)"); \
	ls $(SGLANG_CACHE)/sglang-$$v-*.whl >/dev/null 2>&1 || \
	$(PY) -m pip download -q "sglang==$$v" --no-deps -d $(SGLANG_CACHE) 2>/dev/null || \
	echo "could not fetch sglang==$$v (pip download sglang==$$v --no-deps -d $(SGLANG_CACHE)):" \
	     "tests/rollout/test_sglang_contract.py will skip"

test: $(STAMP) sglang-wheel
	$(VENV)/bin/pytest -m "not slow and not gpu" -q

test-all: $(STAMP) sglang-wheel
	$(VENV)/bin/pytest -q

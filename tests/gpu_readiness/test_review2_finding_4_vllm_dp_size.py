"""Second review, finding 4 (issue 41): ``rollout.vllm.dp_size > 1`` was accepted, and vLLM refuses it at start.

At ec9434d ``validate_vllm_settings`` took dp_size = 2 (gpus_per_engine = tp x dp) and ``gpu_llm_kwargs`` passed
``data_parallel_size=2`` to ``vllm.LLM``, which raises for any data_parallel_size > 1 in one process
(``entrypoints/llm.py:281-294``) -- after the cluster was paid for and the trainer had built its models. The
weight groups (one sender per stage, ``tp_size`` workers per engine) assume dp = 1 too. Now ``s3ac-train check``
refuses it, naming the key. The refusal is vLLM's own: the pinned build's ``LLM.__init__`` is run with
data_parallel_size=2 in the engine's environment and must raise before building anything.
"""
import os
import subprocess

import pytest

from megatron_s3ac.rollout.errors import ConfigError
from megatron_s3ac.rollout.engines.vllm.settings import VLLMSettings, engine_python, validate_vllm_settings


def test_dp_size_above_one_is_refused_naming_the_key():
    s = VLLMSettings(num_engines=1, tp_size=2, dp_size=2, gpus_per_engine=4, expert_parallel=True)
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.dp_size: must be 1, got 2: vllm\.LLM refuses "
                                          r"data_parallel_size > 1.*rollout\.vllm\.num_engines"):
        validate_vllm_settings(s, cluster_gpus=8, trainer_gpus=4, placement="separate")
    validate_vllm_settings(VLLMSettings(num_engines=2, tp_size=2, gpus_per_engine=2, expert_parallel=True),
                           cluster_gpus=8, trainer_gpus=4, placement="separate")  # the same GPUs as 2 engines


def test_config_loader_refuses_it(tmp_path):
    from megatron_s3ac.models.tiny_models import save_tiny_hf
    from megatron_s3ac.config import ConfigError, load_config  # the trainer's own (it names the file)

    d = save_tiny_hf("qwen3", str(tmp_path / "q3"))
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.dp_size: must be 1"):
        load_config(None, [f"model.hf_config={d}", f"model.engine_hf_dir={d}", "rollout.engine=vllm",
                           "rollout.vllm.dp_size=2", "rollout.vllm.gpus_per_engine=2"])


def test_pinned_vllm_refuses_data_parallel_in_one_process():
    py = engine_python()
    if not os.access(py, os.X_OK):
        pytest.skip(f"no vLLM environment at {py} (make vllm-env)")
    probe = ("from vllm import LLM\n"
             "try:\n    LLM(model='/nonexistent-model-dir', data_parallel_size=2)\n"
             "except ValueError as e:\n    print('REFUSED', e)\n")
    out = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))})
    assert "REFUSED LLM(data_parallel_size=2) is not supported for single-process usage" in out.stdout, \
        out.stdout[-2000:] + out.stderr[-2000:]

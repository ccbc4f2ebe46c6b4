"""Finding 7 (issue 24): every model the trainer builds is on the trainer's device, the value-pretraining critic
included.

At 2c164be ``value_pretrain`` built a fresh critic and never moved it (``build.py`` moves actor and critic); on a
GPU this project's norm modules stay on the host, DDP moves only trainable params, and the frozen norms broke the
first forward. On CPU the host is the trainer's device, so the device-placement audit
(megatron_s3ac/testing/device_audit.py) points the target device at ``meta`` and builds actor, critic and the
value-pretraining critic through the trainer's own code, up to where each reaches DDP; every parameter and buffer
must be there. Models: a tiny Qwen3.5 (its own norm and gate modules), a tiny dense Qwen3 and the demo's tiny MoE
(one gloo rank audits all three).
"""
import json
import os

import pytest

from megatron_s3ac.testing.device_audit import audit_rank
from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.models.tiny_models import tiny_config
from megatron_s3ac.models.tiny_qwen3_5 import tiny_qwen3_5_config

MODELS = ("qwen3_5", "qwen3", "tiny")


@pytest.fixture(scope="module")
def audits(tmp_path_factory):
    configs = {"tiny": ["model.tiny=arithmetic_moe", "algo.name=s3ac"]}
    for name, cfg in (("qwen3_5", tiny_qwen3_5_config("text")), ("qwen3", tiny_config("qwen3"))):
        path = os.path.join(tmp_path_factory.mktemp(name), "config.json")
        with open(path, "w") as f:
            json.dump(cfg.to_dict(), f)
        configs[name] = [f"model.hf_config={path}", "model.tiny=null", "algo.name=s3ac"]
    return run_distributed(audit_rank, 1, configs)[0]


@pytest.mark.parametrize("model", MODELS)
def test_every_model_the_trainer_builds_is_wholly_on_the_target_device(audits, model):
    audit = audits[model]
    assert set(audit) == {"actor", "critic", "value_pretrain_critic"}
    assert audit["actor"] == [] and audit["critic"] == []  # build.py placed these already at 2c164be
    assert audit["value_pretrain_critic"] == [], f"left on the host: {audit['value_pretrain_critic'][:5]}"

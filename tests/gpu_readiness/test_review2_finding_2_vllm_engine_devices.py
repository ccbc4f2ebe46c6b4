"""Second review, finding 2 (issue 41): vLLM servers were never given devices.

At ec9434d ``VLLMEngine._start`` started every server with rank 0's environment and no ``CUDA_VISIBLE_DEVICES``;
vLLM's GPU worker binds ``cuda:{local_rank}`` of what it sees (``v1/worker/gpu_worker.py:436-500``), so every
engine's TP workers took ``cuda:0..tp-1`` -- the trainer's GPUs -- and all engines stacked on them. Each server
now gets its own devices (``settings.engine_devices``): separate placement the GPUs after the trainer's local
ranks, colocated the GPUs of the trainer ranks it shares, mapped through rank 0's own CUDA_VISIBLE_DEVICES, and a
ConfigError naming ``rollout.vllm.num_engines`` when they do not fit on rank 0's node. The engine half is the real
``VLLMEngine`` start-up path with ``subprocess.Popen`` recorded (no GPU here: the device count is patched to 8).
"""
import json
import os
import sys

import pytest

from megatron_s3ac.rollout.engines.vllm import engine as engine_mod
from megatron_s3ac.rollout.engines.vllm.settings import VLLMSettings, engine_devices
from megatron_s3ac.rollout.errors import ConfigError


def test_separate_engines_get_disjoint_gpus_after_the_trainers():
    s = VLLMSettings(num_engines=2, tp_size=2, gpus_per_engine=2)
    got = [engine_devices(e, s, "separate", node_gpus=8, trainer_local_ranks=4) for e in range(2)]
    assert got == ["4,5", "6,7"]
    # through rank 0's own CUDA_VISIBLE_DEVICES (physical ids, not its logical 0..n-1)
    assert engine_devices(1, s, "separate", node_gpus=6, trainer_local_ranks=2, visible="2,3,4,5,6,7") == "6,7"
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.num_engines: engine 1 needs GPUs 6\.\.7 of rank 0's "
                                          r"node, which has 6"):
        engine_devices(1, s, "separate", node_gpus=6, trainer_local_ranks=4)


def test_colocated_engine_shares_its_trainer_ranks_gpus():
    s = VLLMSettings(num_engines=8, tp_size=1, gpus_per_engine=1)
    assert [engine_devices(e, s, "colocated", node_gpus=8, trainer_local_ranks=8) for e in range(8)] == \
        [str(i) for i in range(8)]


class _Exited:
    returncode = 1

    def poll(self):
        return 1


def _start_env(monkeypatch, tmp_path, index, placement, local_world, visible=None):
    d = tmp_path / f"m{index}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 2,
                                               "torch_dtype": "bfloat16"}))
    seen = {}

    def popen(cmd, **kw):
        seen.update(kw["env"])
        return _Exited()

    monkeypatch.setattr(engine_mod.subprocess, "Popen", popen)
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    s = VLLMSettings(num_engines=2, tp_size=2, gpus_per_engine=2, python=sys.executable)
    with pytest.raises(engine_mod.VLLMEngineError, match="exited with code 1"):
        engine_mod.VLLMEngine(str(d), s, device="cuda", placement=placement, index=index,
                              name=f"vllm engine {index}")
    return seen


def test_engine_servers_start_with_their_own_devices(monkeypatch, tmp_path):
    envs = [_start_env(monkeypatch, tmp_path, e, "separate", local_world=4) for e in range(2)]
    assert [e.get("CUDA_VISIBLE_DEVICES") for e in envs] == ["4,5", "6,7"]
    assert not set(envs[0]["CUDA_VISIBLE_DEVICES"].split(",")) & set(envs[1]["CUDA_VISIBLE_DEVICES"].split(","))


def test_factory_passes_the_engine_index(monkeypatch, tmp_path):
    from megatron_s3ac.rollout.engines.pool import EngineSlot
    from megatron_s3ac.rollout.factory import make_engine_factory

    made = {}
    monkeypatch.setattr(engine_mod, "VLLMEngine", lambda *a, **k: made.update(k) or "engine")
    f = make_engine_factory("vllm", model_dir=str(tmp_path), settings=VLLMSettings(num_engines=2))
    assert f(EngineSlot(1, 2)) == "engine" and made["index"] == 1

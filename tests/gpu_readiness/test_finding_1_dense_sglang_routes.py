"""Finding 1 (issue 24): the trainer's SGLang engines ask for routed-expert capture only when R3 replays it.

At 2c164be ``trainer/step/build.py`` never passed ``return_routed_experts`` (factory default True), so every SGLang
engine of a dense model died at construction (``SGLangEngine`` refuses routes without experts) and MoE runs with
``train.r3=off`` paid for a capture they never used. Each case builds the engine exactly as ``Trainer.__init__``
does (``build.build_engine`` from a paper config, one in-process engine), with ``sglang.Engine`` replaced by the
start-up stand-in (megatron_s3ac/rollout/engines/sglang/startup_stand_in.py), and checks what the engine was started with.
"""
import os

import pytest

from megatron_s3ac.rollout import factory
from megatron_s3ac.rollout.engines.sglang.startup_stand_in import StartupEngine
from megatron_s3ac.trainer.step import build as B
from megatron_s3ac.config import load_config, model_info_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAPER = os.path.join(ROOT, "examples", "paper")
HF = os.path.join(ROOT, "examples", "hf_configs")


def _engine(monkeypatch, yaml, hf_dir, *extra):
    monkeypatch.setattr(factory, "SGLANG_ENGINE_CLS", StartupEngine)
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")  # finding 8's variable; not tested here
    hf = os.path.join(HF, hf_dir)
    cfg = load_config(os.path.join(PAPER, yaml), [f"model.hf_config={hf}/config.json", f"model.engine_hf_dir={hf}",
                                                  "rollout.sglang.num_engines=1", *extra], check=False)
    engine, owns_ray = B.build_engine(cfg, model_info_for(cfg))
    assert not owns_ray  # colocated, one engine: in this process
    return engine


@pytest.mark.parametrize("yaml,hf_dir", [("qwen25_math_1p5b_k16.yaml", "qwen2_5_math_1_5b"),
                                         ("qwen25_math_1p5b_k1.yaml", "qwen2_5_math_1_5b"),
                                         ("r1_distill_1p5b_math1460.yaml", "r1_distill_qwen_1_5b")])
def test_dense_paper_configs_start_their_sglang_engine_without_route_capture(monkeypatch, yaml, hf_dir):
    engine = _engine(monkeypatch, yaml, hf_dir)
    assert isinstance(engine.engine, StartupEngine)
    assert engine.engine.server_args["enable_return_routed_experts"] is False
    assert engine.config.enable_return_routed_experts is False


@pytest.mark.parametrize("r3,want", [("off", False), ("auto", True)])
def test_moe_engine_captures_routes_exactly_when_r3_replays_them(monkeypatch, r3, want):
    engine = _engine(monkeypatch, "qwen3_30b_a3b_ep.yaml", "qwen3_30b_a3b", f"train.r3={r3}",
                     "rollout.sglang.tp_size=1", "rollout.sglang.ep_size=1", "rollout.sglang.attn_dp_size=1",
                     "rollout.sglang.gpus_per_engine=1", "rollout.sglang.moe_a2a_backend=none")
    assert engine.engine.server_args["enable_return_routed_experts"] is want

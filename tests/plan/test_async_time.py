"""The planner's sync-vs-async time per step (plan/async_time.py), against hand-derived numbers, and in s3ac-plan."""
import json
import os
from types import SimpleNamespace

import pytest

from megatron_s3ac.plan import constants as C
from megatron_s3ac.plan.async_time import step_times
from megatron_s3ac.plan.memory import Workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _est(placement="separate", capacity=8):
    w = Workload(prompt_len=100, response_len=1000, prompts_per_step=4, k=4)  # 16 sequences of 1100 tokens
    eng = SimpleNamespace(engines=2, tp=2, weights=4e9, kv_per_token=1e5, capacity=capacity)
    return SimpleNamespace(engine=eng, workload=w, knobs=SimpleNamespace(placement=placement), throughput=1100.0,
                           train_gpus=4)


def test_step_times_by_hand():
    bw = C.HBM_TBPS * 1e12 * C.HBM_EFFICIENCY
    st = step_times(_est())
    train = 16 * 1100 / (1100.0 * 4)  # 4 s
    step = (4e9 + 8 * (100 + 500) * 1e5) / bw  # 8 sequences per engine, one wave
    gen = 1000 * step
    sync = 4e9 * 2 / (C.IB_GBPS * 1e9)
    assert st["training_s"] == pytest.approx(train, abs=0.05) and st["generation_s"] == pytest.approx(gen, abs=0.05)
    assert st["sync_step_s"] == pytest.approx(gen + train + sync, abs=0.1)
    assert st["async_step_s"] == pytest.approx(max(gen, train) + sync, abs=0.1) and st["decode_waves"] == 1
    two = step_times(_est(capacity=4))  # 8 sequences, 4 at a time: two waves of 4
    assert two["decode_waves"] == 2
    assert two["generation_s"] == pytest.approx(2 * 1000 * (4e9 + 4 * 600 * 1e5) / bw, abs=0.05)
    assert step_times(_est("colocated")) is None


def test_plan_cli_reports_step_time_for_separate_engines(capsys):
    from megatron_s3ac.plan.cli import run

    hf = os.path.join(ROOT, "examples", "hf_configs", "qwen3_30b_a3b")
    args = [hf, "--gpus", "16", "--prompt-len", "512", "--response-len", "16384", "--prompts-per-step", "64",
            "--k", "8", "--recompute", "full", "--offload-idle", "--json"]
    assert run(args + ["--placement", "separate"]) == 0
    d = json.loads(capsys.readouterr().out)
    st = d["step_time"]
    assert st["async_step_s"] < st["sync_step_s"] and st["async_speedup"] > 1.0
    assert st["sync_step_s"] == pytest.approx(st["generation_s"] + st["training_s"] + st["weight_sync_s"], abs=0.2)
    assert run(args + ["--placement", "colocated"]) == 0
    assert "step_time" not in json.loads(capsys.readouterr().out)

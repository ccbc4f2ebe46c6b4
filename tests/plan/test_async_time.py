"""The planner's sync-vs-async time per step (plan/async_time.py), against hand-derived numbers, and in s3ac-plan."""
import json
import os
from types import SimpleNamespace

import pytest

from megatron_s3ac.models.parallel import ParallelLayout
from megatron_s3ac.models.registry import model_info
from megatron_s3ac.plan import constants as C
from megatron_s3ac.plan.async_time import step_times
from megatron_s3ac.plan.memory import Workload
from megatron_s3ac.plan.weight_sync import weight_sync

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _est(placement="separate", capacity=8):
    w = Workload(prompt_len=100, response_len=1000, prompts_per_step=4, k=4)  # 16 sequences of 1100 tokens
    eng = SimpleNamespace(engines=2, tp=2, ep=2, weights=4e9, kv_per_token=1e5, capacity=capacity)
    knobs = SimpleNamespace(placement=placement, dtype="bf16", sync_bucket_mb=512, sync_fp8=False)
    return SimpleNamespace(engine=eng, workload=w, knobs=knobs, throughput=1100.0, train_gpus=4,
                           layout=ParallelLayout(tp=2, ep=2), cluster=SimpleNamespace(gpus_per_node=8))


def test_step_times_by_hand():
    info = model_info(os.path.join(ROOT, "examples", "hf_configs", "qwen3_30b_a3b"))
    bw = C.HBM_TBPS * 1e12 * C.HBM_EFFICIENCY
    st = step_times(_est(), info)
    train = 16 * 1100 / (1100.0 * 4)  # 4 s
    step = (4e9 + 8 * (100 + 500) * 1e5) / bw  # 8 sequences per engine, one wave
    gen = 1000 * step
    sync = weight_sync(info, ParallelLayout(tp=2, ep=2), 4, 2, engine_ep=2).total_s  # its terms: test_weight_sync
    assert st["weight_sync_s"] == pytest.approx(sync, abs=0.005)
    assert st["training_s"] == pytest.approx(train, abs=0.05) and st["generation_s"] == pytest.approx(gen, abs=0.05)
    assert st["sync_step_s"] == pytest.approx(gen + train + sync, abs=0.1)
    assert st["async_step_s"] == pytest.approx(max(gen, train) + sync, abs=0.1) and st["decode_waves"] == 1
    # overlapped: the sync rides on the trainer's path, hidden while generation is the longer one
    assert st["async_overlapped_step_s"] == pytest.approx(max(gen, train + sync), abs=0.1)
    assert st["weight_sync_exposed_overlapped_s"] == pytest.approx(train + sync - max(gen, train), abs=0.01)
    assert gen < train  # this case: training is the longer side, so the whole sync stays exposed
    two = step_times(_est(capacity=4), info)  # 8 sequences, 4 at a time: two waves of 4
    assert two["decode_waves"] == 2
    assert two["generation_s"] == pytest.approx(2 * 1000 * (4e9 + 4 * 600 * 1e5) / bw, abs=0.05)
    assert step_times(_est("colocated"), info) is None


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
    assert d["weight_sync"]["total_s"] == pytest.approx(st["weight_sync_s"], abs=0.01)
    assert d["weight_sync"]["variant"] == "as_built" and len(d["weight_sync"]["per_stage"]) == d["layout"]["pp"]
    assert run(args + ["--placement", "colocated"]) == 0
    assert "step_time" not in json.loads(capsys.readouterr().out)

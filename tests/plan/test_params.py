"""Parameter counts from the converter plan: totals equal the published ones, shards add up."""
import os

import pytest

from megatron_s3ac.models.parallel import ParallelLayout
from megatron_s3ac.models.registry import model_info
from megatron_s3ac.plan.params import rank_params, stage_layers, total_params

CFG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_configs")


@pytest.mark.parametrize("name,total", [
    # transformers' num_parameters() of the published checkpoints (model cards: 1.54B / 1.78B)
    ("qwen2_5_math_1_5b", 1_543_714_304),
    ("r1_distill_qwen_1_5b", 1_777_088_000),
])
def test_dense_totals_match_published(name, total):
    assert total_params(model_info(os.path.join(CFG, name)))[0] == total


def test_397b_expert_count_closed_form():
    info = model_info(os.path.join(CFG, "qwen3_5_397b_a17b"))
    total, expert = total_params(info)
    assert expert == 60 * 512 * 3 * 4096 * 1024
    assert 395e9 < total < 398e9


def test_shards_add_up_over_the_grid():
    """Summing each rank's share over TP x PP x EP gives the total, replicated tensors counted TP times."""
    info = model_info(os.path.join(CFG, "qwen3_30b_a3b"))
    total, expert = total_params(info)
    lay = ParallelLayout(tp=2, pp=4, ep=8)
    stages = rank_params(info, lay)
    assert sum(s.expert for s in stages) * 8 * 1 == expert  # ETP = 1
    one = rank_params(info, ParallelLayout())[0].dense  # sharded + replicated
    repl = 2 * rank_params(info, ParallelLayout(tp=2))[0].dense - one  # 2 x (sharded / 2 + replicated) - one
    assert repl == 48 * (128 * 2048 + 2 * 2048 + 2 * 128) + 2048  # routers, norms, q/k norms; final norm
    assert sum(s.dense for s in stages) * 2 - repl == total - expert


def test_uneven_stages():
    assert [len(r) for r in stage_layers(60, 4, first=14, last=14)] == [14, 16, 16, 14]
    assert [len(r) for r in stage_layers(48, 4)] == [12] * 4

"""The planner's parameter / gradient / optimizer bytes per rank equal what megatron-core allocates.

Reference: the real actor / critic built with models.actor_critic, wrapped in megatron's DDP and
distributed optimizer by models.optim (as the trainer does), on 4 gloo ranks, after one optimizer step.
Exact for params and both DDP buffers (padding included); the optimizer's states are exact summed over
the (expert-)DP group, and every rank's is at most the planner's per-rank figure (the padded share).
"""
import pytest

from megatron_s3ac.models.parallel import ParallelLayout
from megatron_s3ac.models.registry import model_info
from megatron_s3ac.plan.measure import measure_many
from megatron_s3ac.plan.memory import Knobs, buffer_numel, model_states
from megatron_s3ac.plan.params import rank_params
from megatron_s3ac.models.gloo_ranks import run_distributed

WORLD = 4


def _demo():
    from megatron_s3ac.tasks.arithmetic import tiny_arithmetic_hf_config

    return tiny_arithmetic_hf_config().to_dict()


def _wide_qwen3_5():
    from megatron_s3ac.models.tiny_qwen3_5 import WIDE, tiny_qwen3_5_config

    return tiny_qwen3_5_config("text", **WIDE).to_dict()


DEMO = [  # (model, layout, dtype, critic): the demo model (Qwen3-MoE, 4 experts) at two layouts
    ("demo", dict(tp=2, ep=2), "float32", False),
    ("demo", dict(pp=2, ep=2), "bfloat16", True),
]
WIDE = [  # a wider hybrid model: Qwen3.5-MoE (GDN + gated attention, 8 experts + shared), hidden 128
    ("wide", dict(tp=2, ep=4), "float32", False),
    ("wide", dict(pp=2, ep=2), "bfloat16", True),
]


def _measure(cases):
    hfs = {"demo": _demo(), "wide": _wide_qwen3_5()}
    per_rank = run_distributed(measure_many, WORLD, [(hfs[m], lay, dt, cr) for m, lay, dt, cr in cases], timeout=240)
    return hfs, [[r[i] for r in per_rank] for i in range(len(cases))]


@pytest.fixture(scope="module")
def demo_measured():
    return _measure(DEMO)


@pytest.fixture(scope="module")
def wide_measured():
    return _measure(WIDE)


@pytest.mark.parametrize("idx", range(len(DEMO)))
def test_demo_states_equal_megatron_allocation(demo_measured, idx):
    _check(DEMO[idx], demo_measured[0], demo_measured[1][idx])


@pytest.mark.slow  # four gloo ranks build the hybrid model twice (~1 min on 2 loaded cores)
@pytest.mark.parametrize("idx", range(len(WIDE)))
def test_wide_states_equal_megatron_allocation(wide_measured, idx):
    _check(WIDE[idx], wide_measured[0], wide_measured[1][idx])


def _check(case, hfs, results):
    model, lay_kw, dtype, critic = case
    info = model_info(hfs[model])
    layout = ParallelLayout(**lay_kw)
    knobs = Knobs(dtype={"float32": "fp32", "bfloat16": "bf16"}[dtype])
    stages = rank_params(info, layout, critic=critic)
    dp = WORLD // (layout.tp * layout.pp)
    edp = WORLD // (layout.ep * layout.etp * layout.pp)
    b = 4 if dtype == "float32" else 2
    opt_sum_dense: dict = {}
    opt_sum_expert: dict = {}
    for r in results:
        sp = stages[r["pp_rank"]]
        st = model_states(sp, layout, WORLD, knobs)
        assert (r["dense"], r["expert"]) == (sp.dense, sp.expert), (r, sp)
        dn, en = buffer_numel(sp.dense_numels, dp, sp.shared_embedding), buffer_numel(sp.expert_numels, edp)
        assert r["param_buffer"] == dn * b and r["expert_param_buffer"] == en * b
        assert r["grad_buffer"] == dn * 4 and r["expert_grad_buffer"] == en * 4  # fp32 main grads
        assert r["param_buffer"] + r["expert_param_buffer"] == st.params
        assert r["grad_buffer"] + r["expert_grad_buffer"] == st.grads
        assert r["optimizer"] <= st.optimizer  # the planner's worst-rank (padded) share
        opt_sum_dense.setdefault((r["pp_rank"], r["tp_rank"]), []).append(r)
    # summed over a DP group, the optimizer bytes are exactly dense x bytes/elem (+ experts over EDP)
    ob = st.optimizer_dense_group // max(1, sp.dense)
    total_measured = sum(r["optimizer"] for r in results)
    total_planned = 0
    for r in results:
        sp = stages[r["pp_rank"]]
        total_planned += sp.dense * ob / dp + sp.expert * ob / edp
    assert total_measured == pytest.approx(total_planned, abs=0.5)

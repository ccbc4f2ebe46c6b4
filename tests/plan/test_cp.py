"""The planner at context parallel: per-rank activations and logits divided by CP, the data-parallel
size counted without CP, and the CP communication term of the throughput proxy, against hand-derived
values."""
import os

import pytest

from megatron_s3ac.models.parallel import ParallelLayout
from megatron_s3ac.models.registry import model_info
from megatron_s3ac.plan import constants as C
from megatron_s3ac.plan.memory import Cluster, Knobs, Workload, cp_comm_bytes, estimate, layer_kinds

CFG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_configs")


def test_activations_and_logits_divide_by_cp():
    info = model_info(os.path.join(CFG, "qwen3_30b_a3b"))
    w = Workload(prompt_len=2048, response_len=30720, micro_batch_size=1)
    cl = Cluster(gpus=32)
    e1 = estimate(info, ParallelLayout(tp=2, ep=8, etp=1), cl, w, Knobs())
    e2 = estimate(info, ParallelLayout(tp=2, cp=2, ep=8, etp=1), cl, w, Knobs())
    s1, s2 = e1.stages[0], e2.stages[0]
    assert e1.tokens_per_micro == e2.tokens_per_micro == w.seq_len  # a micro-batch is one sequence either way
    assert s2.act_actor == pytest.approx(s1.act_actor / 2)  # GPU backend: TE's ring keeps no remote K / V
    assert s2.logits_train == pytest.approx(s1.logits_train / 2)
    assert s2.actor.gpu == pytest.approx(s1.actor.gpu)  # states shard over DP x CP: unchanged
    assert e2.n_micro == 2 * e1.n_micro  # half the DP ranks: twice the rows each


def test_cp_comm_bytes_hand_derived():
    info = model_info(os.path.join(CFG, "qwen3_30b_a3b"))
    lay = ParallelLayout(tp=2, cp=4, ep=8, etp=1)
    # every layer is attention: (cp - 1) remote K / V of kv_heads / tp heads per token, 2/3 of token-passes
    per_tok = info.num_layers * 3 * 2 * info.num_kv_heads * info.head_dim / 2
    assert cp_comm_bytes(info, lay, 3000.0, 2) == pytest.approx(per_tok * 2 * 3000 * 2 / 3)
    q = model_info(os.path.join(CFG, "qwen3_5_397b_a17b"))
    kinds = layer_kinds(q)
    n_gdn = sum(m == "gdn" for m, _ in kinds)
    lay = ParallelLayout(tp=2, cp=8)
    # GDN: in_proj output (2 qk + 2 v + 2 nv) and core output v, (cp-1)/cp of it, over TP
    gdn_tok = (2 * 16 * 128 + 3 * 64 * 128 + 2 * 64) / 2 * 7 / 8
    attn_tok = 7 * 2 * 2 * 256 / 2
    expect = (n_gdn * gdn_tok + (len(kinds) - n_gdn) * attn_tok) * 2 * 300.0 * 2 / 3
    assert cp_comm_bytes(q, lay, 300.0, 2) == pytest.approx(expect)
    assert C.MAX_CP >= 8

"""The planner's weight-sync time (plan/weight_sync.py): each term against numbers derived by hand from the model's
closed-form sizes and the cited link rates, the bucket rule against the export's own, and the docs' tables."""
import os
import re

import pytest

from megatron_s3ac.models.parallel import ParallelLayout
from megatron_s3ac.models.registry import model_info
from megatron_s3ac.plan import constants as C
from megatron_s3ac.plan.weight_sync import LADDER, Links, Variant, stage_buckets, weight_sync

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = os.path.join(ROOT, "examples", "hf_configs")
NIC = 50e9 * 0.8  # ConnectX-7 400 Gb/s, 0.8 achieved
NVL = 450e9 * 0.8  # H100 NVLink 900 GB/s both ways, 0.8 achieved
HBM = 4.8e12 * 0.5
ONE_BUCKET = 1 << 42  # every stage's tensors in one bucket: one RPC pair, sums by hand

# Qwen3-30B-A3B closed form (examples/hf_configs/qwen3_30b_a3b): 48 layers, 128 experts of 3 x 2048 x 768
TOTAL_30B, EXPERT_30B = 30_532_122_624, 48 * 128 * 3 * 2048 * 768
REPL_30B = 48 * (128 * 2048 + 2 * 2048 + 2 * 128) + 2048  # routers, norms, q/k norms; final norm (test_params)
TENSORS_30B = 48 * (128 * 3 + 9) + 3  # experts; q/k/v/o, q/k norms, 2 norms, router; embed, norm, lm_head


@pytest.fixture(scope="module")
def q30():
    return model_info(os.path.join(CFG, "qwen3_30b_a3b"))


def test_constants_are_the_cited_rates():
    assert C.NVLINK_PEAK_GBPS == 450.0 and C.NIC_PEAK_GBPS == 50.0 and C.NICS_PER_NODE == 8
    assert C.NVLINK_EFFICIENCY == 0.8 and C.NIC_EFFICIENCY == 0.8


def test_one_stage_terms_by_hand(q30):
    """tp2 ep8 on 16 GPUs, 4 GPUs per node: the leader's TP peer and 3 expert owners share its node, 4 do not."""
    ws = weight_sync(q30, ParallelLayout(tp=2, ep=8), 16, engine_tp=2, gpus_per_node=4, bucket_bytes=ONE_BUCKET)
    (st,) = ws.stages
    b, e = 2 * TOTAL_30B, 2 * EXPERT_30B
    dense = b - e - 2 * REPL_30B  # TP-split bytes
    assert st.bytes == b and st.buckets == 1 and st.tensors == TENSORS_30B
    assert st.gather_nvlink_bytes == pytest.approx(dense / 2 + e * 3 / 8)
    assert st.gather_ib_bytes == pytest.approx(e * 4 / 8)
    gather = max((dense / 2 + e * 3 / 8) / NVL, e / 2 / NIC)  # IB-bound: 29 GB through one NIC
    bcast = b / NIC  # one sender GPU, one NIC
    load = 2 * ((b - e) / 2 + e / 2) / HBM + TENSORS_30B * 20e-6  # each engine rank copies its half
    rpc = 2 * 0.002
    assert st.gather_s == pytest.approx(gather) and st.broadcast_s == pytest.approx(bcast)
    assert st.load_s == pytest.approx(load) and st.rpc_s == pytest.approx(rpc)
    assert ws.total_s == pytest.approx(gather + bcast + load + rpc)
    over = weight_sync(q30, ParallelLayout(tp=2, ep=8), 16, engine_tp=2, gpus_per_node=4, bucket_bytes=ONE_BUCKET,
                       variant=Variant(overlap_gather=True))
    assert over.total_s == pytest.approx(max(gather, bcast + load + rpc))


def test_same_node_gather_is_nvlink_only(q30):
    ws = weight_sync(q30, ParallelLayout(tp=2, ep=8), 16, engine_tp=2, gpus_per_node=8, bucket_bytes=ONE_BUCKET)
    (st,) = ws.stages
    e = 2 * EXPERT_30B
    dense = 2 * TOTAL_30B - e - 2 * REPL_30B
    assert st.gather_ib_bytes == 0 and st.gather_nvlink_bytes == pytest.approx(dense / 2 + e * 7 / 8)
    assert st.gather_s == pytest.approx((dense / 2 + e * 7 / 8) / NVL)


def test_stages_add_in_turn_and_share_engine_nics_in_parallel(q30):
    """pp2 (24 + 24 layers): serial = the two stages' sums; in parallel the max, or every byte over one engine
    node's 8 NICs when that is longer; owners sending + the trainer cutting a 2-node engine's shards halve it."""
    lay = ParallelLayout(tp=1, pp=2, ep=8)
    serial = weight_sync(q30, lay, 16, engine_tp=8, bucket_bytes=ONE_BUCKET)
    s0, s1 = serial.stages
    assert s0.bytes + s1.bytes == 2 * TOTAL_30B
    assert s0.layers == range(0, 24) and s1.layers == range(24, 48)
    assert serial.total_s == pytest.approx(s0.total_s + s1.total_s)
    par = weight_sync(q30, lay, 16, engine_tp=8, bucket_bytes=ONE_BUCKET, variant=Variant(stages_parallel=True))
    assert par.total_s == pytest.approx(max(s0.total_s, s1.total_s))
    # links without engine-side costs, so the transfer bounds show: every byte into each engine node, 0.19 s
    wire = Links(hbm=float("inf"), rpc_s=0.0, load_s_per_tensor=0.0)
    owners = weight_sync(q30, lay, 16, engine_tp=8, bucket_bytes=ONE_BUCKET, links=wire,
                         variant=Variant(stages_parallel=True, owners_send=True))
    ingress = 8 * NIC
    assert owners.stages[0].gather_s == 0
    assert owners.total_s == pytest.approx(2 * TOTAL_30B / ingress)  # 61 GB into every engine node
    reshard = weight_sync(q30, lay, 16, engine_tp=16, bucket_bytes=ONE_BUCKET, links=wire,
                          variant=Variant(stages_parallel=True, owners_send=True, trainer_reshard=True))
    # each of the 2 nodes takes half (0.095 s); now the busiest owner binds: the last stage's lm_head, 24 layers of
    # attention, their replicated tensors and the final norm, plus 1/8 of its 24 layers' experts
    owner = 2 * (151936 * 2048 + 24 * (2 * 4096 * 2048 + 2 * 512 * 2048) + 24 * (128 * 2048 + 2 * 2048 + 2 * 128)
                 + 2048) + 2 * EXPERT_30B / 2 / 8
    assert TOTAL_30B / ingress < owner / NIC
    assert reshard.total_s == pytest.approx(owner / NIC)


def test_fp8_wire_bytes_by_hand(q30):
    """Every expert matrix goes as e4m3 bytes + fp32 scales of 128 x 128 blocks (768 x 2048: 6 x 16 blocks)."""
    (_, buckets), = stage_buckets(q30, ParallelLayout(tp=1, ep=8), 8, 8, ONE_BUCKET, fp8=True)
    per_tensor = 768 * 2048 + 4 * 6 * 16
    assert sum(b.expert for b in buckets) == 48 * 128 * 3 * per_tensor


def test_bucket_rule_is_the_exports(q30):
    """The greedy rule and order match convert.export._buckets on the plan's HF tensors (one stage, 512 MiB)."""
    from megatron_s3ac.convert.export import _buckets
    from megatron_s3ac.convert.plan import build_plan

    plan = build_plan(q30)
    names = list(plan.hf_shapes)
    want = _buckets(plan, names, {n: 2 for n in names}, 512 << 20)
    (_, got), = stage_buckets(q30, ParallelLayout(tp=2, ep=8), 16, 8, 512 << 20)
    assert [b.tensors for b in got] == [len(x) for x in want]


# ---- the docs' tables (docs/planner.md "Weight-sync time") --------------------------------------------
DOC_ROWS = {  # (model, actor layout, trainer GPUs, engine TP) -> total seconds of each LADDER variant
    ("qwen3_5_397b_a17b", (2, 4, 32, None, None), 128, 8): (35.19, 8.83, 5.19, 2.48, 2.48, 1.25),
    ("qwen3_5_397b_a17b", (8, 8, 32, 9, 9), 256, 16): (35.18, 5.32, 3.13, 2.48, 1.24, 0.62),
    ("qwen3_30b_a3b", (2, 1, 8, None, None), 16, 2): (2.53, 2.53, 2.39, 1.08, 1.08, 0.96),
    ("qwen3_30b_a3b", (1, 2, 8, None, None), 16, 8): (2.51, 1.25, 1.18, 0.55, 0.55, 0.49),
}


@pytest.mark.parametrize("row", list(DOC_ROWS))
def test_docs_table(row):
    name, (tp, pp, ep, first, last), gpus, etp = row
    info = model_info(os.path.join(CFG, name))
    lay = ParallelLayout(tp=tp, pp=pp, ep=ep, first_stage_layers=first, last_stage_layers=last)
    got = tuple(round(weight_sync(info, lay, gpus, etp, variant=v).total_s, 2) for v in LADDER)
    assert got == pytest.approx(DOC_ROWS[row], abs=0.006)
    with open(os.path.join(ROOT, "docs", "planner.md")) as f:
        doc = f.read()
    section = doc[doc.index("## Weight-sync time"):]
    section = section[:section.index("\n## ", 5)]
    line = next(ln for ln in section.splitlines() if ln.startswith("|") and f"TP{tp} PP{pp} EP{ep}" in ln
                and name.split("_a")[0].replace("_", "") in re.sub(r"[^a-z0-9]", "", ln.lower()))
    for x in DOC_ROWS[row]:
        assert f"{x:.2f}" in line, (line, x)

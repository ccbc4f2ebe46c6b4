"""Critic values / actor log-prob loss and all gradients at TP2, EP2, PP2 (boundary inside a layer
group) equal the single-rank run (same harness as tests/models/test_parallel_equivalence.py)."""
import pytest

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.models.tiny_qwen3_5 import tiny_qwen3_5_config
from tests.models.test_parallel_equivalence import check_layout, read_ckpt, run_layout

LAYOUTS = {"tp2": (2, dict(tp=2)), "ep2": (2, dict(ep=2)), "pp2_first6": (2, dict(pp=2, first_stage_layers=6))}
CASES = [("critic", "tp2"), ("critic", "ep2"), ("critic", "pp2_first6"),
         pytest.param("actor", "tp2", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    from megatron_s3ac.models.parallel import ParallelLayout

    cache = {}

    def get(role):
        if role not in cache:
            d = tmp_path_factory.mktemp(f"q35_{role}")
            cfg = tiny_qwen3_5_config("vl").to_dict()
            out = run_distributed(run_layout, 1, cfg, role, ParallelLayout(), str(d / "w"), str(d / "g"), True)[0]
            grads = run_distributed(read_ckpt, 1, cfg, role, ParallelLayout(), str(d / "g"))[0]
            cache[role] = (cfg, d, out, grads)
        return cache[role]

    return get


@pytest.mark.parametrize("role,layout_name", CASES)
def test_layout_matches_single_rank(refs, role, layout_name, tmp_path):
    from megatron_s3ac.models.parallel import ParallelLayout

    cfg, d, ref_out, ref_grads = refs(role)
    world, kw = LAYOUTS[layout_name]
    check_layout(cfg, role, ParallelLayout(**kw), world, d, tmp_path, ref_out, ref_grads, f"{role} {layout_name}")
    gdn = [k for k in ref_grads if "A_log" in k or "conv1d" in k or "out_norm" in k]
    assert gdn and all(ref_grads[k].abs().sum() > 0 for k in gdn)  # GDN parameters get gradients

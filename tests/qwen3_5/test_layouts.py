"""Critic values / actor log-prob loss and all gradients at TP2, EP2, PP2 (boundary inside a layer
group) equal the single-rank run (same harness as tests/models/test_parallel_equivalence.py)."""
import pytest
import torch

from megatron_s3ac.testing.dist import run_distributed
from megatron_s3ac.testing.tiny_qwen3_5 import tiny_qwen3_5_config
from tests.models.test_parallel_equivalence import read_ckpt, run_layout

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
    outs = run_distributed(run_layout, world, cfg, role, ParallelLayout(**kw), str(d / "w"), str(tmp_path / "g"), False)
    outs = [o for o in outs if o is not None]
    assert outs
    for o in outs:
        print(f"{role} {layout_name}: max |out diff| = {(o - ref_out).abs().max().item():.3e}")
        torch.testing.assert_close(o, ref_out, atol=1e-5, rtol=0)
    grads = run_distributed(read_ckpt, 1, cfg, role, ParallelLayout(), str(tmp_path / "g"))[0]
    assert grads.keys() == ref_grads.keys()
    nonzero = 0
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], atol=2e-5, rtol=1e-4, msg=lambda m: f"{k}: {m}")
        nonzero += int(ref_grads[k].abs().sum() > 0)
    assert nonzero > len(ref_grads) // 2
    gdn = [k for k in ref_grads if "A_log" in k or "conv1d" in k or "out_norm" in k]
    assert gdn and all(ref_grads[k].abs().sum() > 0 for k in gdn)  # GDN parameters get gradients

"""Megatron (loaded from the converted checkpoint) vs transformers' qwen3_5_moe, fp32, at TP1 / TP2 /
EP2 / PP2 with the stage boundary inside a 3 GDN + 1 attention group; packed masks refused."""
import pytest
import torch

from megatron_s3ac.models.parallel import ParallelLayout

LAYOUTS = {
    "tp1": ParallelLayout(),
    "tp2": ParallelLayout(tp=2),
    "ep2": ParallelLayout(ep=2),
    "pp2_first2": ParallelLayout(pp=2, first_stage_layers=2),  # stages: layers 0-1 | 2-7 (GDN 2, attn 3 on stage 1)
}
CASES = [("vl", "tp1"), ("text", "tp1"), ("vl", "tp2"), ("vl", "ep2"), ("vl", "pp2_first2")]


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def hf_ref(q35_hf, tokens):
    from megatron_s3ac.convert.verify import hf_logits

    return {n: hf_logits(d, tokens) for n, d in q35_hf.items()}


@pytest.mark.parametrize("name,layout", CASES)
def test_logits_match_transformers(q35_hf, q35_mcore, hf_ref, tokens, name, layout):
    from megatron_s3ac.convert.verify import megatron_logits
    from megatron_s3ac.models.registry import load_hf_config

    got = megatron_logits(load_hf_config(q35_hf[name]), q35_mcore[name], tokens, LAYOUTS[layout])[..., :96]
    ref = hf_ref[name]
    diff = (got - ref).abs().max().item()
    print(f"{name} {layout}: max |logit diff| = {diff:.3e}")
    assert diff < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_packed_mask_is_refused(q35_hf):
    from megatron_s3ac.models.registry import load_hf_config
    from megatron_s3ac.models.gloo_ranks import run_distributed
    from tests.qwen3_5.ranks import packed_mask_refused

    (msg,) = run_distributed(packed_mask_refused, 1, load_hf_config(q35_hf["vl"]))
    assert msg is not None and "packed" in msg

"""Live export (rollout weight sync) equals the HF checkpoint at any layout; training checkpoints convert."""
import os

import torch

from megatron_s3ac.convert import mcore_to_hf
from megatron_s3ac.models.gloo_ranks import run_distributed
from tests.convert.ranks import export_at
from tests.convert.test_roundtrip import assert_same_tensors, read_hf


def test_export_tp2_ep2_equals_tp1_and_training_checkpoint_converts(hf_dirs, mcore_dirs, tmp_path):
    hf, train = hf_dirs["qwen3_moe"], str(tmp_path / "train_tp2ep2")
    # 4 ranks: TP2 x EP2 (ETP 1, DP 2); also saves the loaded actor like training does
    res = run_distributed(export_at, 4, hf, mcore_dirs["qwen3_moe"], 2, 1, 2, train)
    (full, nb), others = res[0], res[1:]
    assert all(o == {} and n == nb for o, n in others) and nb > 1  # lockstep buckets, leader yields
    ref = read_hf(hf)
    assert_same_tensors(ref, full)
    (tp1, _), = run_distributed(export_at, 1, hf, train, 1, 1, 1)  # the TP2xEP2 save, loaded at TP1
    assert_same_tensors(full, tp1)
    out = str(tmp_path / "hf_from_training")
    mcore_to_hf(train, out, hf_config=hf, progress=False)
    assert_same_tensors(ref, read_hf(out))
    assert os.path.exists(os.path.join(out, "generation_config.json"))


def test_export_pp2_each_stage_emits_its_layers(hf_dirs, mcore_dirs):
    hf = hf_dirs["qwen2_tied"]
    (first, _), (last, _) = run_distributed(export_at, 2, hf, mcore_dirs["qwen2_tied"], 1, 2, 1)
    assert "model.embed_tokens.weight" in first and "model.layers.1.mlp.up_proj.weight" in first
    assert "model.norm.weight" in last and "model.layers.3.self_attn.q_proj.bias" in last
    assert not set(first) & set(last)
    assert "lm_head.weight" not in last  # tied
    assert_same_tensors(read_hf(hf), {**first, **last})


def test_export_tp2_dense(hf_dirs, mcore_dirs):
    hf = hf_dirs["qwen3"]
    full, _ = run_distributed(export_at, 2, hf, mcore_dirs["qwen3"], 2, 1, 1)[0]
    assert_same_tensors(read_hf(hf), full)
    assert all(t.dtype == torch.float32 for t in full.values())

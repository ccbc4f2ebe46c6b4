"""The engine's HF-name map (cpu_engine._WeightMap) built by the fast meta-view pass equals the one
built entirely from index tensors (the exact, slow method), for dense, MoE (fused experts in
transformers 5) and tied models; and an update through it lands every element where transformers'
own loader puts it (state dict round trip)."""
import pytest
import torch

from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine, _WeightMap
from megatron_s3ac.models.tiny_models import tiny_hf_model


def _positions(wm, name):
    owner, where, shape = wm.parts[name]
    n = 1
    for d in shape:
        n *= d
    idx = torch.arange(where.start, where.stop) if isinstance(where, slice) else where.cpu()
    assert idx.numel() == n
    return owner, idx, shape


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "qwen2"])
def test_view_pass_equals_index_pass(model_type):
    model = tiny_hf_model(model_type)
    fast = _WeightMap(model)
    slow = _WeightMap.__new__(_WeightMap)
    slow.params, slow.canonical, slow.parts = fast.params, fast.canonical, {}
    slow._map_indices(model, {n for n in fast.params if fast.canonical[n] == n})
    assert fast.parts.keys() == slow.parts.keys()
    for name in slow.parts:
        fo, fi, fs = _positions(fast, name)
        so, si, ss = _positions(slow, name)
        assert (fo, fs) == (so, ss) and torch.equal(fi, si), name
    if model_type == "qwen3_moe":  # the fused experts needed no index pass: all of them are views
        assert any(".experts." in n and isinstance(fast.parts[n][1], slice) for n in fast.parts)


def test_update_from_checkpoint_names_restores_model():
    from transformers.core_model_loading import revert_weight_conversion

    src = tiny_hf_model("qwen3_moe", seed=1)
    ckpt = {k: v.detach().clone() for k, v in revert_weight_conversion(src, dict(src.state_dict())).items()}
    engine = CPUEngine(tiny_hf_model("qwen3_moe", seed=2), device="cpu")
    engine.update_weights(ckpt.items())
    for (n, p), (n2, q) in zip(src.named_parameters(), engine.model.named_parameters()):
        assert n == n2 and torch.equal(p, q), n

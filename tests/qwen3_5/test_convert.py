"""Converter for qwen3_5_moe: plan == megatron's checkpoint keys, HF -> mcore -> HF bit-exact (fused and
per-expert HF experts), vision/MTP tensors carried as is (tests/qwen3_5/test_vl_checkpoint.py has the
complete VL round trip through training checkpoints), live export at TP2 / EP2 equals the HF tensors."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_s3ac.convert import build_plan, hf_to_mcore, mcore_to_hf
from megatron_s3ac.models.registry import model_info
from megatron_s3ac.models.gloo_ranks import run_distributed


def _tensors(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def test_plan_matches_megatron_sharded_state_dict(q35_hf):
    from tests.convert.ranks import megatron_keys

    names = list(q35_hf)
    (per_model,) = run_distributed(megatron_keys, 1, [q35_hf[n] for n in names])
    for name, (tensors, objects) in zip(names, per_model):
        plan = build_plan(model_info(q35_hf[name]))
        assert plan.tensor_keys() == tensors, name
        assert set(plan.objects) == objects, name


def test_gated_qkv_interleave_and_gdn_slices(q35_hf):
    plan = build_plan(model_info(q35_hf["vl"]))  # 4 heads, 2 kv groups, head_dim 16; GDN qk=16, v=32
    qkv = next(c for c in plan.chunks if c.key == "decoder.layers.3.self_attention.linear_qkv.weight")
    got = [(p.hf.split(".")[-2], p.start, p.stop) for p in qkv.parts]
    # per group: q of its 2 heads, then their gates (HF q_proj rows per head: [q (16); gate (16)]), k, v
    assert got == [("q_proj", 0, 16), ("q_proj", 32, 48), ("q_proj", 16, 32), ("q_proj", 48, 64),
                   ("k_proj", 0, 16), ("v_proj", 0, 16),
                   ("q_proj", 64, 80), ("q_proj", 96, 112), ("q_proj", 80, 96), ("q_proj", 112, 128),
                   ("k_proj", 16, 32), ("v_proj", 16, 32)]
    rows = {c.key.rsplit(".", 1)[-1]: (c.parts[0].start, c.parts[0].stop) for c in plan.chunks
            if c.key.startswith("decoder.layers.0.self_attention.in_proj.weight.")}
    assert rows == {"query": (0, 16), "key": (16, 32), "value": (32, 64), "z": (0, 32), "beta": (0, 4),
                    "alpha": (0, 4)}


@pytest.mark.parametrize("name", ["vl", "text"])
def test_roundtrip_bit_exact(q35_hf, q35_mcore, name, tmp_path):
    out = str(tmp_path / "hf")
    mcore_to_hf(q35_mcore[name], out, progress=False)
    src, back = _tensors(q35_hf[name]), _tensors(out)
    assert any(k.startswith("model.visual.") for k in src) == (name == "vl")  # carried, not dropped
    assert back.keys() == src.keys()
    for k in src:
        assert back[k].dtype == src[k].dtype and torch.equal(back[k], src[k]), k
    # and the written checkpoint converts again to the same torch_dist bytes
    again = str(tmp_path / "mcore2")
    hf_to_mcore(out, again, progress=False)
    out2 = str(tmp_path / "hf2")
    mcore_to_hf(again, out2, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(out2).values(), back.values()))


def test_vision_and_mtp_tensors_are_carried(q35_hf, tmp_path):
    import shutil

    d = str(tmp_path / "with_mtp")
    shutil.copytree(q35_hf["vl"], d)
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):  # an index would hide the added shard
        os.remove(index)
    mtp = {"mtp.fc.weight": torch.randn(64, 128), "mtp.layers.0.mlp.gate.weight": torch.randn(8, 64).bfloat16()}
    save_file(mtp, os.path.join(d, "mtp.safetensors"))
    hf_to_mcore(d, str(tmp_path / "m"), progress=False)
    mcore_to_hf(str(tmp_path / "m"), str(tmp_path / "back"), progress=False)
    back = _tensors(str(tmp_path / "back"))
    for k, v in {**_tensors(q35_hf["vl"]), **mtp}.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    # carried tensors are never part of the plan the live export (weight sync) walks
    plan = build_plan(model_info(d))
    assert not any(n.startswith(("model.visual.", "mtp.")) for n in plan.hf_shapes)
    assert all(n in plan.ignorable_hf for n in back if n.startswith(("model.visual.", "mtp.")))
    # an unknown LM tensor is still an error
    save_file({"model.language_model.layers.0.extra.weight": torch.zeros(2)}, os.path.join(d, "x.safetensors"))
    from megatron_s3ac.convert import ConversionError

    with pytest.raises(ConversionError, match="extra.weight"):
        hf_to_mcore(d, str(tmp_path / "m2"), progress=False)


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 1), (1, 1, 2)])
def test_live_export_matches_hf(q35_hf, q35_mcore, tp, pp, ep):
    from tests.convert.ranks import export_at

    outs = run_distributed(export_at, tp * pp * ep, q35_hf["vl"], q35_mcore["vl"], tp, pp, ep)
    got = {}
    for o, _ in outs:
        got.update(o)
    src = {k: v for k, v in _tensors(q35_hf["vl"]).items() if not k.startswith("model.visual.")}
    assert got.keys() == src.keys()
    for k in src:
        assert torch.equal(got[k], src[k]), k


def test_expert_layout_read_from_tensor_names(q35_hf, tmp_path):
    """A per-expert checkpoint whose config.json does not say so (as transformers saves it) converts
    both ways: the layout comes from the tensor names when the config is read from the directory."""
    import json
    import shutil

    from megatron_s3ac.models.qwen3_5 import EXPERT_LAYOUT_KEY
    from megatron_s3ac.models.registry import load_hf_config

    src = str(tmp_path / "plain")
    shutil.copytree(q35_hf["text"], src)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    assert cfg.pop(EXPERT_LAYOUT_KEY) == "per_expert"
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert load_hf_config(src)[EXPERT_LAYOUT_KEY] == "per_expert"
    assert EXPERT_LAYOUT_KEY not in load_hf_config(q35_hf["vl"])  # fused: nothing added
    hf_to_mcore(src, str(tmp_path / "mcore"), progress=False)
    mcore_to_hf(str(tmp_path / "mcore"), str(tmp_path / "back"), hf_config=src, progress=False)
    a, b = _tensors(src), _tensors(str(tmp_path / "back"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

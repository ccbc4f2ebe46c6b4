"""The plan's checkpoint keys and global shapes are exactly those megatron's actor requests."""
from megatron_s3ac.convert import build_plan
from megatron_s3ac.models.registry import model_info
from megatron_s3ac.models.gloo_ranks import run_distributed
from tests.convert.ranks import megatron_keys


def test_plan_matches_megatron_sharded_state_dict(hf_dirs):
    names = list(hf_dirs)
    (per_model,) = run_distributed(megatron_keys, 1, [hf_dirs[n] for n in names])
    for name, (tensors, objects) in zip(names, per_model):
        plan = build_plan(model_info(hf_dirs[name]))
        planned = plan.tensor_keys()
        aliases = {a for ch in plan.chunks for a in ch.aliases}
        assert {k: v for k, v in planned.items() if k not in aliases} == tensors, name
        assert set(plan.objects) == objects, name


def test_qkv_interleave_per_query_group(hf_dirs):
    plan = build_plan(model_info(hf_dirs["qwen3"]))  # 4 heads, 2 kv groups, head_dim 16
    qkv = next(c for c in plan.chunks if c.key == "decoder.layers.self_attention.linear_qkv.weight")
    got = [(p.hf.split(".")[-2], p.start, p.stop) for p in qkv.parts]
    assert got == [("q_proj", 0, 32), ("k_proj", 0, 16), ("v_proj", 0, 16),
                   ("q_proj", 32, 64), ("k_proj", 16, 32), ("v_proj", 16, 32)]

"""The planner for a vision-language model: the vision tower's parameters (hand-derived for the tiny tower, and
against transformers' module), its states (frozen: weights only; trainable: + fp32 grads + DP-sharded optimizer),
on the first pipeline stage of actor and critic and in the engine's weights, and image tokens in the activations
and the engine's KV, against hand-derived values."""
import copy
import json

import pytest

from megatron_s3ac.models.parallel import ParallelLayout
from megatron_s3ac.models.registry import model_info
from megatron_s3ac.plan.memory import Cluster, Knobs, Workload, estimate
from megatron_s3ac.plan.params import vision_params
from megatron_s3ac.models.tiny_qwen3_5 import tiny_qwen3_5_config, tiny_qwen3_5_model


def _cfg():
    return json.loads(tiny_qwen3_5_config("vl").to_json_string())


def test_vision_params_hand_derived():
    # tiny tower: h=16, I=32, depth 1, patch 2, temporal 1, merge 1, 16 positions, out 64, 3 channels
    patch = 16 * 3 * 1 * 2 * 2 + 16  # Conv3d weight + bias
    pos = 16 * 16
    block = 2 * 32 + (48 * 16 + 48) + (16 * 16 + 16) + (32 * 16 + 32) + (16 * 32 + 16)
    merger = 32 + (16 * 16 + 16) + (64 * 16 + 64)
    assert vision_params(_cfg()) == patch + pos + block + merger == 4080
    model = tiny_qwen3_5_model("vl")
    assert vision_params(_cfg()) == sum(p.numel() for p in model.model.visual.parameters())
    text = _cfg()
    del text["vision_config"]
    assert vision_params(text) == 0


@pytest.mark.parametrize("trainable", [False, True])
def test_vision_states_and_image_tokens(trainable):
    vl = model_info(_cfg())
    text_cfg = _cfg()
    text_cfg["vision_config"] = {}
    text = model_info(text_cfg)
    layout, cl = ParallelLayout(tp=1, pp=1, ep=1), Cluster(gpus=2, gpu_mem_gib=80)
    w = Workload(prompt_len=64, response_len=128, prompts_per_step=4, k=2, micro_batch_size=1)
    knobs = Knobs(dtype="bf16", vision_trainable=trainable, placement="colocated", engine_tp=1)
    a, b = estimate(vl, layout, cl, w, knobs), estimate(text, layout, cl, w, knobs)
    n, dp = 4080, 2
    for which in ("actor", "critic"):
        sa, sb = getattr(a.stages[0], which), getattr(b.stages[0], which)
        assert sa.params - sb.params == n * 2  # bf16 weights on every rank
        trains = trainable and which == "actor"  # the critic's tower is always frozen
        assert sa.grads - sb.grads == (n * 4 if trains else 0)
        assert sa.optimizer - sb.optimizer == (-(-n // dp) * (4 + 8) if trains else 0)  # fp32 main + 2 moments
    assert a.engine.weights - b.engine.weights == pytest.approx(n * 2)
    # image tokens: N more tokens per sequence in the activations (micro-batch = one sequence) and the engine's KV
    wi = copy.replace(w, image_tokens=32) if hasattr(copy, "replace") else Workload(**{**w.__dict__, "image_tokens": 32})
    c = estimate(vl, layout, cl, wi, knobs)
    assert wi.seq_len == 64 + 32 + 128 and c.tokens_per_micro == wi.seq_len
    # + the tower's own saved activations when it trains: 32 image tokens = 32 patches (merge 1), bf16 on GPU
    tower = 32 * (1 * (2 * (11 * 16 + 2 * 32) + 4 * 2 + 2 * 2 * 4) + (12 * 2 + 32 + 16 + 2 * 8 * 4 + 4 * 16 * 2 + 2 * 4))
    assert c.stages[0].act_actor == pytest.approx(a.stages[0].act_actor * wi.seq_len / w.seq_len
                                                  + (tower if trainable else 0))
    assert c.stages[0].act_critic == pytest.approx(a.stages[0].act_critic * wi.seq_len / w.seq_len)
    assert c.engine.kv_per_token == a.engine.kv_per_token
    per_seq = lambda e, L: L * e.kv_per_token + e.state_per_seq
    assert per_seq(c.engine, wi.seq_len) - per_seq(a.engine, w.seq_len) == pytest.approx(32 * a.engine.kv_per_token)


def test_cli_flag(capsys):
    from megatron_s3ac.plan.cli import run

    import os
    import tempfile
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(_cfg(), f)
    assert run([d, "--gpus", "2", "--image-tokens", "256", "--tp", "1", "--pp", "1", "--ep", "1", "--json"]) == 0
    text = _cfg()
    del text["vision_config"]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(text, f)
    from megatron_s3ac.plan.cli import PlanInputError
    with pytest.raises((PlanInputError, SystemExit)):
        run([d, "--gpus", "2", "--image-tokens", "256", "--tp", "1", "--pp", "1", "--ep", "1"])


# ---- the vision tower's own activations ----------------------------------------------------------------------
def _by_hand(h, inter, nh, depth, c, t, p, b, stat):
    """Bytes per patch, written out: per block 4h (LayerNorm in / out x 2) + 3h (qkv) + 2h (rotary q, k) + 2h
    (attention output, proj input) + 2I (fc1, GELU) in the dtype, lse (fp32 per head), 2 x (mean, rstd); once: the
    patch embedding's input, 4 int64 + 4 fp32 interpolation entries, fp32 cos / sin, the merger's 4h + its stats."""
    block = (4 * h + 3 * h + 2 * h + 2 * h + 2 * inter) * b + 4 * nh + 2 * 2 * stat
    return depth * block + c * t * p * p * b + (4 * 8 + 4 * 4) + 2 * (h // nh) * 4 + 4 * h * b + 2 * stat, block


def test_vision_activation_formula_hand_derived():
    from megatron_s3ac.plan.memory import vision_activation

    # tiny tower (h 16, I 32, 2 heads, depth 1, 3 x 1 x 2 x 2 patches, merge 1), fp32 on CPU
    va = vision_activation(_cfg(), Knobs(dtype="fp32", backend="cpu"))
    assert (va.saved, va.block, va.patches_per_token) == (1408, 984, 1)
    assert _by_hand(16, 32, 2, 1, 3, 1, 2, 4, 4) == (1408, 984)
    # Qwen3.5's default tower (transformers' Qwen3_5MoeVisionConfig: h 1152, I 4304, 16 heads, depth 27, 3 x 2 x 16
    # x 16 patches, merge 2), bf16 on GPU: 1,164,200 bytes per patch, 4 patches per image token
    hf = {"model_type": "qwen3_5_moe", "vision_config": {"model_type": "qwen3_5_moe"}, "text_config": {"hidden_size": 2048}}
    va = vision_activation(hf, Knobs(dtype="bf16"))
    block = (11 * 1152 + 2 * 4304) * 2 + 4 * 16 + 2 * 2 * 4
    assert block == 42640 and va.block == block
    assert va.saved == 27 * block + (3 * 2 * 16 * 16 * 2 + 48 + 2 * 72 * 4 + 4 * 1152 * 2 + 2 * 4) == 1164200
    assert va.patches_per_token == 4
    assert vision_activation({"model_type": "qwen3_5_moe"}, Knobs()) is None  # text-only


@pytest.mark.parametrize("dtype,depth,merge", [("fp32", 1, 1), ("bf16", 1, 1), ("fp32", 3, 2)])
def test_vision_activation_equals_measured(dtype, depth, merge):
    """Against what autograd keeps for the backward of transformers' tower (storages counted once, parameters
    excluded), two images, CPU."""
    import torch
    from transformers import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    from megatron_s3ac.plan.memory import vision_activation
    from megatron_s3ac.models.tiny_qwen3_5 import VISION

    v = dict(VISION, depth=depth, spatial_merge_size=merge, temporal_patch_size=merge)
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    torch.manual_seed(0)
    model = Qwen3_5MoeVisionModel(Qwen3_5MoeVisionConfig(**v)).to(tdt)
    model.config._attn_implementation = "sdpa"
    grid = torch.tensor([[1, 4, 8], [1, 4, 4]])
    n = int(grid.prod(-1).sum())
    pix = torch.randn(n, 3 * merge * 2 * 2, dtype=tdt)
    own = {q.untyped_storage().data_ptr() for q in model.parameters()}
    seen = {}

    def pack(x):
        st = x.untyped_storage()
        if st.data_ptr() not in own:
            seen[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(pix, grid_thw=grid)
    cfg = _cfg()
    cfg["vision_config"] = {**cfg["vision_config"], **v}
    assert sum(seen.values()) == n * vision_activation(cfg, Knobs(dtype=dtype, backend="cpu")).saved


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_vision_activations_in_the_estimate(recompute):
    """First stage only; trainable: saved x patches x micro-batches in flight (PP 2: 2), recompute leaves it;
    frozen: nothing held, one block's transient in the working set; the critic's tower is frozen."""
    from megatron_s3ac.plan.memory import vision_activation

    vl = model_info(_cfg())
    cl = Cluster(gpus=4, gpu_mem_gib=80)
    layout = ParallelLayout(tp=1, pp=2, ep=1)
    w = Workload(prompt_len=16, response_len=32, prompts_per_step=8, k=2, micro_batch_size=2, image_tokens=32,
                 actor_minibatches=1, critic_minibatches=1)
    base = dict(dtype="fp32", backend="cpu", recompute=recompute, placement="colocated", engine_tp=1)
    none = estimate(vl, layout, cl, Workload(**{**w.__dict__, "image_tokens": 0}), Knobs(**base))
    frozen = estimate(vl, layout, cl, w, Knobs(**base))
    trained = estimate(vl, layout, cl, w, Knobs(**base, vision_trainable=True))
    va = vision_activation(_cfg(), Knobs(**base))
    patches = 2 * 32 * 1  # 2 rows per micro-batch, 32 image tokens each, 1 patch per token
    assert trained.n_micro >= 2
    assert trained.stages[0].act_actor - frozen.stages[0].act_actor == pytest.approx(1408 * patches * 2)
    assert trained.stages[1].act_actor == frozen.stages[1].act_actor  # later stages: no tower
    assert trained.stages[0].act_critic == frozen.stages[0].act_critic
    assert frozen.stages[0].working >= va.block * patches
    assert frozen.stages[0].act_actor == pytest.approx(none.stages[0].act_actor * w.seq_len / none.workload.seq_len)

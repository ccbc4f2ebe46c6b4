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
from megatron_s3ac.testing.tiny_qwen3_5 import tiny_qwen3_5_config, tiny_qwen3_5_model


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
        assert sa.grads - sb.grads == (n * 4 if trainable else 0)
        assert sa.optimizer - sb.optimizer == (-(-n // dp) * (4 + 8) if trainable else 0)  # fp32 main + 2 moments
    assert a.engine.weights - b.engine.weights == pytest.approx(n * 2)
    # image tokens: N more tokens per sequence in the activations (micro-batch = one sequence) and the engine's KV
    wi = copy.replace(w, image_tokens=32) if hasattr(copy, "replace") else Workload(**{**w.__dict__, "image_tokens": 32})
    c = estimate(vl, layout, cl, wi, knobs)
    assert wi.seq_len == 64 + 32 + 128 and c.tokens_per_micro == wi.seq_len
    assert c.stages[0].act_actor == pytest.approx(a.stages[0].act_actor * wi.seq_len / w.seq_len)
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

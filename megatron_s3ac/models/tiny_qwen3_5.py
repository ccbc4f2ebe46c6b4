"""Tiny random Qwen3.5-MoE checkpoints (hub layout), nothing downloaded.

8 layers = 2 x (3 Gated DeltaNet + 1 gated attention), 8 experts top-2 + a gated shared expert,
partial RoPE 0.25, GQA (4 q / 2 kv heads), GDN with 2 key / 4 value heads. Two variants:
``"vl"``: a ``Qwen3_5MoeForConditionalGeneration`` checkpoint (config with ``text_config`` and a
one-block vision tower, LM tensors under ``model.language_model.``), like the published Qwen3.5 /
Intern-S2 checkpoints; ``"text"``: ``Qwen3_5MoeForCausalLM`` (``model_type: qwen3_5_moe_text``).

``experts="fused"`` rewrites transformers' per-expert save into the published fused layout
(``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]); ``"per_expert"`` keeps what
``save_pretrained`` writes and marks the config with ``s3ac_hf_experts: per_expert``.
(``tiny_models.tiny_config`` resets ``rope_parameters``, which would drop Qwen3.5's partial rotary
factor, hence this separate builder.)
"""
from __future__ import annotations

import json
import os

import torch

TEXT = dict(vocab_size=96, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [1, 1, 0], "mrope_interleaved": True})
# A wider variant (``save_tiny_qwen3_5(dir, **WIDE)``): the model of the CUDA device check
# (tools/device_checks/qwen3_5_cuda.py), used where a figure is compared with that run (bf16 drift).
WIDE = dict(vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_key_head_dim=32, linear_value_head_dim=32, moe_intermediate_size=64,
            shared_expert_intermediate_size=64)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=2,
              temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)


def tiny_qwen3_5_config(variant: str = "vl", **text_overrides):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig

    text = {**TEXT, **text_overrides}
    if variant == "text":
        return Qwen3_5MoeTextConfig(**text)
    if variant == "vl":
        return Qwen3_5MoeConfig(text_config=text, vision_config=dict(VISION),
                                tie_word_embeddings=text["tie_word_embeddings"])
    raise ValueError(f"variant must be 'vl' or 'text', got {variant!r}")


def tiny_qwen3_5_model(variant: str = "vl", seed: int = 0, dtype=torch.float32, **text_overrides):
    """Random model in eval mode; every norm, A_log and dt_bias randomised so a mapping error shows."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration

    cfg = tiny_qwen3_5_config(variant, **text_overrides)
    torch.manual_seed(seed)
    cls = Qwen3_5MoeForConditionalGeneration if variant == "vl" else Qwen3_5MoeForCausalLM
    model = cls(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("linear_attn.norm.weight"):  # plain gated norm (w * x)
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "norm" in name:  # zero-centred norms ((1 + w) * x)
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("shared_expert_gate.weight"):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.3 * torch.randn_like(p))
    return model.eval()


def fuse_experts(hf_dir: str) -> None:
    """Rewrite per-expert tensors ``...mlp.experts.<e>.{gate,up,down}_proj.weight`` of a safetensors
    checkpoint into the fused ``experts.gate_up_proj`` / ``experts.down_proj`` (published layout)."""
    import re

    from safetensors.torch import load_file, save_file

    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    rx = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    for fn in files:
        path = os.path.join(hf_dir, fn)
        sd = load_file(path)
        groups: dict[str, dict] = {}
        out = {}
        for name, t in sd.items():
            m = rx.match(name)
            if m is None:
                out[name] = t
            else:
                groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        for prefix, g in groups.items():
            E = 1 + max(e for e, _ in g)
            out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([g[(e, "gate")], g[(e, "up")]]) for e in range(E)])
            out[prefix + ".down_proj"] = torch.stack([g[(e, "down")] for e in range(E)])
        save_file(out, path, metadata={"format": "pt"})
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            idx = json.load(f)
        wm = {}
        for name, fn in idx["weight_map"].items():
            m = rx.match(name)
            if m is None:
                wm[name] = fn
            else:
                wm[m.group(1) + ".gate_up_proj"] = fn
                wm[m.group(1) + ".down_proj"] = fn
        idx["weight_map"] = wm
        with open(index, "w") as f:
            json.dump(idx, f, indent=2)


def save_tiny_qwen3_5(out_dir: str, variant: str = "vl", experts: str = "fused", seed: int = 0,
                      **text_overrides) -> str:
    """Write a tiny random Qwen3.5-MoE checkpoint; returns ``out_dir``."""
    _save(tiny_qwen3_5_model(variant, seed=seed, **text_overrides), out_dir, experts)
    return out_dir


def _save(model, out_dir: str, experts: str) -> None:
    """save_pretrained + the expert layout: ``fused`` (published) or ``per_expert`` (marked in config.json)."""
    from megatron_s3ac.models.qwen3_5 import EXPERT_LAYOUT_KEY

    if experts not in ("fused", "per_expert"):
        raise ValueError(f"experts must be 'fused' or 'per_expert', got {experts!r}")
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if experts == "fused":
        fuse_experts(out_dir)
        return
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg[EXPERT_LAYOUT_KEY] = "per_expert"
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


# The complete VL checkpoint (``save_tiny_qwen3_5_vl_full``): image / video / vision start / end token ids
# inside the tiny vocabulary (the config's defaults are Qwen3.5's 248k-vocab ids), one MTP layer.
VL_TOKENS = dict(image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
# the image processor of the tiny vision tower (patch 2, no temporal / spatial merge): an 8 x 8 image
# is a 1 x 4 x 4 grid of patches = 16 image tokens
IMAGE_PROCESSOR = dict(patch_size=2, temporal_patch_size=1, merge_size=1, min_pixels=16, max_pixels=64 * 64)


def save_tiny_qwen3_5_vl_full(out_dir: str, seed: int = 0, experts: str = "fused",
                              mtp_dtype=torch.bfloat16) -> str:
    """A complete tiny ``Qwen3_5MoeForConditionalGeneration`` checkpoint in the hub layout: randomised
    vision tower, the LM (``experts`` layout), one MTP layer (``mtp.*``, as the published checkpoints
    store it: fc [H, 2H], three norms, a full-attention MoE decoder layer; in ``mtp_dtype``, in its own
    shard, like the hub's) and the image processor's ``preprocessor_config.json``. Returns ``out_dir``."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = Qwen3_5MoeConfig(text_config={**TEXT, "mtp_num_hidden_layers": 1}, vision_config=dict(VISION),
                           tie_word_embeddings=TEXT["tie_word_embeddings"], **VL_TOKENS)
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    ref = tiny_qwen3_5_model("vl", seed=seed)  # the LM's randomised norms / GDN parameters
    with torch.no_grad():
        mine = dict(model.named_parameters())
        for name, p in ref.named_parameters():
            if "visual" not in name:
                mine[name].copy_(p)
        g = torch.Generator().manual_seed(seed + 7)
        for name, p in model.model.visual.named_parameters():  # biases / norms are constants at init
            p.copy_(0.2 * torch.randn(p.shape, generator=g) + (1.0 if name.endswith("norm1.weight") else 0.0))
    _save(model, out_dir, experts)
    lm = {}
    for fn in sorted(os.listdir(out_dir)):
        if fn.endswith(".safetensors"):
            lm.update(load_file(os.path.join(out_dir, fn)))
    H = TEXT["hidden_size"]
    full = next(i for i in range(TEXT["num_hidden_layers"]) if (i + 1) % 4 == 0)  # a gated-attention layer
    src = f"model.language_model.layers.{full}."
    mtp = {"mtp.fc.weight": torch.randn(H, 2 * H, generator=g), "mtp.norm.weight": torch.randn(H, generator=g),
           "mtp.pre_fc_norm_embedding.weight": torch.randn(H, generator=g),
           "mtp.pre_fc_norm_hidden.weight": torch.randn(H, generator=g)}
    for name, t in lm.items():
        if name.startswith(src):
            mtp["mtp.layers.0." + name[len(src):]] = torch.randn(t.shape, generator=g)
    mtp = {k: (0.1 * v).to(mtp_dtype) for k, v in mtp.items()}
    save_file(mtp, os.path.join(out_dir, "model-mtp.safetensors"), metadata={"format": "pt"})
    weight_map = {n: fn for fn in sorted(os.listdir(out_dir)) if fn.endswith(".safetensors")
                  for n in (lm if fn != "model-mtp.safetensors" else mtp)}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR).save_pretrained(out_dir)
    return out_dir


def tiny_image_prompt(seed: int = 0, text_before=(5, 6, 7), text_after=(8, 9)):
    """An image prompt for the tiny VL model, processed by transformers' Qwen2-VL image processor (PIL
    backend: torchvision does not load with the CPU torch 2.13 wheel here): an 8 x 8 RGB drawing.
    Returns (input_ids [1, s], pixel_values [16, 12], image_grid_thw [1, 3])."""
    import numpy as np
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    out = Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR)(images=[img], return_tensors="pt")
    grid = out["image_grid_thw"]
    n = int(grid.prod()) // IMAGE_PROCESSOR["merge_size"] ** 2
    t = VL_TOKENS
    ids = [*text_before, t["vision_start_token_id"], *[t["image_token_id"]] * n, t["vision_end_token_id"], *text_after]
    return torch.tensor([ids]), out["pixel_values"], grid

"""The paper / Qwen3.5 example configs and the stand-ins their checks need (shared by the plan, rollout and
eval tests of the examples)."""
import json
import os
import shutil
import struct

import pytest

from megatron_s3ac.models.tiny_models import char_tokenizer

ROOT = os.path.join(os.path.dirname(__file__), "..")
# (example file, its model's config dir under examples/hf_configs); the 397B check is slow (its plan is large)
EXAMPLES = [
    ("examples/paper/qwen25_math_1p5b_k1.yaml", "qwen2_5_math_1_5b"),
    ("examples/paper/qwen25_math_1p5b_k16.yaml", "qwen2_5_math_1_5b"),
    ("examples/paper/r1_distill_1p5b_math1460.yaml", "r1_distill_qwen_1_5b"),
    ("examples/paper/qwen3_30b_a3b_ep.yaml", "qwen3_30b_a3b"),
    ("examples/paper/qwen3_30b_a3b_ep_grpo_x.yaml", "qwen3_30b_a3b"),
    ("examples/qwen3_5/qwen3_5_35b_a3b.yaml", "qwen3_5_35b_a3b"),
    pytest.param("examples/qwen3_5/qwen3_5_397b_layout.yaml", "qwen3_5_397b_a17b", marks=pytest.mark.slow),
]


def hf_stand_in(tmp_path, hf: str) -> str:
    """An HF dir with the model's real config.json, a well-formed safetensors file holding no tensor (the check
    reads its header, not the weights) and a character tokenizer (the check tokenizes the prompts)."""
    d = os.path.join(str(tmp_path), hf)
    os.makedirs(d, exist_ok=True)
    shutil.copy(os.path.join(ROOT, "examples", "hf_configs", hf, "config.json"), os.path.join(d, "config.json"))
    with open(os.path.join(d, "model.safetensors"), "wb") as f:  # 8-byte header length, then the JSON header
        f.write(struct.pack("<Q", 8) + b"{}      ")
    char_tokenizer().save_pretrained(d)
    with open(os.path.join(d, "config.json")) as f:
        if "vision_config" in json.load(f):  # a VL model's prompts need its image processor
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            from megatron_s3ac.models.tiny_qwen3_5 import IMAGE_PROCESSOR

            Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR).save_pretrained(d)
    return d


def torch_dist_stand_in(d: str) -> str:
    """A complete (one-tensor) torch_dist checkpoint directory: metadata.json, .metadata and its .distcp file, as
    the check reads them."""
    import torch
    import torch.distributed.checkpoint as dcp

    os.makedirs(d, exist_ok=True)
    dcp.save({"stand_in": torch.zeros(2)}, checkpoint_id=d, no_dist=True)
    with open(os.path.join(d, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    return d


def stand_in_policies(cfg: dict, model_dir: str) -> None:
    """The pipeline's coverage policies (HF dirs the check looks for) -> the stand-in model dir."""
    if cfg.get("pipeline", {}).get("policies"):
        cfg["pipeline"]["policies"] = [model_dir] * len(cfg["pipeline"]["policies"])

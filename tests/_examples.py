"""The paper / Qwen3.5 example configs and the stand-ins their checks need (shared by the plan, rollout and
eval tests of the examples)."""
import os
import shutil

import pytest

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
    """An HF dir with the model's real config.json and empty weight / tokenizer files: validation looks for
    them, it does not read them."""
    d = os.path.join(str(tmp_path), hf)
    os.makedirs(d, exist_ok=True)
    shutil.copy(os.path.join(ROOT, "examples", "hf_configs", hf, "config.json"), os.path.join(d, "config.json"))
    open(os.path.join(d, "model.safetensors"), "wb").close()
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        f.write("{}")
    return d


def stand_in_policies(cfg: dict, model_dir: str) -> None:
    """The pipeline's coverage policies (HF dirs the check looks for) -> the stand-in model dir."""
    if cfg.get("pipeline", {}).get("policies"):
        cfg["pipeline"]["policies"] = [model_dir] * len(cfg["pipeline"]["policies"])

"""Every example config's layout fits its cluster: section, by the planner, with the knobs its comment names."""
import json
import os

import pytest
import yaml

from megatron_s3ac.plan import cli

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
EXAMPLES = [
    ("examples/paper/qwen25_math_1p5b_k1.yaml", "qwen2_5_math_1_5b"),
    ("examples/paper/qwen25_math_1p5b_k16.yaml", "qwen2_5_math_1_5b"),
    ("examples/paper/r1_distill_1p5b_math1460.yaml", "r1_distill_qwen_1_5b"),
    ("examples/paper/qwen3_30b_a3b_ep.yaml", "qwen3_30b_a3b"),
    ("examples/paper/qwen3_30b_a3b_ep_grpo_x.yaml", "qwen3_30b_a3b"),
    ("examples/qwen3_5/qwen3_5_35b_a3b.yaml", "qwen3_5_35b_a3b"),
    pytest.param("examples/qwen3_5/qwen3_5_397b_layout.yaml", "qwen3_5_397b_a17b", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("path,hf", EXAMPLES)
def test_example_layout_fits(capsys, path, hf):
    path = os.path.join(ROOT, path)
    with open(path) as f:
        cfg = yaml.safe_load(f)
    assert set(cfg["cluster"]) == {"gpus", "gpus_per_node", "gpu_mem_gib", "host_mem_gib"}
    assert cli.run([os.path.join(ROOT, "examples", "hf_configs", hf), "--config", path, "--recompute", "full",
                    "--offload-idle", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"], d["problems"]
    lay = {k: v for k, v in cfg["actor_layout"].items()}
    assert {k: d["layout"][k] for k in lay} == lay  # the config's own layout was planned
    assert d["train_gpus"] == cfg["cluster"]["gpus"]

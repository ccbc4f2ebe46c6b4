"""tools/device_checks/sglang_smoke.py cannot run here (no GPU, no sglang): its model preparation and its
comparison helpers are checked on CPU, and the script imports without sglang."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import torch

from megatron_s3ac.rollout.base import Sample

ROOT = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("sglang_smoke", ROOT / "tools/device_checks/sglang_smoke.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prepare_teacher_and_compare(tmp_path):
    smoke = load()
    path = smoke.prepare(str(tmp_path / "m"), num_hidden_layers=2, hidden_size=128)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["head_dim"] == 64 and cfg["mlp_only_layers"] == [] and cfg["dtype"] == "bfloat16"
    assert (tmp_path / "m" / "tokenizer.json").exists()
    from megatron_s3ac.rollout.factory import validate_rollout_engine

    validate_rollout_engine("sglang", model_dir=path)  # servable as far as the config check goes
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt, response = [3, 4, 13, 5, 14], [6, 7, 8]
    argmax, lp, routes = smoke.teacher_forced(model, prompt, response)
    assert argmax.shape == (3,) and lp.shape == (3,) and routes.shape == (7, 2, 2)
    ids = torch.tensor([prompt + response])
    ref = torch.log_softmax(model(ids).logits[0], -1)  # independent per-position loop
    for j, t in enumerate(response):
        assert abs(float(ref[len(prompt) - 1 + j, t]) - lp[j]) < 1e-5
    good = Sample(prompt, list(argmax), lp.astype(np.float32), "length", routes.astype(np.uint8))
    fig = smoke.compare([good], [(argmax, lp, routes)])
    assert fig == {"argmax_agree": 1.0, "max_dlogprob": 0.0, "router_agree": 1.0, "tokens": 3} and smoke.passes(fig)
    bad_routes = routes.copy()
    bad_routes[:, :, 0] = (bad_routes[:, :, 1] + 1) % 8
    bad = Sample(prompt, list(argmax), lp.astype(np.float32) + 0.5, "length", bad_routes.astype(np.uint8))
    fig = smoke.compare([bad], [(argmax, lp, routes)])
    assert fig["max_dlogprob"] == 0.5 and not smoke.passes(fig)


def test_usage_without_arguments():
    assert load().main([]) == 2

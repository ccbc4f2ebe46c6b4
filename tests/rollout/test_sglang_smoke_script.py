"""tools/device_checks/sglang_smoke.py cannot run here (no GPU, no sglang): its model preparation and its
comparison helpers are checked on CPU, and the script imports without sglang."""
import pytest
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


def test_prepare_fp8_writes_servable_block_fp8(tmp_path):
    """The FP8 case's preparation (check 5): the converter's checkpoint of the MODEL_FP8 model has
    quantization_config, e4m3 weights with float32 *_scale_inv [N/128, K/128] for every q/k/v/o and
    expert matrix, nothing SGLang's block rules refuse; quantize_stream of the bf16 weights (what the
    update sends) equals it bit for bit; transformers' dequantized teacher holds dequant(q, s)."""
    from megatron_s3ac.convert.fp8 import SCALE_SUFFIX, dequantize_blockwise, quantize_stream, sglang_block_problems

    smoke = load()
    bf16_dir, fp8_dir = smoke.prepare_fp8(str(tmp_path / "m"), num_hidden_layers=2)
    cfg = json.loads((tmp_path / "m_fp8" / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128],
                                          "modules_to_not_convert": ["embed_tokens", "lm_head", "mlp.gate"]}
    assert (tmp_path / "m_fp8" / "tokenizer.json").exists()
    src, out = smoke.weights_of(bf16_dir), smoke.weights_of(fp8_dir)
    H, D, E, F = 256, 128, 8, 128
    expect = {"self_attn.q_proj.weight": (4 * D, H), "self_attn.k_proj.weight": (2 * D, H),
              "self_attn.v_proj.weight": (2 * D, H), "self_attn.o_proj.weight": (H, 4 * D)}
    expect.update({f"mlp.experts.{e}.{p}_proj.weight": (F, H) for e in range(E) for p in ("gate", "up")})
    expect.update({f"mlp.experts.{e}.down_proj.weight": (H, F) for e in range(E)})
    scales = {n for n in out if n.endswith(SCALE_SUFFIX)}
    assert scales == {f"model.layers.{i}.{k}{SCALE_SUFFIX}" for i in range(2) for k in expect}
    for i in range(2):
        for k, (n, kk) in expect.items():
            name = f"model.layers.{i}.{k}"
            assert out[name].dtype == torch.float8_e4m3fn and tuple(out[name].shape) == (n, kk)
            s = out[name + SCALE_SUFFIX]
            assert s.dtype == torch.float32 and tuple(s.shape) == (n // 128, kk // 128)
    assert sglang_block_problems([(n, tuple(t.shape), t.dtype) for n, t in src.items()]) == []
    stream = list(quantize_stream(src.items()))
    assert smoke.stream_matches(stream, out)
    # the update sends flattened buckets (sglang_engine._flat_bucket): every tensor must start aligned
    from megatron_s3ac.rollout.base import iter_buckets
    from megatron_s3ac.rollout.engines.sglang.engine import _flat_bucket

    for bucket in iter_buckets(iter(stream), 1 << 20):
        flat = _flat_bucket(bucket)
        assert flat["flattened_tensor"].numel() == sum(t.nbytes for _, t in bucket)
    bumped = [(n, t + 1 if t.dtype == torch.float32 else t) for n, t in stream]
    assert not smoke.stream_matches(bumped, out) and not smoke.stream_matches(stream[:-1], out)
    teacher = smoke.fp8_teacher_model(fp8_dir, device="cpu")
    w = teacher.model.layers[1].self_attn.k_proj.weight
    name = "model.layers.1.self_attn.k_proj.weight"
    assert torch.equal(w, dequantize_blockwise(out[name], out[name + SCALE_SUFFIX]).to(torch.bfloat16))


@pytest.mark.slow  # torchrun, 2 gloo ranks + the stand-in: ~30 s
def test_colocated_script_dry_run_on_the_stand_in(tmp_path):
    """tools/device_checks/sglang_colocated.py --stand-in on 2 CPU ranks: every check passes (plan by device, the
    engine follows two syncs of perturbed weights exactly as transformers on the export does)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(root, "tools", "device_checks", "sglang_colocated.py"), str(tmp_path / "c"), "--stand-in"]
    # output to a file, not a pipe: torch's shared-memory manager (started by the CPU hand-over) inherits the
    # ranks' descriptors and outlives them briefly, so a pipe's EOF would come late
    log = tmp_path / "out.txt"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=600).returncode
    out = log.read_text()
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert rc == 0, out[-4000:]
    checks = {x["check"]: x for x in lines if "check" in x}
    assert set(checks) == {"plan", "sync", "again"} and all(c["pass"] for c in checks.values())
    assert checks["sync"]["changed"] and checks["sync"]["max_dlogprob"] < 1e-4
    assert lines[-1]["all_pass"] is True

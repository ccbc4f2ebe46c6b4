"""``s3ac-convert mcore-to-hf --dtype fp8`` writes SGLang's block-FP8 layout; the CPU engine serves it
dequantized (from the checkpoint and through update_weights), so its log-probs and R3 routes are those
of the FP8 weights, a real (nonzero, bounded) mismatch with the bf16 trainer."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from megatron_s3ac.convert.fp8 import SCALE_SUFFIX, dequantize_blockwise, quantize_stream, scale_shape
from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine

from tests.fp8.test_quant import block_bound


def read_all(d):
    out = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(d, fn), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny bf16 Qwen3-MoE checkpoint, its torch_dist conversion, and the FP8 HF export (CLI)."""
    from transformers import AutoModelForCausalLM

    from megatron_s3ac.convert import hf_to_mcore
    from megatron_s3ac.models.tiny_models import save_tiny_hf

    root = tmp_path_factory.mktemp("fp8")
    f32, bf16, m, fp8 = (str(root / n) for n in ("f32", "bf16", "mcore", "fp8"))
    save_tiny_hf("qwen3_moe", f32, seed=0)
    AutoModelForCausalLM.from_pretrained(f32, dtype=torch.bfloat16).save_pretrained(bf16)
    hf_to_mcore(bf16, m, workers=2, progress=False)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-m", "checkpoints_convert", "mcore-to-hf", "--mcore", m, "--out", fp8,
                        "--dtype", "fp8", "--max-shard-gb", str(60_000 / (1 << 30))],  # several shards
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "SGLang 0.5.23 would refuse" in r.stderr  # tiny q/k/v shards: < 128 rows (documented)
    return {"bf16": bf16, "mcore": m, "fp8": fp8}


def test_checkpoint_layout(dirs):
    cfg = json.load(open(os.path.join(dirs["fp8"], "config.json")))
    q = cfg["quantization_config"]
    assert q == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": [128, 128], "modules_to_not_convert": ["embed_tokens", "lm_head", "mlp.gate"]}
    src, out = read_all(dirs["bf16"]), read_all(dirs["fp8"])
    index = json.load(open(os.path.join(dirs["fp8"], "model.safetensors.index.json")))
    assert set(index["weight_map"]) == set(out) and len(set(index["weight_map"].values())) > 1
    n_quant = 0
    for name, w in src.items():
        if name + SCALE_SUFFIX in out:
            n_quant += 1
            qw, s = out[name], out[name + SCALE_SUFFIX]
            assert qw.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
            assert tuple(s.shape) == scale_shape(w.shape)
            err = (w.double() - dequantize_blockwise(qw, s).double()).abs()
            assert bool((err <= block_bound(w, s)).all()), name
        else:  # kept: router, embeddings, lm_head, norms -- bit-identical bf16
            assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], w), name
            assert w.dim() == 1 or any(k in name for k in ("embed_tokens", "lm_head", "mlp.gate.")), name
    assert n_quant == 4 * (4 + 4 * 3)  # per layer: q/k/v/o + 4 experts x gate/up/down
    assert set(out) == set(src) | {n + SCALE_SUFFIX for n in src if n + SCALE_SUFFIX in out}


def test_bad_keep_list_is_refused(dirs, tmp_path, capsys):
    from checkpoints_convert.cli import main

    out = str(tmp_path / "x")
    rc = main(["mcore-to-hf", "--mcore", dirs["mcore"], "--out", out, "--dtype", "fp8", "--fp8-keep", "q_proj",
               "--no-progress"])
    assert rc == 2 and "fused SGLang linear" in capsys.readouterr().err and not os.path.exists(out)


def test_transformers_fp8_loader_and_engine_weights(dirs):
    """transformers' FineGrainedFP8 loader (needs accelerate, a test dependency) dequantizes the
    checkpoint on CPU; its weights must equal the CPU engine's dequant(quant(w)) exactly (the tiny
    model's matrices are single 128-blocks, where transformers' block inference is right)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    eng = CPUEngine.from_pretrained(dirs["fp8"])
    src, out = read_all(dirs["bf16"]), read_all(dirs["fp8"])
    expect = dict(eng._dequantized(out.items()))
    # the engine's parameters hold exactly dequant(quant(w)) (compared through the checkpoint names)
    mine = dict(eng.model.state_dict())
    from transformers.core_model_loading import revert_weight_conversion
    as_ckpt = revert_weight_conversion(eng.model, mine)
    for name in src:
        assert torch.equal(as_ckpt[name].float(), expect[name].float()), name
    theirs = AutoModelForCausalLM.from_pretrained(
        dirs["fp8"], dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True))
    assert set(theirs.state_dict()) == set(mine)
    for n, p in theirs.state_dict().items():
        assert p.dtype == torch.float32 and torch.equal(p, mine[n].float()), n


def test_transformers_loads_fp8_checkpoint_with_close_logits(dirs):
    """The converter's FP8 checkpoint loaded by transformers itself (dequantized on CPU): its logits
    equal the bf16 model's plus the linear response J * dW to the quantization error, dW = W_fp8 - W
    (forward-mode AD through the bf16 model), up to second order: ||d - J dW|| <= 0.25 ||J dW||."""
    from torch.func import functional_call, jvp
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    kw = dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    m8 = AutoModelForCausalLM.from_pretrained(
        dirs["fp8"], quantization_config=FineGrainedFP8Config(dequantize=True), **kw).eval()
    mb = AutoModelForCausalLM.from_pretrained(dirs["bf16"], **kw).eval()
    P = {n: p.detach() for n, p in mb.named_parameters()}
    dW = {n: p.detach() - P[n] for n, p in m8.named_parameters()}
    assert set(dW) == set(P) and any(float(v.abs().max()) > 0 for v in dW.values())
    ids = torch.randint(3, 96, (4, 24), generator=torch.Generator().manual_seed(1))

    def f(params):
        return functional_call(mb, params, (ids,)).logits

    with torch.no_grad():
        base, lin = jvp(f, (P,), (dW,))
        logits8 = m8(ids).logits
    d = logits8 - base
    assert float(d.norm()) > 0
    assert float((d - lin).norm()) <= 0.25 * float(lin.norm())
    assert float((logits8.argmax(-1) == base.argmax(-1)).float().mean()) >= 0.8


def test_logits_move_by_the_linear_response_to_the_quantization_error(dirs):
    """Tolerance derived from the weights: to first order the FP8 model's logits are the bf16 model's
    plus J * dW, dW = dequant(quant(W)) - W (forward-mode AD). The measured change must be that linear
    response up to second-order terms (incl. the rare top-k route flip): ||d - J dW|| <= 0.25 ||J dW||."""
    from torch.func import functional_call, jvp

    kw = dict(attn_implementation="eager", experts_implementation="eager")  # forward-mode AD-able kernels
    e8 = CPUEngine.from_pretrained(dirs["fp8"], **kw)
    eb = CPUEngine.from_pretrained(dirs["bf16"], **kw)
    P = {n: p.detach() for n, p in eb.model.named_parameters()}
    dW = {n: p.detach() - P[n] for n, p in e8.model.named_parameters()}
    ids = torch.randint(3, 96, (4, 24), generator=torch.Generator().manual_seed(0))

    def f(params):
        return functional_call(eb.model, params, (ids,)).logits

    with torch.no_grad():
        base, lin = jvp(f, (P,), (dW,))
        d = e8.model(ids).logits - base
    assert float(d.norm()) > 0
    assert float((d - lin).norm()) <= 0.25 * float(lin.norm())
    top1 = float((e8.model(ids).logits.argmax(-1) == base.argmax(-1)).float().mean())
    assert top1 >= 0.8


def _teacher_forced(model, routers, top_k, sample):
    """(log-probs [R], {layer: top-k ids [P+R-1, K]}) of one plain forward of ``model``."""
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, L=L: seen.__setitem__(L, o)) for L, m in routers.items()]
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    P, R = len(sample.prompt_ids), len(sample.response_ids)
    logp = torch.log_softmax(logits[P - 1:P + R - 1], -1)
    lp = logp.gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]
    routes = {L: o[-1].reshape(-1, top_k)[: P + R - 1].numpy() for L, o in seen.items()}
    return lp, routes, logits[P - 1:P + R - 1]


def test_engine_serves_fp8_weights(dirs):
    """update_weights with (name, fp8) + (name_scale_inv, fp32), halves split over calls, gives the
    same engine as loading the FP8 checkpoint; its log-probs and R3 routes are the FP8 model's, and the
    gap to the bf16 ("trainer") log-probs is nonzero and within the softmax bound 2 max|d logit|."""
    from megatron_s3ac.rollout.engines.cpu.engine import find_moe_routers

    eb = CPUEngine.from_pretrained(dirs["bf16"])
    e8 = CPUEngine.from_pretrained(dirs["bf16"])
    stream = list(quantize_stream(read_all(dirs["bf16"]).items()))
    k = next(i for i, (n, _) in enumerate(stream) if n.endswith(SCALE_SUFFIX))
    e8.update_weights(stream[:k])  # ends with an fp8 weight whose scale is in the next call
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    with pytest.raises(Exception, match="without their pair"):
        e8.generate([[4, 5, 6]], params)
    e8.update_weights(stream[k:])
    ref = CPUEngine.from_pretrained(dirs["fp8"])
    for (n, p), (n2, p2) in zip(e8.model.named_parameters(), ref.model.named_parameters()):
        assert n == n2 and torch.equal(p, p2), n

    out = e8.generate([[4, 5, 13, 6], [8, 9, 14], [10]], params, n_samples=2, return_routed_experts=True)
    routers_b = find_moe_routers(eb.model)
    gaps, agree, total = [], 0, 0
    for group in out:
        for s in group:
            lp8, r8, z8 = _teacher_forced(e8.model, e8.routers, e8.top_k, s)
            lpb, rb, zb = _teacher_forced(eb.model, routers_b, eb.top_k, s)
            np.testing.assert_allclose(s.logprobs, lp8.numpy(), atol=1e-5, rtol=0)  # the FP8 model's
            for L in e8.moe_layers:
                np.testing.assert_array_equal(s.routed_experts[:, L], r8[L])  # R3 routes: FP8 router inputs
                agree += int((np.sort(r8[L], -1) == np.sort(rb[L], -1)).all(-1).sum())
                total += r8[L].shape[0]
            gap = (torch.from_numpy(s.logprobs) - lpb).abs()
            assert bool((gap <= 2 * (z8 - zb).abs().amax(-1) + 1e-5).all())
            gaps.append(gap)
    gaps = torch.cat(gaps)
    assert float(gaps.max()) > 0 and float(gaps.mean()) < 0.1
    print(f"fp8 vs bf16: mean |logprob gap| {float(gaps.mean()):.4f}, max {float(gaps.max()):.4f}, "
          f"route-set agreement {agree / total:.3f}")

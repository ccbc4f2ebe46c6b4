"""Block FP8 quantization: round trip within the e4m3 error bound derived from the scales, edge cases,
the stream rules, and agreement with transformers' own FP8 dequantizer."""
import math

import pytest
import torch

from megatron_s3ac.convert.fp8 import (
    DEFAULT_KEEP, SCALE_SUFFIX, Fp8Error, check_keep, dequantize_blockwise, dequantize_stream, quantization_config,
    quantize_blockwise, quantize_stream, scale_shape, sglang_block_problems,
)


def half_ulp_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Half the spacing of float8_e4m3fn numbers around |y| (float64).

    e4m3fn: 3 mantissa bits, exponent bias 7, smallest normal 2^-6. In the binade [2^e, 2^(e+1)), e >= -6,
    consecutive values are 2^(e-3) apart; below 2^-6 (subnormals m * 2^-9) they are 2^-9 apart, i.e. the
    same formula with e = -6. Round-to-nearest errs by at most half of that."""
    a = y.abs().double()
    e = torch.floor(torch.log2(a.clamp(min=2.0 ** -30))).clamp(min=-6)
    return torch.exp2(e - 4)


def block_bound(x: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Per element bound on |x - dequant(quant(x))|, from the scales alone.

    q = RNE_e4m3(fl32(x / s)) and deq = fl32(q * s), so
      |x - deq| <= s * half_ulp(|x|/s)            (e4m3 rounding of y = x/s; |y| <= 448: no overflow)
                 + s * 2^-24 |x|/s                 (fp32 rounding of the division)
                 + 2^-24 |q s|                     (fp32 rounding of the product; |q s| <= |x| + s*half_ulp)
    <= s * half_ulp(|x|/s) * (1 + 2^-24) + 2^-23 |x|."""
    n, k = x.shape[-2:]
    s = scale_inv.double().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :n, :k]
    xd = x.double()
    h = s * half_ulp_e4m3(xd / s)
    return h * (1 + 2.0 ** -24) + 2.0 ** -23 * xd.abs()


def _weights(shape, dtype, seed=0):
    """Normal weights whose magnitude varies by orders of magnitude from block to block (and some
    values deep in e4m3's subnormal range relative to their block's amax)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    w = w * torch.exp2(torch.randint(-12, 4, shape[:-1] + (1,), generator=g).float())  # per-row magnitudes
    return w.to(dtype)


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (1, 7), (129, 1), (3, 200, 130)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_within_block_bound(shape, dtype):
    w = _weights(shape, dtype)
    q, s = quantize_blockwise(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == scale_shape(shape)
    deq = dequantize_blockwise(q, s)
    err = (w.double() - deq.double()).abs()
    bound = block_bound(w, s)
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max())}"
    if w.numel() >= 10_000:  # the bound is tight, not a loose tolerance: some element comes close to it
        assert float((err / bound).max()) > 0.9


def test_scales_are_block_amax_over_448():
    w = _weights((260, 140), torch.float32, seed=1)
    _, s = quantize_blockwise(w)
    for i in range(3):
        for j in range(2):
            blk = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            assert float(s[i, j]) == pytest.approx(float(blk.abs().max()) / 448.0, rel=1e-6)
    # the largest element of each block lands on +-448 exactly
    q, s = quantize_blockwise(w[:128, :128])
    assert float(q.float().abs().max()) == 448.0


def test_all_zero_block():
    w = _weights((256, 256), torch.float32, seed=2)
    w[128:, :128] = 0
    q, s = quantize_blockwise(w)
    assert float(s[1, 0]) == 1.0
    deq = dequantize_blockwise(q, s)
    assert torch.equal(deq[128:, :128], torch.zeros(128, 128))
    assert bool(((w.double() - deq.double()).abs() <= block_bound(w, s)).all())
    q0, s0 = quantize_blockwise(torch.zeros(5, 3))
    assert torch.equal(dequantize_blockwise(q0, s0), torch.zeros(5, 3)) and not torch.isnan(s0).any()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_refused(bad):
    w = torch.randn(40, 300)
    w[7, 211] = bad
    with pytest.raises(Fp8Error, match=r"non-finite.*\(7, 211\)"):
        quantize_blockwise(w)
    with pytest.raises(Fp8Error, match="model.layers.0.mlp.down_proj.weight: .*non-finite"):
        list(quantize_stream([("model.layers.0.mlp.down_proj.weight", w)]))


def test_bad_inputs():
    with pytest.raises(Fp8Error, match="matrix"):
        quantize_blockwise(torch.randn(10))
    with pytest.raises(Fp8Error, match="cannot quantize"):
        quantize_blockwise(torch.ones(4, 4, dtype=torch.int32))
    q, s = quantize_blockwise(torch.randn(200, 10))
    with pytest.raises(Fp8Error, match=r"scale_inv shape \(1, 1\).*expected \[2, 1\]"):
        dequantize_blockwise(q, s[:1])
    with pytest.raises(Fp8Error, match="float8_e4m3fn"):
        dequantize_blockwise(q.float(), s)


@pytest.mark.parametrize("shape", [(256, 384), (64, 96), (2, 128, 256)])
def test_matches_transformers_fp8_dequantize(shape):
    """transformers' FineGrainedFP8 loader (Fp8Dequantize) gives the same weights. It derives the block
    from the scale grid, so this holds for shapes that are multiples of the block or one block."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    w = _weights(shape, torch.bfloat16, seed=3)
    q, s = quantize_blockwise(w)
    theirs = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)
    assert torch.equal(theirs, dequantize_blockwise(q, s))


def test_stream_rules():
    H, E, F = 32, 4, 16
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).bfloat16()  # noqa: E731
    src = [
        ("model.embed_tokens.weight", r(50, H)),
        ("model.layers.0.input_layernorm.weight", r(H)),
        ("model.layers.0.self_attn.q_proj.weight", r(H, H)),
        ("model.layers.0.self_attn.q_proj.bias", r(H)),
        ("model.layers.0.mlp.gate.weight", r(E, H)),
        ("model.layers.0.mlp.gate_proj.weight", r(F, H)),
        ("model.language_model.layers.1.linear_attn.in_proj_b.weight", r(4, H)),
        ("model.language_model.layers.1.linear_attn.in_proj_ba.weight", r(8, H)),
        ("model.language_model.layers.1.linear_attn.conv1d.weight", r(8, 1, 4)),
        ("model.language_model.layers.1.linear_attn.A_log", r(4)),
        ("model.language_model.layers.1.mlp.experts.gate_up_proj", r(E, 2 * F, H)),
        ("model.language_model.layers.1.mlp.shared_expert_gate.weight", r(1, H)),
        ("lm_head.weight", r(50, H)),
    ]
    out = list(quantize_stream(src))
    names = [n for n, _ in out]
    quantized = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.language_model.layers.1.linear_attn.in_proj_ba.weight",
                 "model.language_model.layers.1.mlp.experts.gate_up_proj"}
    expect = []
    for n, _ in src:
        expect += [n, n + SCALE_SUFFIX] if n in quantized else [n]
    assert names == expect
    d = dict(out)
    for n, t in src:
        if n in quantized:
            assert d[n].dtype == torch.float8_e4m3fn and d[n + SCALE_SUFFIX].dtype == torch.float32
        else:
            assert d[n] is t  # untouched, not copied
    assert d["model.language_model.layers.1.mlp.experts.gate_up_proj" + SCALE_SUFFIX].shape == (E, 1, 1)
    # and back: every tensor is either the original or its dequantized value, names restored
    back = dict(dequantize_stream(reversed(out)))  # order within a pair does not matter
    assert list(sorted(back)) == sorted(n for n, _ in src)
    for n, t in src:
        if n in quantized:
            assert bool(((t.double() - back[n].double()).abs() <= block_bound(t, d[n + SCALE_SUFFIX])).all())
    cfg = quantization_config([(n, tuple(t.shape), t.dtype) for n, t in src])
    assert cfg["quant_method"] == "fp8" and cfg["weight_block_size"] == [128, 128] and cfg["fmt"] == "e4m3"
    assert cfg["modules_to_not_convert"] == ["embed_tokens", "in_proj_b", "lm_head", "mlp.gate", "shared_expert_gate"]


def test_unpaired_and_keep_errors():
    q, s = quantize_blockwise(torch.randn(4, 4))
    with pytest.raises(Fp8Error, match=r"without their pair.*a.weight \(no a.weight_scale_inv\)"):
        list(dequantize_stream([("a.weight", q)]))
    with pytest.raises(Fp8Error, match="one shard of a fused SGLang linear"):
        check_keep(["q_proj"])
    check_keep(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])
    assert check_keep(DEFAULT_KEEP) == DEFAULT_KEEP
    # custom keep: nothing kept -> the router is quantized too
    out = dict(quantize_stream([("model.layers.0.mlp.gate.weight", torch.randn(4, 8))], keep=()))
    assert out["model.layers.0.mlp.gate.weight"].dtype == torch.float8_e4m3fn


def test_sglang_block_problems():
    shapes = [("model.layers.0.self_attn.k_proj.weight", (64, 256), torch.bfloat16),
              ("model.layers.0.self_attn.o_proj.weight", (256, 64), torch.bfloat16),
              ("model.layers.0.mlp.experts.gate_up_proj", (4, 2 * 96, 256), torch.bfloat16),
              ("model.layers.0.mlp.gate.weight", (4, 256), torch.bfloat16)]
    probs = sglang_block_problems(shapes)
    assert len(probs) == 2 and "k_proj" in probs[0] and "96 rows" in probs[1]
    assert math.prod(scale_shape((4, 192, 256))) == 4 * 2 * 2


def test_weight_updates_wrapper():
    from megatron_s3ac.convert.fp8 import Fp8WeightUpdates

    class Engine:
        top_k = 2

        def __init__(self):
            self.got = []

        def update_weights(self, named):
            self.got += list(named)

    e = Engine()
    w = Fp8WeightUpdates(e)
    src = [("model.layers.0.mlp.down_proj.weight", torch.randn(8, 16)), ("model.norm.weight", torch.randn(8))]
    w.update_weights(iter(src))
    assert [n for n, _ in e.got] == ["model.layers.0.mlp.down_proj.weight",
                                     "model.layers.0.mlp.down_proj.weight_scale_inv", "model.norm.weight"]
    assert e.got[0][1].dtype == torch.float8_e4m3fn and w.top_k == 2


def test_real_qwen3_moe_shapes_are_sglang_loadable():
    """Qwen3-30B-A3B's geometry (head_dim 128, moe_intermediate 768): the plan's tensors raise no
    SGLang block-shape problem, and the default keep list keeps exactly router/embeddings/lm_head."""
    from megatron_s3ac.convert.plan import build_plan
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.models.tiny_models import tiny_config

    cfg = tiny_config("qwen3_moe", hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      moe_intermediate_size=768, intermediate_size=6144, num_experts=8, num_hidden_layers=2,
                      vocab_size=1024).to_dict()
    shapes = [(n, s, "bfloat16") for n, s in build_plan(model_info(cfg)).hf_shapes.items()]
    assert sglang_block_problems(shapes) == []
    assert quantization_config(shapes)["modules_to_not_convert"] == ["embed_tokens", "lm_head", "mlp.gate"]

"""Metrics: explained variance, value error, approx KL, entropy, fractions, grad-norm split."""
import math

import pytest
import torch

from megatron_s3ac.algorithms.metrics import approx_kl, entropy_from_logits, explained_variance, grad_norm_split
from megatron_s3ac.algorithms.metrics import masked_fraction, value_error


def test_explained_variance_hand_cases():
    R = torch.tensor([[1.0, -1.0, 1.0, 99.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(R, R, m).item() == pytest.approx(1.0)
    mean = (1 - 1 + 1) / 3
    assert explained_variance(torch.full_like(R, mean), R, m).item() == pytest.approx(0.0, abs=1e-6)
    V = torch.tensor([[0.5, -0.5, 0.0, 0.0]])
    # Var[R] = 8/9; R - V = [0.5, -0.5, 1.0] -> var = mean(x^2) - mean^2 = 0.5 - 1/9
    assert explained_variance(V, R, m).item() == pytest.approx(1 - (0.5 - 1 / 9) / (8 / 9), rel=1e-6)
    assert math.isnan(explained_variance(V, torch.ones_like(R), m).item())


def test_value_error_hand():
    V = torch.tensor([[0.5, 0.0, 7.0]])
    R = torch.tensor([[1.0, -1.0, 0.0]])
    e = value_error(V, R, torch.tensor([[1, 1, 0]]))
    assert e["mae"].item() == pytest.approx(0.75)
    assert e["rmse"].item() == pytest.approx(math.sqrt((0.25 + 1.0) / 2))
    assert e["bias"].item() == pytest.approx((-0.5 + 1.0) / 2)


def test_approx_kl_estimators():
    lp = torch.tensor([[math.log(0.5), math.log(0.2)]])
    ref = torch.tensor([[math.log(0.4), math.log(0.2)]])
    m = torch.ones(1, 2)
    d = math.log(0.4) - math.log(0.5)
    assert approx_kl(lp, ref, m, "k1").item() == pytest.approx(d / 2)
    assert approx_kl(lp, ref, m, "k2").item() == pytest.approx(0.5 * d * d / 2)
    assert approx_kl(lp, ref, m, "k3").item() == pytest.approx((0.5 / 0.4 - 1 - math.log(0.5 / 0.4)) / 2)
    with pytest.raises(ValueError):
        approx_kl(lp, ref, m, "k4")


def test_entropy_from_logits():
    V = 7
    assert entropy_from_logits(torch.zeros(2, 3, V)).flatten().tolist() == pytest.approx([math.log(V)] * 6)
    z = torch.randn(5, 11, dtype=torch.float64)
    p = torch.softmax(z, -1)
    ref = [-sum(pi * math.log(pi) for pi in row) for row in p.tolist()]
    assert entropy_from_logits(z).tolist() == pytest.approx(ref, rel=1e-10)
    assert torch.allclose(entropy_from_logits(z, chunk_size=2), entropy_from_logits(z))
    big = torch.tensor([[1e4, 0.0, -1e4]], dtype=torch.bfloat16)
    h = entropy_from_logits(big)
    assert torch.isfinite(h).all() and h.item() == pytest.approx(0.0, abs=1e-6)


def test_masked_fraction():
    c = torch.tensor([[True, False, True, True]])
    assert masked_fraction(c, torch.tensor([[1, 1, 1, 0]])).item() == pytest.approx(2 / 3)
    assert masked_fraction(c, torch.zeros(1, 4)).item() == 0.0


def test_grad_norm_split():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"backbone": torch.nn.Linear(4, 8), "value_head": torch.nn.Linear(8, 1)})
    x = torch.randn(3, 4)
    model["value_head"](model["backbone"](x)).pow(2).sum().backward()
    out = grad_norm_split(model.named_parameters())
    head = sum(p.grad.pow(2).sum().item() for p in model["value_head"].parameters())
    back = sum(p.grad.pow(2).sum().item() for p in model["backbone"].parameters())
    assert out["head"] == pytest.approx(math.sqrt(head), rel=1e-5)
    assert out["backbone"] == pytest.approx(math.sqrt(back), rel=1e-5)
    assert out["total"] == pytest.approx(math.sqrt(head + back), rel=1e-5)
    assert out["head_sq_share"] == pytest.approx(head / (head + back), rel=1e-5)
    custom = grad_norm_split(model.named_parameters(), is_head=lambda n: n.startswith("backbone"))
    assert custom["head"] == pytest.approx(math.sqrt(back), rel=1e-5)

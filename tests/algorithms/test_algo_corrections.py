"""Train/inference mismatch corrections: truncated token IS, IcePoP, MIS sequence masks."""
import math

import torch

from megatron_s3ac.algorithms import cispo_loss, icepop_mask, mis_sequence_mask, token_is_weights

F64 = torch.float64


def _lp(ratios):
    """rollout log-probs 0 (p = 1 scale is irrelevant), train log-probs = log(ratio)."""
    train = torch.tensor([[math.log(r) for r in ratios]], dtype=F64)
    return train, torch.zeros_like(train)


def test_token_is_weights_truncated():
    train, roll = _lp([0.5, 1.0, 1.9, 3.0, 100.0])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    w = token_is_weights(train, roll, mask, cap=2.0)
    assert torch.allclose(w, torch.tensor([[0.5, 1.0, 1.9, 2.0, 0.0]]), atol=1e-6)
    w2 = token_is_weights(train, roll, mask, cap=2.0, floor=0.8)
    assert torch.allclose(w2, torch.tensor([[0.8, 1.0, 1.9, 2.0, 0.0]]), atol=1e-6)
    assert not w.requires_grad


def test_icepop_mask_bounds():
    train, roll = _lp([0.4, 0.6, 1.0, 4.0, 6.0, 1.0])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    keep = icepop_mask(train, roll, mask, low=0.5, high=5.0)
    assert keep.tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0, 0.0]]
    # extreme log-ratios are compared in log space: no overflow, no nan
    keep = icepop_mask(torch.tensor([[500.0, -500.0]]), torch.zeros(1, 2), torch.ones(1, 2))
    assert keep.tolist() == [[0.0, 0.0]]


def test_mis_sequence_mask_uses_max_token_log_ratio():
    train = torch.tensor([[0.0, 0.3, 0.0], [0.1, -2.0, 0.1], [0.0, 0.0, 9.0]])
    roll = torch.zeros(3, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]])  # row 2's outlier is padding
    keep = mis_sequence_mask(train, roll, mask, threshold=0.2)
    assert keep.tolist() == [[0, 0, 0], [1, 1, 1], [1, 1, 0]]
    keep2 = mis_sequence_mask(train, roll, mask, threshold=0.2, two_sided=True)  # |-2| > 0.2
    assert keep2.amax(1).tolist() == [0, 0, 1]
    nan_row = mis_sequence_mask(torch.tensor([[float("nan"), 0.0]]), torch.zeros(1, 2), torch.ones(1, 2), 1.0)
    assert nan_row.tolist() == [[0.0, 0.0]]


def test_corrections_compose_into_cispo_without_changing_denominator():
    train, roll = _lp([0.4, 1.0, 3.0, 1.0])
    mask = torch.ones(1, 4)
    w = token_is_weights(train, roll, mask, cap=2.0)
    k = icepop_mask(train, roll, mask, 0.5, 5.0) * mis_sequence_mask(train, roll, mask, threshold=5.0)
    logp = torch.full((1, 4), math.log(0.5), dtype=F64, requires_grad=True)
    adv = torch.ones(1, 4, dtype=F64)
    loss, _ = cispo_loss(logp, logp.detach(), adv, mask, 1.0, 0.28, is_weights=w, keep_mask=k)
    loss.backward()
    # r = 1; token 0 masked by IcePoP, token 2 weight truncated to 2; N stays 4
    assert torch.allclose(logp.grad, -torch.tensor([[0.0, 1.0, 2.0, 1.0]], dtype=F64) / 4, atol=1e-6)

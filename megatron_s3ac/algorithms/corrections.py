"""Training-inference mismatch corrections (token IS, IcePoP, MIS), S3AC §4.1.

All take ``train_log_prob`` (log-probs of the sampled tokens recomputed by the training engine,
usually pi_old) and ``rollout_log_prob`` (the inference engine's log-probs of the same tokens),
[B, T], plus the response ``mask``. The log-ratio is log(pi_train / pi_rollout) = train - rollout.
Outputs are detached and 0 outside ``mask``; multiply them into a loss through ``is_weights`` /
``keep_mask`` (see losses.py).
"""
from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

_LOG_RATIO_CLAMP = 20.0


def _log_ratio(train_log_prob: Tensor, rollout_log_prob: Tensor) -> Tensor:
    return (train_log_prob.detach() - rollout_log_prob.detach()).to(torch.float32)


@torch.no_grad()
def token_is_weights(
    train_log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor, cap: float = 2.0, floor: float | None = None
) -> Tensor:
    """Truncated token-level IS weights w_t = min(pi_train / pi_rollout, cap) (TIS).

    floor: optional lower truncation (w_t >= floor). Returns [B, T] float32, 0 outside mask.
    """
    w = _log_ratio(train_log_prob, rollout_log_prob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()
    w = w.clamp(min=floor, max=cap) if floor is not None else w.clamp(max=cap)
    return w * mask.to(w.dtype)


@torch.no_grad()
def icepop_mask(
    train_log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor, low: float = 0.5, high: float = 5.0
) -> Tensor:
    """IcePoP token mask: 1 where low <= pi_train / pi_rollout <= high, 0 elsewhere (and outside mask).

    Compared in log space, so extreme ratios never overflow. Returns [B, T] float32.
    """
    if not 0 < low <= high:
        raise ValueError("need 0 < low <= high")
    lr = _log_ratio(train_log_prob, rollout_log_prob)
    keep = (lr >= math.log(low)) & (lr <= math.log(high))
    return (keep & mask.bool()).to(torch.float32)


@torch.no_grad()
def mis_sequence_mask(
    train_log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor, threshold: float, two_sided: bool = False
) -> Tensor:
    """MIS-style sequence mask: drop a whole response whose MAX token log-ratio exceeds threshold.

    A row is kept iff max_t log(pi_train / pi_rollout) <= threshold over its valid tokens
    (threshold in nats; two_sided=True uses max_t |log-ratio|). Returns [B, T] float32: the row's
    keep flag broadcast onto its valid tokens (0 outside mask). ``out.amax(1)`` recovers [B] flags.
    """
    lr = _log_ratio(train_log_prob, rollout_log_prob)
    if two_sided:
        lr = lr.abs()
    m = mask.bool()
    worst = torch.where(m, lr, torch.full_like(lr, -float("inf"))).amax(1)
    keep = ~(worst > threshold)  # nan log-ratios count as mismatch
    keep &= ~torch.where(m, lr.isnan(), torch.zeros_like(m)).any(1)
    return (keep[:, None] & m).to(torch.float32)


__all__ = ["token_is_weights", "icepop_mask", "mis_sequence_mask"]

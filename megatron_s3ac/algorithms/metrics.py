"""Training diagnostics: critic quality, policy drift, entropy, mask fractions, gradient-norm split.

All reductions are local to the tensors passed in (no collectives); functions return detached
0-d tensors (or python floats where stated) and never call ``.item()`` on the hot path.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Iterable

import torch

Tensor = torch.Tensor


def _masked(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    m = mask.to(torch.float64)
    return x.detach().to(torch.float64) * m, m


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """EV = 1 - Var[R - V] / Var[R] over valid tokens ([B, T]); nan if Var[R] == 0 (or < 2 tokens).

    1 is a perfect critic, 0 is a constant predictor at the mean, < 0 worse than that.
    """
    m = mask.to(torch.float64)
    n = m.sum()
    v, r = values.detach().to(torch.float64), returns.detach().to(torch.float64)

    def var(x):
        mu = (x * m).sum() / n
        return (((x - mu) ** 2) * m).sum() / n

    var_r = var(r)
    ev = 1.0 - var(r - v) / var_r
    bad = (n < 2) | (var_r <= 0)
    return torch.where(bad, torch.full_like(ev, float("nan")), ev).float()


@torch.no_grad()
def value_error(values: Tensor, returns: Tensor, mask: Tensor) -> dict:
    """Critic error over valid tokens: {'mae', 'rmse', 'bias'} with bias = mean(V - R)."""
    d, m = _masked(values.detach().to(torch.float64) - returns.detach().to(torch.float64), mask)
    n = m.sum().clamp(min=1)
    return {
        "mae": (d.abs().sum() / n).float(),
        "rmse": ((d**2).sum() / n).sqrt().float(),
        "bias": (d.sum() / n).float(),
    }


@torch.no_grad()
def approx_kl(log_prob: Tensor, ref_log_prob: Tensor, mask: Tensor, kind: str = "k1") -> Tensor:
    """Masked-mean estimate of KL(q || p) from log-probs of the sampled tokens, [B, T] (nats).

    q = ``ref_log_prob``'s policy (the one the tokens were drawn from, e.g. pi_old or the rollout
    engine), p = ``log_prob``'s. With d = log q - log p: k1 = d, k2 = d^2 / 2,
    k3 = exp(-d) - 1 + d (Schulman's unbiased, always >= 0 estimator).
    """
    d = (ref_log_prob.detach() - log_prob.detach()).to(torch.float64)
    if kind == "k1":
        x = d
    elif kind == "k2":
        x = 0.5 * d**2
    elif kind == "k3":
        x = torch.expm1(-d.clamp(min=-20.0)) + d
    else:
        raise ValueError("kind must be 'k1', 'k2' or 'k3'")
    x, m = _masked(x, mask)
    return (x.sum() / m.sum().clamp(min=1)).float()


def entropy_from_logits(logits: Tensor, chunk_size: int | None = None) -> Tensor:
    """Per-position entropy (nats) of softmax(logits): [..., V] -> [...].

    H = logsumexp(z) - sum softmax(z) * z, computed in float32 at least. chunk_size splits the
    leading positions to bound the [.., V] float32 temporaries for large vocabularies.
    Differentiable (use under no_grad for logging).
    """
    def _h(z: Tensor) -> Tensor:
        z = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z
        lse = torch.logsumexp(z, dim=-1)
        return lse - (torch.softmax(z, dim=-1) * z).sum(-1)

    if chunk_size is None:
        return _h(logits)
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.cat([_h(c) for c in flat.split(chunk_size)])
    return out.reshape(logits.shape[:-1])


@torch.no_grad()
def masked_fraction(condition: Tensor, mask: Tensor) -> Tensor:
    """Fraction of valid tokens where ``condition`` (bool/0-1, [B, T]) holds; 0 on an empty mask.

    Use for clip / IcePoP / MIS fractions, e.g. masked_fraction(icepop == 0, mask).
    """
    c, m = _masked(condition.to(torch.float64), mask)
    return (c.sum() / m.sum().clamp(min=1)).float()


def grad_norm_split(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
    is_head: Callable[[str], bool] | str = r"(^|\.)(value_head|v_head|score)(\.|$)",
) -> dict:
    """L2 gradient norms of the value head vs the backbone (S3AC §3.3 / §4.3 diagnostic).

    named_parameters: e.g. ``model.named_parameters()``; parameters without .grad are skipped.
    is_head: predicate on the name, or a regex searched in it (default matches value_head / v_head /
    score modules). Returns python floats {'head', 'backbone', 'total', 'head_sq_share'} where
    head_sq_share = |g_head|^2 / |g|^2 (the paper's "share of the squared gradient norm").
    Local to this rank: under TP/PP sum the squares across the model-parallel group first, e.g.
    via the '_sq' entries also returned.
    """
    pred = (lambda n, _r=re.compile(is_head): bool(_r.search(n))) if isinstance(is_head, str) else is_head
    head_sq: list[Tensor] = []
    back_sq: list[Tensor] = []
    for name, p in named_parameters:
        g = getattr(p, "main_grad", None)  # Megatron keeps fp32 grads in main_grad
        g = p.grad if g is None else g
        if g is None:
            continue
        (head_sq if pred(name) else back_sq).append(g.detach().float().pow(2).sum())
    h = float(torch.stack(head_sq).sum()) if head_sq else 0.0
    b = float(torch.stack(back_sq).sum()) if back_sq else 0.0
    tot = h + b
    return {
        "head": math.sqrt(h),
        "backbone": math.sqrt(b),
        "total": math.sqrt(tot),
        "head_sq_share": h / tot if tot > 0 else float("nan"),
        "head_sq": h,
        "backbone_sq": b,
    }


__all__ = [
    "explained_variance",
    "value_error",
    "approx_kl",
    "entropy_from_logits",
    "masked_fraction",
    "grad_norm_split",
]

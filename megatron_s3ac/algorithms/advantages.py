"""Advantage estimators: token-level GAE (S3AC Eq. 1) and the critic-free baselines.

Conventions (shared by the whole package):
  * response tensors are [B, T] in padded layout; ``mask`` is 0/1 (float or bool) over valid response
    tokens. Right padding is typical, but any mask is handled: masked positions are not part of the
    trajectory (they are skipped, not treated as zero-reward steps).
  * ``values[:, t]`` is V(s_t), the value of the state *before* token t is emitted; V after the
    last valid token is 0.
  * outcome rewards R (in {-1, +1} for S3AC) sit on the last valid token; gamma = 1.
  * advantage functions return detached tensors; nothing here whitens unless its docstring says so.
"""
from __future__ import annotations

from typing import Union

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
LamLike = Union[float, Tensor]

# Block size of the blocked reverse scan. Each block costs a [C, C] matmul per row; 64 balances the
# O(T*C) matmul work against the O(T/C) recursion depth on CPU and GPU alike.
_SCAN_BLOCK = 64


def discounted_reverse_cumsum(x: Tensor, rho: Tensor, block: int = _SCAN_BLOCK) -> Tensor:
    """y[b, k] = sum_{j >= k} rho[b]**(j - k) * x[b, j].

    x: [B, n] float; rho: [B] in [0, 1] (per-row discount). Returns [B, n] in x's dtype.

    Blocked scan: inside a block of C tokens the sum is a matmul with the [C, C] Toeplitz matrix
    rho**(j-k); block starts are combined by the same scan on the [B, n/C] block sums with discount
    rho**C (recursively). Only non-negative powers are ever formed, so nothing is divided by
    rho**t and nothing under/overflows for any rho in [0, 1] at any length (rho**t that underflows
    to 0 is the correct value of a term below float64 resolution).
    """
    if block < 2:
        raise ValueError("block must be >= 2")
    B, n = x.shape
    if n == 0:
        return x
    C = min(block, n)
    nb = -(-n // C)
    pad = nb * C - n
    if pad:
        x = F.pad(x, (0, pad))  # zeros after the end contribute nothing
    d = torch.arange(C, device=x.device)
    expo = (d[:, None] - d[None, :]).to(x.dtype)  # j - k
    rho_ = rho.to(x.dtype)
    w = torch.where(expo >= 0, rho_[:, None, None] ** expo.clamp(min=0), torch.zeros((), dtype=x.dtype, device=x.device))
    y = torch.bmm(x.reshape(B, nb, C), w)  # [B, nb, C], within-block sums
    if nb > 1:
        starts = discounted_reverse_cumsum(y[:, :, 0], rho_ ** C, block)
        carry = F.pad(starts[:, 1:], (0, 1))  # full value at the start of the next block
        tail = rho_[:, None] ** (C - d).to(x.dtype)[None, :]  # rho**(distance to next block start)
        y.baddbmm_(carry[:, :, None], tail[:, None, :])  # y += carry (outer) tail
    return y.reshape(B, nb * C)[:, :n]


def _as_row_tensor(lam: LamLike, B: int, like: Tensor) -> Tensor:
    if isinstance(lam, Tensor):
        lam = lam.to(device=like.device, dtype=like.dtype)
        if lam.ndim == 0:
            lam = lam.expand(B)
        if lam.shape != (B,):
            raise ValueError(f"lam must be a float or a [B]={B} tensor, got shape {tuple(lam.shape)}")
        return lam
    return torch.full((B,), float(lam), device=like.device, dtype=like.dtype)


def compact_valid(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Move each row's valid entries to the left, in order; pad with 0.

    x: [..., B, T] (leading dims share the mask), mask: [B, T]. Returns (compact, dest) where
    dest [B, T] long is the compact index of each token (T for masked tokens); gathering the
    compact tensor (padded by one 0 column) with dest undoes the compaction.
    """
    B, T = mask.shape
    m = mask.bool()
    dest = torch.where(m, m.long().cumsum(1) - 1, torch.full_like(m, T, dtype=torch.long))
    out = x.new_zeros(*x.shape[:-1], T + 1)
    # masked tokens all land in the dump slot T, which is cut off below
    out.scatter_(-1, dest.expand_as(x), x * m.to(x.dtype))
    return out[..., :T], dest


def _is_prefix_mask(m: Tensor) -> bool:
    lengths = m.sum(1, keepdim=True)
    return bool((m == (torch.arange(m.shape[1], device=m.device) < lengths)).all())


@torch.no_grad()
def compute_gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: LamLike = 1.0
) -> tuple[Tensor, Tensor]:
    """Token-level GAE, S3AC Eq. (1), vectorised (no Python loop over tokens).

    rewards, values, mask: [B, T]; ``values[:, t] = V(s_t)``; rewards at masked tokens are ignored.
    lam: float or [B] tensor (per-sequence lambda, e.g. from :func:`length_adaptive_lambda`).
    Only valid tokens form the trajectory: delta_k = r_k + gamma * V(next valid token) - V_k, with
    V = 0 after the last valid token, and A_k = sum_l (gamma*lam)^l delta_{k+l} over valid tokens.
    Returns (advantages, returns), both [B, T] in values' dtype, 0 outside mask;
    ``returns = advantages + values``. No whitening. Accumulates in float64.
    With lam = 1 (gamma = 1) returns equal the Monte-Carlo return at every valid token.
    """
    if rewards.shape != values.shape or mask.shape != values.shape or values.ndim != 2:
        raise ValueError("rewards, values and mask must all be [B, T]")
    out_dtype = values.dtype if values.is_floating_point() else torch.float32
    f64 = torch.float64
    B, T = values.shape
    m = mask.bool()
    if _is_prefix_mask(m):
        # right padding (the common case): valid tokens are already contiguous, skip the scatter
        dest = None
        pad = ~m
        r_c = rewards.to(f64, copy=True).masked_fill_(pad, 0.0)
        v_c = values.to(f64, copy=True).masked_fill_(pad, 0.0)
    else:
        rv, dest = compact_valid(torch.stack([rewards.to(f64), values.to(f64)]), m)
        r_c, v_c = rv[0], rv[1]
    # compact rows are zero past their length, so V after the last valid token reads as 0
    delta = r_c.sub_(v_c)
    delta[:, :-1].add_(v_c[:, 1:], alpha=gamma)
    rho = gamma * _as_row_tensor(lam, B, delta)
    adv = discounted_reverse_cumsum(delta, rho)  # 0 past each row's length: delta is 0 there
    if dest is None:
        return adv.to(out_dtype), v_c.add_(adv).to(out_dtype)
    ret = adv + v_c
    both = F.pad(torch.stack([adv, ret]), (0, 1)).gather(-1, dest.expand(2, B, T))
    both.mul_(m.to(f64))
    return both[0].to(out_dtype), both[1].to(out_dtype)


def length_adaptive_lambda(lengths: Tensor, alpha: float) -> Tensor:
    """Per-sequence lambda = 1 - 1/(alpha * T) (VAPO; S3AC uses alpha = 1.5).

    lengths: [B] number of valid response tokens (int or float). Returns [B] float64, clamped to
    [0, 1] (alpha * T < 1 would give a negative lambda); rows with T <= 0 get 1.
    The terminal weight lambda**T tends to exp(-1/alpha) for long responses.
    """
    if alpha <= 0:
        raise ValueError("alpha must be positive")
    t = lengths.to(torch.float64)
    lam = 1.0 - 1.0 / (alpha * t.clamp(min=1e-12))
    return torch.where(t > 0, lam.clamp(0.0, 1.0), torch.ones_like(t))


def terminal_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Token rewards [B, T]: ``scores[b]`` on row b's last valid token, 0 elsewhere (0 rows stay 0)."""
    B, T = mask.shape
    m = mask.bool()
    idx = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(m, idx, torch.full_like(idx, -1)).amax(1)  # -1 when the row is empty
    out = torch.zeros(B, T, dtype=scores.dtype if scores.is_floating_point() else torch.float32, device=mask.device)
    has = last >= 0
    out[has.nonzero(as_tuple=True)[0], last[has]] = scores[has].to(out.dtype)
    return out


def _masked_mean_var(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = (((x - mean) ** 2) * m).sum() / (n - 1).clamp(min=1)  # Bessel, as verl's masked_whiten
    return mean, var


def _group_view(rewards: Tensor, group_size: int) -> Tensor:
    r = rewards.reshape(-1)
    if group_size <= 0 or r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards cannot be split into groups of {group_size}")
    return r.view(-1, group_size)


@torch.no_grad()
def grpo_advantages(
    rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6, mask: Tensor | None = None
) -> Tensor:
    """GRPO(-X) group baseline: (R - mean_group(R)) / (std_group(R) + eps).

    rewards: [N] (or [N/G, G]) with the G = group_size responses of a prompt contiguous.
    normalize_std=False gives the Dr.GRPO form R - mean. std is the unbiased (Bessel) estimate, as
    in verl; a group of size 1 gets advantage 0. Returns [N], or [N, T] broadcast onto ``mask``.
    """
    g = _group_view(rewards, group_size).to(torch.float64)
    adv = g - g.mean(1, keepdim=True)
    if normalize_std:
        std = g.std(1, keepdim=True) if group_size > 1 else torch.ones_like(adv)
        adv = adv / (std + eps)
    adv = adv.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)
    return adv if mask is None else adv[:, None] * mask.to(adv.dtype)


@torch.no_grad()
def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    group_size: int | None = None,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++ token advantages, whitened over all valid tokens of the batch.

    rewards: [B] outcome rewards (placed on the last valid token); mask: [B, T].
    group_size: if set, subtract the group mean first (REINFORCE++-baseline).
    kl: optional [B, T] per-token KL(pi_old || pi_ref) estimate put into the reward as -kl_coef * kl.
    Token return G_t = sum_{s >= t} gamma^(s-t) r_s over valid tokens; A = (G - mean) / sqrt(var + eps)
    with masked mean/var over the whole batch (pass the whole rollout batch, not a micro-batch).
    Returns [B, T], 0 outside mask.
    """
    r = rewards.to(torch.float64).reshape(-1)
    if group_size is not None:
        r = (_group_view(r, group_size) - _group_view(r, group_size).mean(1, keepdim=True)).reshape(-1)
    tok_r = terminal_rewards(r, mask)
    if kl is not None and kl_coef:
        tok_r = tok_r - kl_coef * kl.to(torch.float64) * mask.to(torch.float64)
    ret, _ = compute_gae(tok_r, torch.zeros_like(tok_r), mask, gamma=gamma, lam=1.0)
    mean, var = _masked_mean_var(ret, mask)
    adv = (ret - mean) * torch.rsqrt(var + eps) * mask.to(torch.float64)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


@torch.no_grad()
def flash_reinforce_advantages(rewards: Tensor, mask: Tensor | None = None) -> Tensor:
    """FlashREINFORCE advantage A_i = R_i - mean_batch(R) (single rollout, no std division).

    rewards: [B] over the whole rollout batch (centre before splitting into micro-batches / DP).
    Returns [B], or [B, T] broadcast onto ``mask``.
    """
    r = rewards.to(torch.float64)
    adv = (r - r.mean()).to(rewards.dtype if rewards.is_floating_point() else torch.float32)
    return adv if mask is None else adv[:, None] * mask.to(adv.dtype)


@torch.no_grad()
def flash_reinforce_trust_region(
    log_prob: Tensor, behavior_log_prob: Tensor, mask: Tensor, delta: float = 3e-3, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """FlashREINFORCE sequence-level trust region.

    log_prob (current policy) and behavior_log_prob (rollout policy mu): [B, T] log-probs of the
    sampled tokens. Per token, with p = mu(a_t), q = pi(a_t) clamped to [eps, 1 - eps], the Bernoulli
    KL d_t = p log(p/q) + (1-p) log((1-p)/(1-q)); D_i = mean over valid tokens (nats).
    Returns (admitted [B] bool: D_i <= delta, D [B] float).
    """
    m = mask.to(torch.float64)
    p = behavior_log_prob.detach().to(torch.float64).exp().clamp(eps, 1 - eps)
    q = log_prob.detach().to(torch.float64).exp().clamp(eps, 1 - eps)
    d = p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))
    seq = ((d * m).sum(1) / m.sum(1).clamp(min=1)).clamp(min=0)
    return seq <= delta, seq


__all__ = [
    "compute_gae",
    "discounted_reverse_cumsum",
    "length_adaptive_lambda",
    "terminal_rewards",
    "compact_valid",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "flash_reinforce_advantages",
    "flash_reinforce_trust_region",
]

"""Policy and value losses over [B, T] token tensors, with gradient-accumulation-safe aggregation.

Every loss takes ``mask`` [B, T] (0/1 valid response tokens) which defines the aggregation
denominator, and optional per-token multipliers that do NOT change the denominator:
  * ``is_weights``: detached importance weights (e.g. truncated train/rollout IS weights);
  * ``keep_mask``: 0/1 tokens to keep (IcePoP token mask, MIS sequence mask broadcast to tokens).
  (To drop tokens from the denominator as well, multiply them into ``mask`` instead.)

Aggregation (``agg_mode``), with N the denominator:
  * ``"token-mean"``: sum_{b,t} mask * l / N_tokens (S3AC, DAPO, CISPO default)
  * ``"seq-mean-token-mean"``: sum_b (sum_t mask * l / T_b) / N_seqs (FlashREINFORCE sample mean)
  * ``"seq-mean-token-sum"``: sum_{b,t} mask * l / N_seqs (BPCO)
  * ``"seq-mean-token-sum-norm"``: sum_{b,t} mask * l / (N_seqs * max_len) (Dr.GRPO)
By default N is counted on the tensors passed in (valid tokens; rows with >= 1 valid token).
Under gradient accumulation / data parallelism pass ``num_global_tokens`` (resp. ``num_global_seqs``):
the number of valid tokens (sequences) of the whole mini-batch over all micro-batches and all DP
ranks. Then the SUM over micro-batches and ranks of the returned losses (and of their gradients)
equals the loss of the whole mini-batch, instead of a mean of micro-batch means. If the DP gradient
reduction AVERAGES over ranks (Megatron's default), multiply the loss by the DP world size (or pass
``num_global_tokens / dp_size``).

Metrics are detached 0-d tensors (no host sync); ratios are local to the call, and ``num_tokens``
is returned so a trainer can token-weight them across micro-batches.
"""
from __future__ import annotations

import torch

Tensor = torch.Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# log-ratio clamp before exp: keeps exp finite for any log-prob gap (same bound as verl/slime)
_LOG_RATIO_CLAMP = 20.0


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    agg_mode: str = "token-mean",
    num_global_tokens: float | Tensor | None = None,
    num_global_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar; see the module docstring for modes/denominators.

    Masked tokens never contribute (their loss may be inf/nan: it is selected away, not multiplied).
    """
    m = mask.to(loss_mat.dtype)
    lm = torch.where(mask.bool(), loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    if agg_mode == "token-mean":
        denom = m.sum().clamp(min=1) if num_global_tokens is None else num_global_tokens
        return lm.sum() / denom
    n_seq = (m.sum(1) > 0).sum().clamp(min=1) if num_global_seqs is None else num_global_seqs
    if agg_mode == "seq-mean-token-mean":
        return (lm.sum(1) / m.sum(1).clamp(min=1)).sum() / n_seq
    if agg_mode == "seq-mean-token-sum":
        return lm.sum() / n_seq
    if agg_mode == "seq-mean-token-sum-norm":
        if max_len is None:
            raise ValueError("seq-mean-token-sum-norm needs max_len (the constant length normaliser)")
        return lm.sum() / (n_seq * max_len)
    raise ValueError(f"unknown agg_mode {agg_mode!r}; expected one of {AGG_MODES}")


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x [B, T] over mask; 0 when the mask is empty."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def _ratio(log_prob: Tensor, old_log_prob: Tensor) -> tuple[Tensor, Tensor]:
    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return log_ratio.exp(), log_ratio


def _apply_multipliers(loss_mat: Tensor, is_weights: Tensor | None, keep_mask: Tensor | None) -> Tensor:
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach().to(loss_mat.dtype)
    if keep_mask is not None:
        loss_mat = loss_mat * keep_mask.detach().to(loss_mat.dtype)
    return loss_mat


def _common_metrics(log_ratio: Tensor, ratio: Tensor, mask: Tensor, keep_mask: Tensor | None) -> dict:
    with torch.no_grad():
        m = mask.bool()
        lr, r = log_ratio.detach().float(), ratio.detach().float()
        out = {
            "approx_kl": masked_mean(-lr, m),  # k1 estimate of KL(old || new)
            "approx_kl_k3": masked_mean(r - 1 - lr, m),
            "ratio_mean": masked_mean(r, m),
            "ratio_max": torch.where(m, r, torch.zeros_like(r)).max() if r.numel() else r.new_zeros(()),
            "num_tokens": m.sum().float(),
        }
        if keep_mask is not None:
            out["keep_frac"] = masked_mean(keep_mask.detach().float(), m)
    return out


def cispo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    *,
    is_weights: Tensor | None = None,
    keep_mask: Tensor | None = None,
    agg_mode: str = "token-mean",
    num_global_tokens: float | Tensor | None = None,
    num_global_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, dict]:
    """CISPO, S3AC Eq. (2): per token l = -sg(clip(r, 1 - eps_low, 1 + eps_high) * A) * log pi.

    log_prob (with grad), old_log_prob, advantages, mask: [B, T]; r = pi / pi_old (log-ratio
    clamped to +-20). No token is dropped by the clip: clipped tokens keep the gradient
    clip(r) * A * grad log pi. eps_low >= 1 removes the lower bound (canonical CISPO).
    Returns (loss scalar, metrics) with clip_frac / clip_frac_high / clip_frac_low (fractions of
    valid tokens whose ratio was clipped), approx_kl, ratio stats, num_tokens, keep_frac.
    """
    ratio, log_ratio = _ratio(log_prob, old_log_prob.detach())
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    coef = (clipped * advantages).detach()
    loss_mat = _apply_multipliers(-coef * log_prob, is_weights, keep_mask)
    loss = agg_loss(loss_mat, mask, agg_mode, num_global_tokens, num_global_seqs, max_len)
    metrics = _common_metrics(log_ratio, ratio, mask, keep_mask)
    with torch.no_grad():
        r = ratio.detach()
        hi, lo = r > 1.0 + eps_high, r < 1.0 - eps_low
        metrics.update(
            clip_frac=masked_mean((hi | lo).float(), mask),
            clip_frac_high=masked_mean(hi.float(), mask),
            clip_frac_low=masked_mean(lo.float(), mask),
        )
    return loss, metrics


def ppo_clip_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip_c: float | None = None,
    *,
    is_weights: Tensor | None = None,
    keep_mask: Tensor | None = None,
    agg_mode: str = "token-mean",
    num_global_tokens: float | Tensor | None = None,
    num_global_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, dict]:
    """PPO clipped surrogate with clip-higher (DAPO) and optional dual clip.

    l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); with dual_clip_c = c > 1, tokens with
    A < 0 use min(l, -A c) (bounds the loss of very large ratios). Shapes [B, T].
    Metrics: clip_frac (tokens where the clipped branch is active), clip_frac_dual, approx_kl, ...
    """
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError("dual_clip_c must be > 1")
    ratio, log_ratio = _ratio(log_prob, old_log_prob.detach())
    adv = advantages.detach()
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss_mat = torch.maximum(pg1, pg2)
    dual = torch.zeros_like(pg1, dtype=torch.bool)
    if dual_clip_c is not None:
        pg3 = -adv * dual_clip_c
        dual = (adv < 0) & (loss_mat > pg3)
        loss_mat = torch.where(dual, pg3, loss_mat)
    loss_mat = _apply_multipliers(loss_mat, is_weights, keep_mask)
    loss = agg_loss(loss_mat, mask, agg_mode, num_global_tokens, num_global_seqs, max_len)
    metrics = _common_metrics(log_ratio, ratio, mask, keep_mask)
    with torch.no_grad():
        metrics.update(
            clip_frac=masked_mean((pg2 > pg1).float(), mask),
            clip_frac_dual=masked_mean(dual.float(), mask),
        )
    return loss, metrics


def dppo_tv_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    delta_low: float = 0.2,
    delta_high: float = 0.2,
    *,
    is_weights: Tensor | None = None,
    keep_mask: Tensor | None = None,
    agg_mode: str = "token-mean",
    num_global_tokens: float | Tensor | None = None,
    num_global_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, dict]:
    """DPPO binary-TV trust region (used by BPCO): l = -A * r * valid, no ratio clip.

    valid = (p - p_old <= delta_high) where A > 0, (p - p_old >= -delta_low) elsewhere, with
    p = exp(log_prob) the sampled-token probability (a TV distance in probability units, not a
    ratio). valid is detached; gradient -A r grad log pi flows on valid tokens only.
    Metrics: tv_mask_frac (valid tokens outside the trust region), approx_kl, ...
    """
    ratio, log_ratio = _ratio(log_prob, old_log_prob.detach())
    adv = advantages.detach()
    with torch.no_grad():
        dp = log_prob.detach().exp() - old_log_prob.detach().exp()
        valid = torch.where(adv > 0, dp <= delta_high, dp >= -delta_low)
    loss_mat = _apply_multipliers(-adv * ratio * valid.to(ratio.dtype), is_weights, keep_mask)
    loss = agg_loss(loss_mat, mask, agg_mode, num_global_tokens, num_global_seqs, max_len)
    metrics = _common_metrics(log_ratio, ratio, mask, keep_mask)
    metrics["tv_mask_frac"] = masked_mean((~valid).float(), mask)
    return loss, metrics


def flash_reinforce_loss(
    log_prob: Tensor,
    behavior_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    delta: float = 3e-3,
    *,
    num_global_seqs: float | Tensor | None = None,
) -> tuple[Tensor, dict]:
    """FlashREINFORCE objective with its sequence-level trust region (its original form).

    advantages: [B] (R - batch mean, see ``flash_reinforce_advantages``) or [B, T]; others [B, T].
    loss = -(1/N_seqs) sum_b admitted_b * A_b / T_b * sum_t sg(pi/mu) log pi, with an UNCLIPPED
    detached ratio; a row is admitted iff its mean Bernoulli KL <= delta
    (``flash_reinforce_trust_region``). Rejected rows stay in N_seqs and T_b (as the paper does).
    """
    from .advantages import flash_reinforce_trust_region

    admitted, seq_kl = flash_reinforce_trust_region(log_prob, behavior_log_prob, mask, delta)
    ratio, log_ratio = _ratio(log_prob, behavior_log_prob.detach())
    adv = advantages[:, None] if advantages.ndim == 1 else advantages  # [B] or already broadcast [B, T]
    coef = (ratio * adv * admitted[:, None].to(ratio.dtype)).detach()
    loss = agg_loss(-coef * log_prob, mask, "seq-mean-token-mean", num_global_seqs=num_global_seqs)
    metrics = _common_metrics(log_ratio, ratio, mask, None)
    metrics.update(admitted_frac=admitted.float().mean(), seq_kl_mean=seq_kl.float().mean())
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float | None,
    *,
    agg_mode: str = "token-mean",
    num_global_tokens: float | Tensor | None = None,
    num_global_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, dict]:
    """Clipped critic loss, S3AC Eq. (3): 1/2 * max((V - R)^2, (clip(V, V_old +- clip_eps) - R)^2).

    values (with grad), old_values, returns (targets; Monte-Carlo R for S3AC), mask: [B, T].
    clip_eps=None gives the plain 1/2 (V - R)^2. Averaged over valid tokens (agg_mode).
    Metrics: vf_clip_frac (tokens where the clipped term is the larger), value_mean, num_tokens.
    """
    ret = returns.detach()
    err = (values - ret) ** 2
    if clip_eps is None:
        loss_mat = 0.5 * err
        active = torch.zeros_like(err, dtype=torch.bool)
    else:
        old = old_values.detach()
        v_clip = old + (values - old).clamp(-clip_eps, clip_eps)
        err_c = (v_clip - ret) ** 2
        loss_mat = 0.5 * torch.maximum(err, err_c)
        active = err_c.detach() > err.detach()
    loss = agg_loss(loss_mat, mask, agg_mode, num_global_tokens, num_global_seqs, max_len)
    with torch.no_grad():
        metrics = {
            "vf_clip_frac": masked_mean(active.float(), mask),
            "value_mean": masked_mean(values.detach().float(), mask),
            "num_tokens": mask.to(torch.float32).sum(),
        }
    return loss, metrics


__all__ = [
    "AGG_MODES",
    "agg_loss",
    "masked_mean",
    "cispo_loss",
    "ppo_clip_loss",
    "dppo_tv_loss",
    "flash_reinforce_loss",
    "value_loss",
]

"""Per-micro-batch loss functions for ``models.pipeline.forward_backward``: (loss_sum, count, metrics).

Losses are sums; megatron divides by the global ``count`` (calculate_per_token_loss), so a mini-batch
is a true token (or sequence) mean over micro-batches and DP ranks (with CP, ``per_token`` gathers the
sequence and ``cp_count`` reports the count once per CP group). ``metrics["num_tokens"]`` weighs
this micro-batch's metrics (trainer.step.metrics.token_means); ``loss_sum`` lets the runner skip a step
whose loss is not finite.
"""
from __future__ import annotations

import torch

from megatron_s3ac import algorithms as A
from megatron_s3ac.algorithms.registry import PolicyLossInputs, get_policy_loss
from megatron_s3ac.trainer.step.batch import MicroBatch, cp_count, next_token_targets, per_token


def actor_loss(mb: MicroBatch, logits: torch.Tensor, *, policy_loss: str, algo_cfg, vocab_size: int,
               temperature: float, chunk_tokens: int | None = None):
    """The registered policy loss ``policy_loss`` on one micro-batch's logits [b, s, V/TP]."""
    from megatron_s3ac.models.logprobs import vocab_parallel_log_probs

    fn, normalizer = get_policy_loss(policy_loss)
    targets = next_token_targets(mb)
    logp = per_token(vocab_parallel_log_probs(logits, targets, vocab_size, temperature, chunk_tokens=chunk_tokens), mb)
    mask = mb.mask
    loss, met = fn(PolicyLossInputs(logp, mb.old_logp, mb.rollout_logp, mb.adv, mask, is_weights=mb.is_w,
                                    keep_mask=mb.keep), algo_cfg)
    count = (mask.sum(1) > 0).sum() if normalizer == "seqs" else mask.sum()
    met["num_tokens"] = mask.sum()
    met["loss_sum"] = loss.detach()
    return loss, cp_count(count.long().clamp(min=0)), met


def critic_loss(mb: MicroBatch, values_all: torch.Tensor, *, value_clip: float):
    """Clipped value loss (S3AC Eq. 3) against ``mb.returns``; ``value_loss_tok``: per-token loss."""
    mask = mb.mask
    values = per_token(values_all, mb)
    loss, met = A.value_loss(values, mb.old_values, mb.returns, mask, value_clip, num_global_tokens=1)
    met["num_tokens"] = mask.sum()
    met["loss_sum"] = loss.detach()
    met["value_loss_tok"] = (loss.detach() / mask.sum().clamp(min=1))
    return loss, cp_count(mask.sum().long()), met


def forward_outputs(mb: MicroBatch, out: torch.Tensor, *, what: str, vocab_size: int, temperature: float,
                    chunk_tokens: int | None = None):
    """Forward-only "loss": per-token outputs of one micro-batch. what: "values" (critic), "logp"
    (log-probs + entropy) or "native_logp" (log-probs only)."""
    from megatron_s3ac.models.logprobs import vocab_parallel_entropy, vocab_parallel_log_probs

    if what == "values":
        res = {"values": per_token(out, mb).detach()}
    else:
        lp = vocab_parallel_log_probs(out, next_token_targets(mb), vocab_size, temperature,
                                      chunk_tokens=chunk_tokens)
        res = {"logp": per_token(lp, mb).detach()}
        if what == "logp":
            res["entropy"] = per_token(vocab_parallel_entropy(out, vocab_size, temperature, chunk_tokens=chunk_tokens), mb)
    return torch.zeros(()), torch.tensor(1), res

"""Token log-probs and entropy from TP-sharded logits over a padded vocabulary.

The actor's logits are [b, s, V_pad / tp] on each TP rank. Columns >= the real vocab size are padding
and must not take probability mass, so they are masked to -inf before any softmax. Temperature is
applied here (logits / T) so the trainer's log-probs are the behaviour policy's at the same T.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), \
        ps.get_tensor_model_parallel_group()


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, temperature: float = 1.0,
                      fresh_copy: bool = False) -> torch.Tensor:
    """fp32 logits / T with padded-vocab columns of this TP shard set to -inf. [..., V_local].

    May return ``logits`` itself (fp32, T = 1, no padding here) unless ``fresh_copy``."""
    rank, _, _ = _tp()
    v_local = logits.shape[-1]
    # The logits are [b, s, V/tp] and large (151936 columns for Qwen): make at most one fp32 copy.
    # Only a shard that holds padded columns is masked; T = 1 skips the division.
    out = logits.float()
    fresh = out is not logits
    if temperature != 1.0:
        out = out.div_(temperature) if fresh else out / temperature
        fresh = True
    first_pad = vocab_size - rank * v_local  # local index of the first padded column
    if not fresh and (fresh_copy or first_pad < v_local):
        out = out.clone()
    if first_pad < v_local:
        out[..., max(first_pad, 0):] = float("-inf")
    return out


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                             temperature: float = 1.0) -> torch.Tensor:
    """log p(targets) from sharded logits. logits [b, s, V_local], targets [b, s] -> [b, s] (differentiable)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # megatron's cross-entropy works in place on its input: never hand it the model's logits.
    masked = mask_padded_vocab(logits, vocab_size, temperature, fresh_copy=True)
    return -vocab_parallel_cross_entropy(masked, targets)


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) over the real vocab, [b, s] (a metric: no gradient)."""
    _, world, group = _tp()
    z = mask_padded_vocab(logits, vocab_size, temperature)
    zmax = z.max(-1).values
    if world > 1:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - zmax.unsqueeze(-1))
    sumexp = e.sum(-1)
    # sum p * z with p = e / sumexp; padded columns have e = 0 and z = -inf -> define 0 * -inf = 0
    ez = torch.where(e > 0, e * z, torch.zeros_like(e)).sum(-1)
    if world > 1:
        dist.all_reduce(sumexp, group=group)
        dist.all_reduce(ez, group=group)
    return zmax + torch.log(sumexp) - ez / sumexp


@torch.no_grad()
def gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """All-gather TP vocab shards and strip padding: [b, s, V_local] -> [b, s, vocab_size]."""
    _, world, group = _tp()
    if world > 1:
        parts = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab_size]

"""Token log-probs and entropy from TP-sharded logits over a padded vocabulary.

The actor's logits are [b, s, V_pad / tp] on each TP rank. Columns >= the real vocab size are padding
and must not take probability mass, so they are masked to -inf before any softmax. Temperature is
applied here (logits / T) so the trainer's log-probs are the behaviour policy's at the same T.

Memory: with ``chunk_tokens`` the fp32 work (masked copy, softmax) runs over at most that many tokens
at a time, so a 248K vocabulary at 16K tokens never holds more than one chunk of fp32 logits
(2K tokens x 248,320 x 4 B = 2.0 GB instead of 16.3 GB at TP=1; divide by TP).
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
                             temperature: float = 1.0, chunk_tokens: int | None = None) -> torch.Tensor:
    """log p(targets) from sharded logits. logits [b, s, V_local], targets [b, s] -> [b, s] (differentiable).

    ``chunk_tokens``: process at most that many tokens' fp32 logits at a time, forward and backward
    (``_ChunkedLogProbs``); None = megatron's vocab_parallel_cross_entropy on one fp32 copy of all."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if chunk_tokens:
        return _ChunkedLogProbs.apply(logits, targets, vocab_size, float(temperature), int(chunk_tokens))

    # megatron's cross-entropy works in place on its input: never hand it the model's logits.
    masked = mask_padded_vocab(logits, vocab_size, temperature, fresh_copy=True)
    return -vocab_parallel_cross_entropy(masked, targets)


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor, vocab_size: int, temperature: float = 1.0,
                           chunk_tokens: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits / T) over the real vocab, [b, s] (a metric: no gradient).
    ``chunk_tokens``: at most that many tokens' fp32 logits at a time."""
    if chunk_tokens:
        flat = logits.reshape(-1, logits.shape[-1])
        out = torch.cat([_entropy(flat[i:i + chunk_tokens], vocab_size, temperature)
                         for i in range(0, flat.shape[0], chunk_tokens)])
        return out.view(logits.shape[:-1])
    return _entropy(logits, vocab_size, temperature)


def _entropy(logits: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    _, world, group = _tp()
    z = mask_padded_vocab(logits, vocab_size, temperature)
    zmax = z.max(-1).values
    if world > 1:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    e = (z - zmax.unsqueeze(-1)).exp_()  # one temporary the size of z, the rest in place
    sumexp = e.sum(-1)
    # sum p * z with p = e / sumexp; padded columns have e = 0 and z = -inf -> define 0 * -inf = 0
    ez = e.mul_(z).nan_to_num_(nan=0.0).sum(-1)
    del e
    if world > 1:
        dist.all_reduce(sumexp, group=group)
        dist.all_reduce(ez, group=group)
    return zmax + torch.log(sumexp) - ez / sumexp


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float):
    """One chunk: fp32 z = masked logits / T [n, V_local], its TP-global max [n] and log-sum-exp [n],
    and the target's local column (-1 if another TP rank holds it) [n]."""
    rank, world, group = _tp()
    z = mask_padded_vocab(logits, vocab_size, temperature)
    zmax = z.max(-1).values
    if world > 1:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    e = (z - zmax.unsqueeze(-1)).exp_()  # one temporary the size of z
    sumexp = e.sum(-1)
    del e
    if world > 1:
        dist.all_reduce(sumexp, group=group)
    v_local = logits.shape[-1]
    col = targets - rank * v_local
    col = torch.where((col >= 0) & (col < v_local), col, torch.full_like(col, -1))
    return z, zmax + torch.log(sumexp), col


class _ChunkedLogProbs(torch.autograd.Function):
    """log p(target) over TP-sharded logits, ``chunk`` tokens at a time, forward and backward.

    Memory: the fp32 copy of the logits (and its softmax temporaries) exists for one chunk at a time
    ([chunk, V_local] fp32 each), never for all tokens; backward recomputes each chunk's softmax from
    the saved logits and per-token log-sum-exp ([N] fp32) and writes the gradient chunk by chunk
    into one tensor of the logits' dtype (the size autograd needs anyway).
    d log p_t / d z = onehot(t) - softmax(z); z = logits / T (padded columns: p = 0, no gradient).
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_size, temperature, chunk):
        _, world, group = _tp()
        flat = logits.reshape(-1, logits.shape[-1])
        tflat = targets.reshape(-1)
        n = flat.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for i in range(0, n, chunk):
            z, lse_c, col = _chunk_stats(flat[i:i + chunk], tflat[i:i + chunk], vocab_size, temperature)
            zt = z.gather(-1, col.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            zt = torch.where(col >= 0, zt, torch.zeros_like(zt))  # a padding-only shard has z = -inf
            if world > 1:
                dist.all_reduce(zt, group=group)
            lp[i:i + chunk] = zt - lse_c
            lse[i:i + chunk] = lse_c
            del z
        ctx.save_for_backward(logits, targets, lse)
        ctx.args = (vocab_size, temperature, chunk)
        return lp.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_lp):
        logits, targets, lse = ctx.saved_tensors
        vocab_size, temperature, chunk = ctx.args
        rank, _, _ = _tp()
        flat = logits.reshape(-1, logits.shape[-1])
        tflat = targets.reshape(-1)
        g = grad_lp.reshape(-1).float()
        grad = torch.empty_like(flat)
        v_local = flat.shape[-1]
        for i in range(0, flat.shape[0], chunk):
            z = mask_padded_vocab(flat[i:i + chunk], vocab_size, temperature, fresh_copy=True)
            gi = g[i:i + chunk]
            p = z.sub_(lse[i:i + chunk].unsqueeze(-1)).exp_()  # softmax, in place of z
            p.mul_(-gi.unsqueeze(-1))
            col = tflat[i:i + chunk] - rank * v_local
            hit = (col >= 0) & (col < v_local)
            rows = hit.nonzero().squeeze(-1)
            p[rows, col[rows]] += gi[rows]
            if temperature != 1.0:
                p.div_(temperature)
            grad[i:i + chunk] = p
            del p, z
        return grad.view(logits.shape), None, None, None, None


@torch.no_grad()
def gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """All-gather TP vocab shards and strip padding: [b, s, V_local] -> [b, s, vocab_size]."""
    _, world, group = _tp()
    if world > 1:
        parts = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab_size]

"""Context parallelism (CP) for the project's torch core attention and Gated DeltaNet.

Sequence split: megatron's load-balanced split. A sequence of length s (a multiple of 2 x cp) is cut
into 2 x cp equal chunks; CP rank r holds chunks r and 2cp-1-r, so every rank gets the same causal
attention work (an early chunk with few keys and a late one with many). A rank's local sequence is
those two chunks back to back, [s / cp]. megatron's rotary embedding slices its table the same way
(``rope_utils.get_pos_emb_on_this_cp_rank``), so RoPE uses global positions with no position ids.

Attention (``cp_core_attention``): all-gather of K/V over the CP group (megatron's sequence-parallel
gather with a reduce-scatter backward, ``gather_from_sequence_parallel_region(group=cp)``), then SDPA
of the rank's queries against all keys, with the mask rows of the rank's query positions and the
columns in gathered (rank-major) order: exact forward, and exact backward (dK / dV of every rank's
queries are summed onto the rank that owns those keys). Memory per layer: K / V of the whole sequence
(2 x s x kv_heads/tp x head_dim), the same as megatron's ``cp_comm_type='all_gather'``.

On GPUs with Transformer Engine the TE layer spec is used (``models.specs``) and TE's own CP
attention runs (``TransformerConfig.cp_comm_type``, default ``'p2p'``: a ring exchanging K/V
blocks); this module is the torch spec's path (CPU, and GPUs without TE).

Gated DeltaNet: a head-parallel all-to-all, megatron-core 0.19.2's own (``ssm/gated_delta_net/gdn.py:134-164``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def cp_group_info():
    """(rank, size, group) of this rank's context-parallel group (size 1 when CP is off, and outside megatron's
    parallel state: host-side code such as collate / per_token in unit tests)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    size = ps.get_context_parallel_world_size()  # megatron answers 0 when torch.distributed is not initialized
    if size <= 1:
        return 0, 1, None
    return ps.get_context_parallel_rank(), size, ps.get_context_parallel_group()


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two of the 2 x cp chunks CP rank ``rank`` holds: (rank, 2cp-1-rank)."""
    return rank, 2 * cp - 1 - rank


def local_positions(s: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions [s / cp] of the tokens CP rank ``rank`` holds of a length-``s`` sequence."""
    if s % (2 * cp):
        raise ValueError(f"sequence length {s} is not a multiple of 2 x cp = {2 * cp}")
    c = s // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(cp, rank)])


def gathered_positions(s: int, cp: int, device=None) -> torch.Tensor:
    """Global positions [s] in all-gather order (rank 0's tokens, then rank 1's, ...)."""
    return torch.cat([local_positions(s, cp, r, device) for r in range(cp)])


def split_for_cp(t: torch.Tensor, dim: int, cp: int | None = None, rank: int | None = None) -> torch.Tensor:
    """This CP rank's part of ``t`` along ``dim`` (the sequence dim): its two chunks, back to back."""
    if cp is None:
        rank, cp, _ = cp_group_info()
    if cp == 1:
        return t
    s = t.shape[dim]
    return t.index_select(dim, local_positions(s, cp, rank, t.device))


def pad_len(s: int, multiple: int) -> int:
    """``s`` rounded up to ``multiple`` (a layout's ``seq_multiple``)."""
    return -(-s // multiple) * multiple


class _GatherSeq(torch.autograd.Function):
    """All-gather along ``dim`` over the CP group into global order; backward: this rank's slice of the
    gradient (every CP rank computes the same function of the gathered tensor, so no sum)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        g = torch.cat(parts, dim)
        s = g.shape[dim]
        inv = torch.argsort(gathered_positions(s, cp, x.device))  # global position -> gathered index
        ctx.dim, ctx.cp, ctx.rank = dim, cp, rank
        return g.index_select(dim, inv)

    @staticmethod
    def backward(ctx, grad):
        return split_for_cp(grad, ctx.dim, ctx.cp, ctx.rank), None, None


def gather_from_cp(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Per-position outputs of this rank's tokens [.., s / cp, ..] -> the whole sequence in global
    order [.., s, ..] on every CP rank (differentiable: backward keeps this rank's slice). The identity
    when CP is off. Meant for small per-token tensors (log-probs, values, entropy), not logits."""
    _, cp, group = cp_group_info()
    if cp == 1:
        return x
    return _GatherSeq.apply(x, dim, group)


def _local_mask(attention_mask, sq: int, cp: int, rank: int, device) -> torch.Tensor:
    """Allowed-mask (True = attend) [b|1, 1, sq, s] of this rank's queries over the gathered keys.
    ``attention_mask``: megatron's convention (True = masked) over global positions [b, 1, s, s] or
    None (causal)."""
    s = sq * cp
    qpos = local_positions(s, cp, rank, device)
    kpos = gathered_positions(s, cp, device)
    if attention_mask is None:
        return (kpos[None, :] <= qpos[:, None])[None, None]
    if attention_mask.shape[-2:] != (s, s):
        raise ValueError(f"context parallel: attention_mask must cover the whole sequence [.., {s}, {s}], "
                         f"got {tuple(attention_mask.shape)}")
    return ~attention_mask.index_select(-2, qpos).index_select(-1, kpos)


def cp_core_attention(query, key, value, attention_mask, softmax_scale, dropout_p, group):
    """SDPA of this rank's queries over the whole sequence's keys.
    query [sq, b, np, hn], key / value [sq, b, ng, hn] (this rank's tokens, RoPE applied) -> [sq, b, np*hn]."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    sq, b, np_, hn = query.shape
    # [sq, b, ng, hn] -> [s, b, ng, hn], rank-major; backward reduce-scatters dK / dV
    k = gather_from_sequence_parallel_region(key.contiguous(), True, group)
    v = gather_from_sequence_parallel_region(value.contiguous(), True, group)
    q = query.permute(1, 2, 0, 3)
    k = k.permute(1, 2, 0, 3)
    v = v.permute(1, 2, 0, 3)
    if k.shape[1] != np_:  # GQA: expand kv groups to query heads (after the gather: less traffic)
        rep = np_ // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    allowed = _local_mask(attention_mask, sq, cp, rank, query.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=softmax_scale)
    return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


class _RingShift(torch.autograd.Function):
    """One ring step: send ``x`` to the next CP rank, receive the previous rank's. Backward is the
    transpose (send the gradient back to the previous rank, receive the next rank's), so autograd
    carries every dK / dV back, hop by hop, to the rank that owns those keys."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _shift(x, group, +1)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad, ctx.group, -1), None


def _shift(x: torch.Tensor, group, step: int) -> torch.Tensor:
    """Send ``x`` to CP rank r + step, return what rank r - step sent (isend / irecv pair, both
    posted before either waits, so the ring cannot deadlock)."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    out = torch.empty_like(x)
    dst = dist.get_global_rank(group, (r + step) % cp)
    src = dist.get_global_rank(group, (r - step) % cp)
    reqs = [dist.isend(x, dst, group=group), dist.irecv(out, src, group=group)]
    for q in reqs:
        q.wait()
    return out


_MASKED = -1e30  # finite "minus infinity": a query row with no allowed key in a block stays NaN-free


def _block_attention(q, k, v, allowed, scale):
    """Attention of q [b, np, sq, hn] over one K / V block [b, np, sk, hn] with allowed [b|1, 1, sq, sk]:
    (out [b, np, sq, hn] normalised within the block, lse [b, np, sq, 1]). A row with no allowed key
    gets lse ~ -1e30, so its block weight exp(lse - lse_total) in the merge is exactly 0."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, _MASKED)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v), lse


def cp_ring_attention(query, key, value, attention_mask, softmax_scale, dropout_p, group):
    """Ring attention (``cp_comm: ring``): the same function as ``cp_core_attention``. Step i: this rank
    attends its queries to the K / V block of CP rank r - i (mask rows of its query positions, columns of
    that rank's key positions), then passes the block on to rank r + 1 (``_RingShift``); the cp partial
    results merge by their log-sum-exp (online softmax: out = sum_i exp(lse_i - lse) out_i). Backward is
    torch autograd through the ring (each hop's transpose sends dK / dV back), exact like the forward.
    query [sq, b, np, hn], key / value [sq, b, ng, hn] -> [sq, b, np*hn]. Memory: autograd keeps every
    received block and its [sq, sq] scores for backward, so the torch ring saves no activation memory
    over the all-gather; it replaces one collective by cp - 1 neighbour exchanges."""
    if dropout_p:
        raise NotImplementedError("cp_comm=ring: attention dropout is not supported (set attention_dropout=0)")
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    sq, b, np_, hn = query.shape
    s = sq * cp
    scale = softmax_scale if softmax_scale is not None else hn ** -0.5
    q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
    qpos = local_positions(s, cp, rank, query.device)
    if attention_mask is not None and attention_mask.shape[-2:] != (s, s):
        raise ValueError(f"context parallel: attention_mask must cover the whole sequence [.., {s}, {s}], "
                         f"got {tuple(attention_mask.shape)}")
    rows = None if attention_mask is None else ~attention_mask.index_select(-2, qpos)  # allowed [b|1, 1, sq, s]
    kv = torch.cat([key, value], -1)  # one message per hop: [sq, b, ng, 2 hn]
    outs, lses = [], []
    for i in range(cp):
        if i:
            kv = _RingShift.apply(kv, group)
        src = (rank - i) % cp  # whose keys this block holds
        kpos = local_positions(s, cp, src, query.device)
        allowed = ((kpos[None, :] <= qpos[:, None])[None, None] if rows is None
                   else rows.index_select(-1, kpos))
        k, v = kv.permute(1, 2, 0, 3).split(hn, dim=-1)  # [b, ng, sq, hn]
        if k.shape[1] != np_:  # GQA: expand kv groups to query heads (after the hop: less traffic)
            rep = np_ // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o, lse = _block_attention(q, k, v, allowed, scale)
        outs.append(o)
        lses.append(lse)
    lse_all = torch.stack(lses)  # [cp, b, np, sq, 1]
    w = torch.exp(lse_all - torch.logsumexp(lse_all, dim=0, keepdim=True))
    out = (w * torch.stack(outs)).sum(0)  # [b, np, sq, hn]
    return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


# ``ParallelLayout.cp_comm`` -> the torch core attention's CP function (same signature, same result)
CP_ATTENTION = {"allgather": cp_core_attention, "ring": cp_ring_attention}
CP_COMMS = tuple(CP_ATTENTION)

"""Packed-sequence (THD) layout helpers: convert to/from the padded [B, T] layout.

Packed tensors are flat [total] (or [1, total]) token streams holding sequences back to back;
``cu_seqlens`` [n + 1] (int, cu_seqlens[0] = 0) gives their boundaries, as in flash-attention /
Megatron THD. Every function of this package runs on the padded layout; these helpers move data
between the two without Python loops over tokens or sequences.
"""
from __future__ import annotations

import torch

from .advantages import LamLike, compute_gae

Tensor = torch.Tensor


def _seq_positions(cu_seqlens: Tensor, total: int) -> tuple[Tensor, Tensor, int]:
    cu = cu_seqlens.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    if seq.numel() != total:
        raise ValueError(f"cu_seqlens covers {seq.numel()} tokens but the packed tensor has {total}")
    pos = torch.arange(total, device=cu.device) - cu[:-1][seq]
    max_len = int(lengths.max()) if lengths.numel() else 0
    return seq, pos, max_len


def packed_to_padded(x: Tensor, cu_seqlens: Tensor, max_len: int | None = None, pad_value: float = 0.0) -> tuple[Tensor, Tensor]:
    """[total] (or [1, total]) packed -> ([n, max_len] padded, [n, max_len] bool mask of real tokens)."""
    flat = x.reshape(-1)
    seq, pos, longest = _seq_positions(cu_seqlens, flat.numel())
    T = longest if max_len is None else max_len
    if T < longest:
        raise ValueError("max_len is shorter than the longest sequence")
    n = cu_seqlens.numel() - 1
    out = flat.new_full((n, T), pad_value)
    out[seq, pos] = flat
    present = torch.zeros(n, T, dtype=torch.bool, device=flat.device)
    present[seq, pos] = True
    return out, present


def padded_to_packed(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """[n, T] padded (sequence i in row i, left-aligned) -> [total] packed."""
    total = int(cu_seqlens[-1])
    seq, pos, _ = _seq_positions(cu_seqlens, total)
    return x[seq, pos]


def compute_gae_packed(
    rewards: Tensor, values: Tensor, mask: Tensor, cu_seqlens: Tensor, gamma: float = 1.0, lam: LamLike = 1.0
) -> tuple[Tensor, Tensor]:
    """:func:`compute_gae` on packed [total] tensors; ``mask`` marks response tokens (prompt tokens
    of a packed prompt+response stream are simply masked). lam: float or [n] per sequence.
    Returns (advantages, returns) packed [total], 0 outside mask."""
    r, _ = packed_to_padded(rewards, cu_seqlens)
    v, _ = packed_to_padded(values, cu_seqlens)
    m, _ = packed_to_padded(mask.to(torch.float32), cu_seqlens)
    adv, ret = compute_gae(r, v, m, gamma=gamma, lam=lam)
    shape = rewards.shape
    return padded_to_packed(adv, cu_seqlens).reshape(shape), padded_to_packed(ret, cu_seqlens).reshape(shape)


__all__ = ["packed_to_padded", "padded_to_packed", "compute_gae_packed"]

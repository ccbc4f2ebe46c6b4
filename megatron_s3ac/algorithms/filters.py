"""DAPO dynamic sampling: drop groups whose rewards carry no learning signal (all equal)."""
from __future__ import annotations

import torch

Tensor = torch.Tensor


@torch.no_grad()
def dynamic_sampling_filter(
    rewards: Tensor,
    group_size: int | None = None,
    group_ids: Tensor | None = None,
    atol: float = 0.0,
) -> tuple[Tensor, dict]:
    """Keep trajectories whose group has at least two different rewards (0 < #correct < G).

    rewards: [N] per-trajectory outcome rewards. Groups are either contiguous blocks of
    ``group_size`` or given by ``group_ids`` [N] (any integers, any order). Rewards within
    ``atol`` of each other count as equal.
    Returns (keep [N] bool, stats) with stats (python ints): kept_groups, discarded_groups,
    kept_trajectories, discarded_trajectories, and discarded_all_positive /
    discarded_all_nonpositive (discarded groups split by the sign of their common reward: all
    correct vs all wrong under R in {-1, +1}).
    """
    r = rewards.reshape(-1).to(torch.float64)
    if (group_size is None) == (group_ids is None):
        raise ValueError("pass exactly one of group_size or group_ids")
    if group_ids is None:
        if group_size <= 0 or r.numel() % group_size:
            raise ValueError(f"{r.numel()} rewards cannot be split into groups of {group_size}")
        inv = torch.arange(r.numel(), device=r.device) // group_size
        n_groups = r.numel() // group_size
    else:
        _, inv = torch.unique(group_ids.reshape(-1), return_inverse=True)
        n_groups = int(inv.max()) + 1 if inv.numel() else 0
    gmax = torch.full((n_groups,), -float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, inv, r, "amax", include_self=True
    )
    gmin = torch.full((n_groups,), float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, inv, r, "amin", include_self=True
    )
    informative = (gmax - gmin) > atol
    keep = informative[inv]
    n_keep = int(keep.sum())
    stats = {
        "kept_groups": int(informative.sum()),
        "discarded_groups": int((~informative).sum()),
        "kept_trajectories": n_keep,
        "discarded_trajectories": r.numel() - n_keep,
        "discarded_all_positive": int((~informative & (gmax > 0)).sum()),
        "discarded_all_nonpositive": int((~informative & (gmax <= 0)).sum()),
    }
    return keep, stats


__all__ = ["dynamic_sampling_filter"]

"""DAPO dynamic sampling: drop groups whose rewards carry no learning signal (all equal), and refill
the batch by over-sampling more prompt groups (bounded) until it holds the target number of groups."""
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


# ----------------------------------------------------------------------------------------------
# DAPO dynamic sampling with refill: over-sample prompt groups until the batch is full
# ----------------------------------------------------------------------------------------------
def dynamic_sampling_refill(
    draw,
    target_groups: int,
    max_groups: int,
    round_size: int | None = None,
    atol: float = 0.0,
) -> tuple[list, dict]:
    """Draw and score prompt groups until ``target_groups`` informative groups are kept (DAPO).

    draw(n) -> (groups, rewards): n new prompt groups (any objects, e.g. rollout results) and their
    outcome rewards [n, K]; a group is kept when its K rewards are not all equal (the filter above).
    max_groups: bound on the groups drawn in total, first round included (>= target_groups); when
    it is spent the groups kept so far are returned (fewer than the target; stats say so).
    round_size: groups per draw after the first (DAPO's fixed generation batch); None: adaptive,
    ceil(missing / keep rate so far) (missing when nothing was kept yet) -- the expected number
    needed. Each draw is clamped to the remaining budget. The first draw is ``target_groups``.

    Returns (kept: the first target_groups kept groups in draw order; surplus kept groups of the
    last round are dropped, as DAPO truncates), stats (python numbers): rounds, drawn_groups,
    kept_groups (returned), discarded_groups (filtered out), surplus_groups (kept but dropped),
    reached_target (bool), keep_rate (kept before truncation / drawn).
    """
    if target_groups < 1 or max_groups < target_groups:
        raise ValueError(f"need 1 <= target_groups <= max_groups, got {target_groups}, {max_groups}")
    if round_size is not None and round_size < 1:
        raise ValueError(f"round_size must be >= 1 or None, got {round_size}")
    kept: list = []
    drawn = discarded = rounds = 0
    n = target_groups
    while True:
        n = min(n, max_groups - drawn)
        groups, rewards = draw(n)
        rewards = torch.as_tensor(rewards)
        if len(groups) != n or rewards.dim() != 2 or rewards.shape[0] != n:
            raise ValueError(f"draw({n}) must return {n} groups and rewards [{n}, K], "
                             f"got {len(groups)} groups and rewards {tuple(rewards.shape)}")
        keep, _ = dynamic_sampling_filter(rewards.reshape(-1), group_size=rewards.shape[1], atol=atol)
        informative = keep.reshape(n, -1)[:, 0].tolist()
        kept += [g for g, k in zip(groups, informative) if k]
        discarded += n - sum(informative)
        drawn += n
        rounds += 1
        missing = target_groups - len(kept)
        if missing <= 0 or drawn >= max_groups:
            break
        if round_size is not None:
            n = round_size
        else:  # expected draws to fill the gap at the observed keep rate
            n = missing if not kept else -(-missing * drawn // len(kept))
    stats = {
        "rounds": rounds,
        "drawn_groups": drawn,
        "kept_groups": min(len(kept), target_groups),
        "discarded_groups": discarded,
        "surplus_groups": max(0, len(kept) - target_groups),
        "reached_target": len(kept) >= target_groups,
        "keep_rate": len(kept) / drawn,
    }
    return kept[:target_groups], stats


__all__ = ["dynamic_sampling_filter", "dynamic_sampling_refill"]

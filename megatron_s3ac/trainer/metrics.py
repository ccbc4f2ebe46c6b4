"""Metric reductions over ranks (collective): plain means and token-weighted means."""
from __future__ import annotations

import torch
import torch.distributed as dist


def world_mean(d: dict) -> dict:
    """Average python/tensor scalars over the ranks that have each key (loss metrics exist on the last
    pipeline stage only), so every rank, rank 0 included, gets the same dict."""
    d = {k: float(v) for k, v in d.items()}
    if dist.get_world_size() == 1:
        return d
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, d)
    out: dict = {}
    for one in every:
        for k, v in one.items():
            out.setdefault(k, []).append(v)
    return {k: sum(v) / len(v) for k, v in sorted(out.items())}


def _merge(acc: dict, k: str, s: float, n: float) -> None:
    if k.endswith("_max"):
        acc[k] = (max(acc.get(k, (float("-inf"), 0.0))[0], s), 1.0)
    else:
        s0, n0 = acc.get(k, (0.0, 0.0))
        acc[k] = (s0 + s, n0 + n)


def token_means(ms: list[dict]) -> dict:
    """Per-micro-batch metrics -> token-weighted means over every micro-batch of every rank (collective).

    Each dict carries ``num_tokens`` (its weight): a fully masked micro-batch (DP padding, a filler) says
    nothing, and the result does not depend on how rows fell into micro-batches or ranks. ``*_max`` keys
    take the max. Non-scalar entries are skipped; ``loss_sum`` is dropped."""
    acc: dict = {}
    for m in ms:
        w = float(m.get("num_tokens", 1.0))
        if w <= 0:
            continue
        for k, v in m.items():
            if k in ("num_tokens", "loss_sum") or (isinstance(v, torch.Tensor) and v.numel() != 1):
                continue
            _merge(acc, k, float(v) if k.endswith("_max") else w * float(v), w)
    if dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, acc)
        acc = {}
        for one in every:
            for k, (s, n) in one.items():
                _merge(acc, k, s, n)
    return {k: (s / n if n > 0 else float("nan")) for k, (s, n) in sorted(acc.items())}

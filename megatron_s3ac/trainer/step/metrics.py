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


# ---- sums over this rank's rows, reduced over a model's DP group (sharded data flow) ---------------
def reduce_sums(sums: dict, group=None, device=None) -> dict:
    """{name: local sum} -> {name: float}, summed over ``group`` (None: no reduction: the rows here
    are the whole batch). One float64 all-reduce on ``device`` (the trainer's: NCCL takes only CUDA
    tensors)."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(()).to(device) for v in sums.values()])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return dict(zip(sums, t.tolist()))


def masked_sums(name: str, x: torch.Tensor, mask: torch.Tensor) -> dict:
    """{name: sum(x * mask), name + "/n": sum(mask)} in float64 (``ratio`` makes the masked mean)."""
    m = mask.to(torch.float64)
    return {name: (x.detach().to(torch.float64) * m).sum(), f"{name}/n": m.sum()}


def ratio(s: dict, name: str) -> float:
    """Masked mean from reduced ``masked_sums`` (0 when the mask is empty, as ``masked_mean``)."""
    return s[name] / max(s[f"{name}/n"], 1.0)


def s3ac_gae_metric_sums(values, returns, adv, scores, mask, reward_min: float, reward_max: float) -> dict:
    """The sums behind ``algorithms.registry.s3ac_gae``'s metrics over some rows of the batch, so
    that a DP-sharded batch gives the same numbers after ``reduce_sums`` (``s3ac_gae_metrics``)."""
    from megatron_s3ac.algorithms.advantages import terminal_rewards

    m = mask.to(torch.float64)
    v, r = values.detach().to(torch.float64), returns.detach().to(torch.float64)
    last = terminal_rewards(torch.ones_like(scores), mask).to(torch.float64)
    adv_last = (adv.detach().to(torch.float64) * last).sum(1)  # [n] the advantage at each row's last token
    pos = (scores > 0).to(torch.float64)
    oor = ((values < reward_min) | (values > reward_max)).to(torch.float64)
    return {"n": m.sum(), "r": (r * m).sum(), "r2": (r * r * m).sum(), "d": ((r - v) * m).sum(),
            "d2": ((r - v) ** 2 * m).sum(), "v0": v[:, 0].sum(), "rows": torch.tensor(float(len(v))),
            "oor": (oor * m).sum(), "pos": pos.sum(), "pos_adv": (adv_last * pos).sum(),
            "neg": (1 - pos).sum(), "neg_adv": (adv_last * (1 - pos)).sum()}


def s3ac_gae_metrics(s: dict) -> dict:
    """Reduced ``s3ac_gae_metric_sums`` -> the estimator's metrics (EV = 1 - Var[R - V] / Var[R] over
    valid tokens, nan when Var[R] = 0 or fewer than 2 tokens)."""
    n = s["n"]
    var = lambda a, a2: a2 / n - (a / n) ** 2 if n > 0 else float("nan")  # noqa: E731
    var_r = var(s["r"], s["r2"])
    ev = float("nan") if n < 2 or not var_r > 0 else 1.0 - var(s["d"], s["d2"]) / var_r
    out = {"critic/explained_variance": ev, "critic/v0_mean": s["v0"] / max(s["rows"], 1.0),
           "critic/values_out_of_range_frac": s["oor"] / max(n, 1.0)}
    if s["pos"] > 0:
        out["adv/last_token_correct"] = s["pos_adv"] / s["pos"]
    if s["neg"] > 0:
        out["adv/last_token_wrong"] = s["neg_adv"] / s["neg"]
    return out

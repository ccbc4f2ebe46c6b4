"""Per-token advantages of a step's trajectories, for the credit plot (paper Figure 2; tools/plot_credit.py).

``train.credit_every = N`` (0: never) appends one JSON line per N-th RL step to ``train.out_dir/credit.jsonl``:

    {"step": s, "k": K, "pid": [N], "reward": [N], "v0": [N] or null, "adv": [N][T_i]}

``adv[i]`` are row i's advantages over its T_i response tokens (a sequence-level advantage repeated per
token), ``v0`` the critic's V(s0) (its value at the first response position, computed before the
update) or null without a critic. Written by rank 0 after the step's advantages; a sharded batch is
gathered first (every rank takes part). A fresh run (or a resumed one) drops rows at or after its first
recorded step, so the file holds each step once.
"""
from __future__ import annotations

import json
import os

import torch

FILE = "credit.jsonl"


def _full(tr, batch, x: torch.Tensor, model: str) -> torch.Tensor:
    """[N, ...] of the whole step's batch on every rank (a sharded batch's rows gathered)."""
    if getattr(batch, "shard", None) is None:
        return x
    from megatron_s3ac.trainer.step.shard_metrics import gather_full

    return gather_full(batch, x, model)


def _truncate_from(path: str, step: int) -> None:
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [ln for ln in f if ln.strip() and json.loads(ln).get("step", -1) < step]
    with open(path, "w") as f:
        f.writelines(keep)


def record_credit(tr, batch) -> None:
    """Append this step's advantages (collective for a sharded batch; rank 0 writes)."""
    mask = batch.mask
    adv = batch.adv if batch.adv.dim() == 2 else batch.adv[:, None].expand_as(mask)
    adv = _full(tr, batch, (adv * mask).float().contiguous(), "actor")
    lens = _full(tr, batch, mask.sum(1).long(), "actor")
    scores = _full(tr, batch, batch.scores.float(), "actor")
    pid = _full(tr, batch, batch.pid.long(), "actor")
    v0 = None
    if batch.old_values is not None:
        v0 = _full(tr, batch, batch.old_values[:, 0].float().contiguous(), "critic")
    if tr.rank != 0:
        return
    path = os.path.join(tr.cfg.train.out_dir, FILE)
    if not getattr(tr, "_credit_started", False):
        _truncate_from(path, tr.step_idx)
        tr._credit_started = True
    row = {"step": int(tr.step_idx), "k": int(tr.cfg.rollout.k), "pid": pid.tolist(),
           "reward": [round(float(r), 4) for r in scores.tolist()],
           "v0": None if v0 is None else [round(float(v), 4) for v in v0.tolist()],
           "adv": [[round(float(a), 4) for a in adv[i, :int(n)].tolist()] for i, n in enumerate(lens.tolist())]}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")

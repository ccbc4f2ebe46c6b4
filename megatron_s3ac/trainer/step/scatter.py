"""Sharded data flow, the transport: rank 0's kept samples -> each rank's own rows (trainer.step.sharding).

Two hops, point to point: rank 0 sends each class of ranks (ranks that hold the same rows: the TP /
PP / EP peers of one DP rank) one copy of its rows, with routes cut to the union of the class's MoE
layers, to the class's lowest rank (its source); the source forwards each member its rows with routes
cut to the member's own layers. Rank 0 therefore sends about one copy of the batch whatever DP is,
and each rank receives only its rows. Point-to-point object sends rather than
``scatter_object_list``: that one pads every rank's object to the largest (torch
distributed_c10d.scatter_object_list resizes every tensor to ``max_tensor_size``), so ranks that
receive nothing would still cost rank 0 a full share each.
"""
from __future__ import annotations

import numpy as np
import torch.distributed as dist

from megatron_s3ac.trainer.step.sharding import RankRole, RankShare, class_sources, plan_shares

def gather_roles(role: RankRole) -> list[RankRole]:
    """Every rank's role (collective; once per run)."""
    roles = [None] * dist.get_world_size()
    dist.all_gather_object(roles, role)
    return roles


def _cut(routes, layers: tuple, have: tuple):
    """Routes [T, layers in ``have``, top_k] -> only ``layers`` (a compact copy)."""
    if routes is None:
        return None
    idx = [have.index(x) for x in layers]
    return np.ascontiguousarray(np.asarray(routes)[:, idx, :])


_HEAVY = ("prompt_ids", "response_ids", "logprobs", "routes", "images")  # the rest is metadata every rank holds


def _rows(samples: list[dict], share: RankShare, layers: tuple, have: tuple | None) -> list[tuple]:
    """The payload of ``share.rows``, in order: (prompt_ids, response_ids, logprobs, routes, images: the
    ImageInputs' tensors, travelling with their row, or None) each,
    routes only for ``share.route_rows`` and only ``layers`` (``have``: the layers the routes hold
    now, None = all of the model's)."""
    with_routes = set(share.route_rows)
    out = []
    for g in share.rows:
        s = samples[g]
        r = s.get("routes") if g in with_routes else None
        if r is not None:
            r = _cut(r, layers, have if have is not None else tuple(range(np.asarray(r).shape[1])))
        im = s.get("images")
        out.append((s["prompt_ids"], s["response_ids"], s["logprobs"], r, im.state() if hasattr(im, "state") else im))
    return out


def distribute(samples: list[dict], group: int, roles: list[RankRole], routes: bool) -> tuple[list[dict], list[RankShare]]:
    """``samples``: the kept samples on every rank in one order (rank 0: whole; elsewhere their
    metadata, ``RolloutPhases.rollout``). Returns (this rank's sample dicts in global-row order, each
    with "gid" and routes cut to its MoE layers, every rank's ``RankShare``). Only the heavy fields
    (token ids, log-probs, routes) travel; each rank adds the metadata it already holds. Collective
    over the world (point to point)."""
    rank = dist.get_rank()
    shares = plan_shares(len(samples), group, roles, routes)
    sources = class_sources(roles)
    mine = shares[rank]
    src = next(s for s, members in sources.items() if rank in members)
    if rank == 0:
        own = None
        for s, members in sources.items():
            union = tuple(sorted(set().union(*(shares[m].layers for m in members))))
            payload = (union, _rows(samples, shares[s], union, None))
            if s == 0:
                own = payload
            else:
                dist.send_object_list([payload], dst=s)
    elif src == rank:
        buf = [None]
        dist.recv_object_list(buf, src=0)
        own = buf[0]
    if src == rank:
        union, rows = own
        for m in sources[rank][1:]:
            part = [(p, r, lp, _cut(rt, shares[m].layers, union), im) for p, r, lp, rt, im in rows]
            dist.send_object_list([part], dst=m)
        heavy = [(p, r, lp, _cut(rt, mine.layers, union), im) for p, r, lp, rt, im in rows]
    else:
        buf = [None]
        dist.recv_object_list(buf, src=src)
        heavy = buf[0]
    local = [dict(samples[g], **dict(zip(_HEAVY, h)), gid=g) for g, h in zip(mine.rows, heavy)]
    return local, shares


__all__ = ["distribute", "gather_roles"]

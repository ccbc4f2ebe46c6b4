"""Sharded data flow, the plan: which rows of one step's batch each rank holds and which model owns them.

Ownership: the DP ranks of a model split the batch's N rows into contiguous blocks of whole groups
(``group`` = K when the algorithm's advantages need a prompt's K responses together,
``AlgoSpec.needs_groups``, else 1); DP rank d owns block d (``owned_rows``). A rank holds the rows its
actor DP rank owns and the rows its critic DP rank owns (one set when the critic shares the actor's
layout). TP / PP / EP peers of one DP rank hold the same rows; R3 routes are kept only for actor rows
and only for the MoE layers of the rank's own pipeline stage (``RankRole.moe_layers``).

A DP rank whose block is empty (fewer groups than DP ranks) holds row 0 as a filler that it does not
own (mask 0 in every pass): every rank must run the same number of forwards (EP all-to-alls, pipeline
schedules). Mini-batches keep the whole batch's composition (a seeded permutation of the N global
rows); each rank runs the part of each mini-batch that its model owns (``RowShard.minibatch_rows``).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class RankRole:
    """One rank's place in both models' layouts (gathered once from every rank)."""
    actor_dp_rank: int
    actor_dp: int
    critic_dp_rank: int  # = the actor's when the critic shares its layout (or there is no critic)
    critic_dp: int
    moe_layers: tuple = ()  # global indices of this rank's MoE layers (its PP stage); () without R3

    @property
    def cls(self) -> tuple[int, int]:
        """Ranks of one class hold exactly the same rows."""
        return self.actor_dp_rank, self.critic_dp_rank


def owned_rows(n: int, group: int, dp_rank: int, dp: int) -> list[int]:
    """Global row ids [n / dp-ish] of DP rank ``dp_rank``: one contiguous block of whole groups."""
    if n % group:
        raise ValueError(f"{n} rows are not whole groups of {group}")
    groups = torch.arange(n // group).tensor_split(dp)[dp_rank]
    return (groups[:, None] * group + torch.arange(group)).reshape(-1).tolist()


@dataclasses.dataclass(frozen=True)
class RankShare:
    """What one rank receives: ``rows`` (sorted global ids), of which ``owned[model]`` are its model's,
    and routes for ``route_rows`` cut to ``layers``."""
    rows: tuple
    owned: dict  # "actor" | "critic" -> tuple of global ids
    route_rows: tuple
    layers: tuple


def plan_shares(n: int, group: int, roles: list[RankRole], routes: bool) -> list[RankShare]:
    """Every rank's share of a batch of ``n`` rows (the same answer on every rank)."""
    out = []
    for role in roles:
        owned = {"actor": owned_rows(n, group, role.actor_dp_rank, role.actor_dp),
                 "critic": owned_rows(n, group, role.critic_dp_rank, role.critic_dp)}
        actor_rows = owned["actor"] or [0]  # the filler needs routes too (the actor replays them)
        rows = sorted(set(actor_rows) | set(owned["critic"] or [0]))
        out.append(RankShare(tuple(rows), {k: tuple(v) for k, v in owned.items()},
                             tuple(actor_rows) if routes else (), tuple(role.moe_layers) if routes else ()))
    return out


def class_sources(roles: list[RankRole]) -> dict[int, list[int]]:
    """{source rank: [member ranks, source first]}: the lowest rank of each class receives its
    class's rows from rank 0 and forwards each member its part."""
    classes: dict[tuple, list[int]] = {}
    for r, role in enumerate(roles):
        classes.setdefault(role.cls, []).append(r)
    return {members[0]: members for members in classes.values()}


@dataclasses.dataclass
class RowShard:
    """This rank's rows of one step's batch: ``gid`` [n] global ids of the local rows (sorted),
    ``owned[model]`` [n] bool, ``primary[model]`` [n] bool (this is the lowest rank owning the row:
    it alone contributes the row when a whole-batch tensor is assembled), ``nested`` (on every rank
    the actor's rows are among the critic's, so advantages need no values from elsewhere) and
    ``meta`` (the whole batch's ``RolloutMeta``). Index bookkeeping only (host tensors)."""
    n_global: int
    gid: Tensor
    owned: dict
    primary: dict
    nested: bool
    meta: object = None

    @classmethod
    def of(cls, n_global: int, shares: list[RankShare], rank: int, meta=None) -> "RowShard":
        share = shares[rank]
        gid = torch.tensor(share.rows, dtype=torch.long)
        owned = {k: torch.isin(gid, torch.tensor(v, dtype=torch.long)) for k, v in share.owned.items()}
        primary = {}
        for k in owned:
            first = {}
            for r, sh in enumerate(shares):
                for g in sh.owned[k]:
                    first.setdefault(g, r)
            primary[k] = torch.tensor([first.get(g) == rank for g in share.rows], dtype=torch.bool)
        nested = all(set(sh.owned["actor"]) <= set(sh.owned["critic"]) for sh in shares)
        return cls(n_global, gid, owned, primary, nested, meta)

    def _filler(self, model: str) -> tuple[Tensor, Tensor]:
        """One masked row for a rank with nothing to run: a row ``model`` owns here (its R3 routes are
        here), else row 0 (every rank whose model owns nothing holds it, routes included)."""
        own = self.owned[model].nonzero()[:, 0]
        pos = own[:1] if len(own) else (self.gid == 0).nonzero()[:1, 0]
        return pos, torch.zeros(1, dtype=torch.bool)

    def rows(self, model: str) -> tuple[Tensor, Tensor]:
        """(local positions, real) of every row ``model`` owns here; a masked filler when none."""
        pos = self.owned[model].nonzero()[:, 0]
        return (pos, torch.ones(len(pos), dtype=torch.bool)) if len(pos) else self._filler(model)

    def minibatch_rows(self, rows: Tensor, model: str) -> tuple[Tensor, Tensor]:
        """Global rows of one mini-batch -> (local positions, real) of those ``model`` owns here, in
        the mini-batch's order; a masked filler when none."""
        local = torch.full((self.n_global,), -1, dtype=torch.long)
        local[self.gid[self.owned[model]]] = self.owned[model].nonzero()[:, 0]
        pos = local[rows]
        pos = pos[pos >= 0]
        return (pos, torch.ones(len(pos), dtype=torch.bool)) if len(pos) else self._filler(model)

    def owned_mask(self, model: str, device=None) -> Tensor:
        """[n] float 0/1: rows ``model`` owns here (a filler or a row of the other model: 0)."""
        return self.owned[model].float().to(device)

"""R3 for a trainer: the on/off decision, per-micro-batch route alignment, the replay context and the
step's R3 metrics, in one object (``RouteReplay``).

A micro-batch here is anything with ``real_rows`` [n] bool, ``routes`` (per-row rollout routes
[P + R - 1, layers, top_k]), ``placements`` [(row, start, length)] and ``input_ids`` [b, s]: the
trainer's ``MicroBatch`` (this floor never imports the trainer).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from megatron_s3ac.r3.config import R3Config, R3ConfigError, check_replay_config


def r3_setting(mode: str, agreement_every: int, info) -> tuple[R3Config, bool]:
    """(R3Config, on?) from ``mode`` auto | on | off: auto = on for MoE models; on for a dense model
    raises R3ConfigError."""
    r3 = R3Config(enabled={"auto": None, "on": True, "off": False}[mode], agreement_every=agreement_every)
    return r3, r3.is_on(info)


class RouteReplay:
    """Replays the rollout's expert choices in the actor's forwards; ``on`` False makes every method a
    no-op. ``actor_config``: the actor's TransformerConfig (checked: nothing may skip replay)."""

    def __init__(self, r3: R3Config, on: bool, actor_config, num_experts: int):
        self.r3, self.on, self.num_experts = r3, on, num_experts
        self.actor_config = actor_config
        self.moe_layers: list[int] = []
        if on:  # refuse settings under which replay would be skipped or undone silently
            check_replay_config(actor_config)

    def attach(self, actor_ddp) -> None:
        """Record which MoE layers live on this rank (after the actor is built and wrapped)."""
        if self.on:
            from megatron_s3ac.r3.replay import local_moe_layers

            self.moe_layers = local_moe_layers([actor_ddp])

    def align(self, mb):
        """The rollout's routes of one micro-batch, in the order this rank's routers see its tokens
        (padded rows from position 0, every sample fed whole: its last token gets a filler row;
        only this rank's MoE layers, so dense layers are skipped)."""
        from megatron_s3ac.r3.align import align_microbatch, cp_split, pad_last_row, sp_split

        # no-op rows (DP padding, filler micro-batches) keep the filler routes and are not counted as
        # routed, so they neither replay nor enter the agreement metric
        real = mb.real_rows.tolist()
        pick = [i for i, ok in enumerate(real) if ok] or [0]
        routes = []
        for i in pick:
            r, n = np.asarray(mb.routes[i]), mb.placements[i][2]
            while r.shape[0] < n - 1:  # an empty response was collated as one pad token
                r = pad_last_row(r, self.num_experts)
            routes.append(r[: n - 1])
        sp_rank, sp_size = sp_split(self.actor_config)
        cp_rank, cp_size = cp_split()
        # routes cut to this rank's MoE layers by the sender (sharded data flow): index them by position
        have = getattr(mb, "route_layers", None)
        layers = self.moe_layers if have is None else [list(have).index(x) for x in self.moe_layers]
        out = align_microbatch(routes, [mb.placements[i] for i in pick], tuple(mb.input_ids.shape),
                               layers, self.num_experts, sp_rank=sp_rank, sp_size=sp_size,
                               cp_rank=cp_rank, cp_size=cp_size)
        out.layers = tuple(self.moe_layers)  # the columns are looked up by global layer index
        if not any(real):
            out.routed.zero_()
        return out

    def replay(self, actor_ddp, mbs: list):
        """Context that replays the rollout's routes in the actor's forward(s) of ``mbs``."""
        if not (self.on and mbs and mbs[0].routes is not None):
            return contextlib.nullcontext()
        from megatron_s3ac.r3.replay import routing_replay

        return routing_replay([actor_ddp], [self.align(mb) for mb in mbs])

    def record_native(self, actor_ddp):
        """Context recording the routers' own choices (no replay) over a forward."""
        from megatron_s3ac.r3.metrics import record_native_routes

        return record_native_routes([actor_ddp])

    def agreement_counts(self, recorded, mbs: list) -> tuple[int, int]:
        from megatron_s3ac.r3.metrics import routing_agreement

        return routing_agreement(recorded, [self.align(mb) for mb in mbs])

    def step_metrics(self, step: int, old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                     native_forward: Callable[[], dict], reduce: Callable[[dict], dict] | None = None) -> dict:
        """r3/logprob_abs_diff, r3/kl_k3: train (replayed) vs rollout log-prob gap; every
        ``agreement_every`` steps also r3/agreement (share of (token, MoE layer) pairs where the
        trainer's native top-k equals the rollout's) and r3/native_* (the gap with native routing, what
        replay removes), from ``native_forward() -> {"logp", "agree", "total"}`` (collective).
        ``reduce``: sums over this rank's rows -> sums over the batch (a DP-sharded batch; ``mask``
        then covers this rank's own rows only)."""
        from megatron_s3ac.r3.metrics import gap_means, logprob_gap

        red = reduce or (lambda s: s)
        out = {f"r3/{k}": v for k, v in gap_means([red(logprob_gap(old_logp, rollout_logp, mask))]).items()}
        every = self.r3.agreement_every
        if not every or step % every:
            return out
        res = native_forward()
        t = torch.tensor([res["agree"], res["total"]], dtype=torch.float64, device=old_logp.device)
        dist.all_reduce(t)  # ratio of sums: right whether ranks saw the same tokens (TP) or other ones (DP, SP)
        out["r3/agreement"] = float(t[0] / t[1].clamp(min=1))
        out.update({f"r3/native_{k}": v for k, v in gap_means([red(logprob_gap(res["logp"], rollout_logp, mask))]).items()})
        return out


__all__ = ["RouteReplay", "r3_setting", "R3ConfigError"]

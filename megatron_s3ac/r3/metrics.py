"""Per-step R3 metrics: does the trainer's own router agree with the rollout's, and how far apart are
the train and rollout log-probs.

Routing agreement: a forward-only pass with RouterReplay in RECORD mode (native top-k, nothing
replayed) records each router's indices; a (token, layer) pair agrees when the recorded set of
top-k experts equals the rollout's set (order inside the top-k is irrelevant to the MoE output).
Only rows that hold rollout routes count (``MicroBatchRoutes.routed``: not padding, not a sample's
last token).

Log-prob gap, over response tokens (mask), with samples drawn from the rollout policy pi_r:
  mean |log pi_t - log pi_r|, and KL(pi_r || pi_t) by the k3 estimator E_r[(rho - 1) - log rho],
  rho = pi_t / pi_r (unbiased, >= 0 per token; Schulman's k3, the estimator the R3 paper reports).
Both are returned as sums + counts so the trainer can add micro-batches and all-reduce over DP.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megatron_s3ac.r3.align import MicroBatchRoutes
from megatron_s3ac.r3.replay import _replay_routers


@contextmanager
def record_native_routes(model_chunks: Sequence[torch.nn.Module]) -> Iterator[list[dict[int, torch.Tensor]]]:
    """Record the routers' native top-k during the forward(s) run inside the block.

    Yields a list that fills with one dict per micro-batch: global layer -> [local_tokens, top_k]
    int64 (CPU), covering all chunks of this rank. Run a forward-only ``forward_backward`` inside.
    """
    per_chunk = _replay_routers(model_chunks)
    recorded: list[dict[int, torch.Tensor]] = []
    cursors = [0] * len(model_chunks)
    handles = []

    def post_hook(c):
        def hook(module, args, output):
            i = cursors[c]
            cursors[c] += 1
            while len(recorded) <= i:
                recorded.append({})
            for layer, router in per_chunk[c]:
                recorded[i][layer] = router.router_replay.get_recorded_indices().detach().cpu()
        return hook

    for routers in per_chunk:
        for _, router in routers:
            router.router_replay.clear_indices()
            router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        for c, chunk in enumerate(model_chunks):
            handles.append(chunk.register_forward_hook(post_hook(c)))
        yield recorded
    finally:
        for h in handles:
            h.remove()
        for routers in per_chunk:
            for _, router in routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()


def same_expert_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[N, K] x [N, K] expert ids -> [N] bool: same set of K experts per row."""
    return (a.long().sort(dim=-1).values == b.long().sort(dim=-1).values).all(dim=-1)


def routing_agreement(native: Sequence[dict[int, torch.Tensor]],
                      routes: Sequence[MicroBatchRoutes]) -> tuple[int, int]:
    """(agreeing (token, layer) pairs, pairs counted) over micro-batches and this rank's MoE layers.

    native: from ``record_native_routes``; routes: the rollout's, as aligned for replay.
    Divide the DP/TP-summed counts for the fraction (``agree / total``).
    """
    if len(native) != len(routes):
        raise ValueError(f"{len(native)} recorded micro-batches, {len(routes)} routed")
    agree = total = 0
    for rec, mb in zip(native, routes):
        keep = mb.routed.cpu()
        for layer in mb.layers:
            same = same_expert_sets(rec[layer], mb.layer(layer).cpu())
            agree += int(same[keep].sum())
            total += int(keep.sum())
    return agree, total


def logprob_gap(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                mask: torch.Tensor) -> dict[str, float]:
    """Sums over masked tokens of |log pi_t - log pi_r| and of the k3 KL(pi_r || pi_t) estimate.

    All inputs [b, s] (any matching shape); mask: response tokens. Returns
    {"abs_diff_sum", "kl_k3_sum", "count"}; the means are sum / count (see ``gap_means``).
    """
    m = mask.bool()
    d = (train_logprobs.float() - rollout_logprobs.float())[m]  # log rho
    return {"abs_diff_sum": float(d.abs().sum()), "kl_k3_sum": float((torch.expm1(d) - d).sum()),
            "count": float(m.sum())}


def gap_means(stats: Sequence[dict[str, float]]) -> dict[str, float]:
    """Merge ``logprob_gap`` sums (micro-batches, or ranks after an all-reduce) into means."""
    n = sum(s["count"] for s in stats)
    if n == 0:
        return {"logprob_abs_diff": 0.0, "kl_k3": 0.0}
    return {"logprob_abs_diff": sum(s["abs_diff_sum"] for s in stats) / n,
            "kl_k3": sum(s["kl_k3_sum"] for s in stats) / n}

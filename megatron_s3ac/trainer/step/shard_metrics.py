"""The step's phases on a DP-sharded batch (trainer.step.sharding): per-model row masks, metric sums reduced
over a model's DP ranks, advantages computed where the rows are, and the rare whole-batch assembly.

Where a row's advantage is computed: critic-free estimators need only the rewards and lengths, which
every rank has for the whole batch (``RowShard.meta``): each rank evaluates the estimator on the whole
batch and keeps its rows (batch-normalised estimators stay exact). ``s3ac_gae`` is row-local, so the
rank that holds a row's values computes it, and its metrics come from reduced sums
(``metrics.s3ac_gae_metric_sums``). Only two cases assemble a whole-batch tensor (each row contributed
by its first owner, one all-reduce): another critic-based estimator, or a critic layout under which an
actor row's values live on another rank; and the entropy-control hook (its statistics are the whole
batch's). With a whole batch on every rank (no shard) everything reduces to the plain formulas.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_s3ac.algorithms.registry import AdvInputs, AdvOutput, get_adv_est
from megatron_s3ac.trainer.step.metrics import reduce_sums, s3ac_gae_metric_sums, s3ac_gae_metrics

# estimators whose advantages and returns of a row depend on that row only (and the algo config)
ROW_LOCAL_WITH_CRITIC = {"s3ac_gae"}


def own_mask(batch, model: str) -> torch.Tensor:
    """[n, T] response mask of the rows ``model`` owns here (the whole mask without a shard)."""
    shard = getattr(batch, "shard", None)
    if shard is None:
        return batch.mask
    return batch.mask * shard.owned_mask(model, batch.mask.device)[:, None]


def global_sums(tr, model: str, batch, sums: dict) -> dict:
    """Local sums over this rank's rows -> sums over the whole batch: all-reduced over ``model``'s DP
    group when the batch is sharded (TP / PP peers hold the same rows and reduce in their own group)."""
    if getattr(batch, "shard", None) is None:
        return reduce_sums(sums, None, device=batch.mask.device)
    from megatron.core import parallel_state as ps

    with tr.model_scope(model):
        return reduce_sums(sums, ps.get_data_parallel_group(), device=batch.mask.device)


def gather_full(batch, x: torch.Tensor, model: str) -> torch.Tensor:
    """[n, ...] per-row tensor of a sharded batch -> [N, ...] on every rank: each row from its first
    ``model`` owner, one all-reduce over the world (collective)."""
    shard = batch.shard
    dev = x.device
    full = torch.zeros((shard.n_global,) + tuple(x.shape[1:]), dtype=x.dtype, device=dev)
    p = shard.primary[model].to(dev)
    full[shard.gid.to(dev)[p]] = x[p]
    if dist.get_world_size() > 1:
        dist.all_reduce(full)
    return full


def _rows_of(out: AdvOutput, gid: torch.Tensor) -> AdvOutput:
    return AdvOutput(out.adv[gid], None if out.returns is None else out.returns[gid], dict(out.metrics))


def shard_advantages(tr, batch, values) -> tuple[AdvOutput, dict]:
    """The registered estimator's advantages (and returns) for the rows here, and its metrics over the
    whole batch. ``values``: the critic's [n, T] (valid on the critic's rows) or None."""
    a, k = tr.cfg.algo, tr.cfg.rollout.k
    est = get_adv_est(tr.spec.adv_estimator)
    shard = getattr(batch, "shard", None)
    if shard is None:
        out = est(AdvInputs(batch.scores, batch.mask, values, k), a)
        return out, dict(out.metrics)
    dev = batch.mask.device
    gid = shard.gid.to(dev)
    meta_mask, meta_scores = shard.meta.mask().to(dev), shard.meta.scores.to(dev)
    if values is None:  # rewards and lengths of the whole batch are here: exact, even batch-normalised
        out = est(AdvInputs(meta_scores, meta_mask, None, k), a)
        return _rows_of(out, gid), dict(out.metrics)
    if tr.spec.adv_estimator in ROW_LOCAL_WITH_CRITIC and shard.nested:
        rows = shard.owned["critic"].nonzero()[:, 0].to(dev)
        out = est(AdvInputs(batch.scores[rows], batch.mask[rows], values[rows], k), a)
        adv = torch.zeros((len(batch),) + tuple(out.adv.shape[1:]), dtype=out.adv.dtype, device=dev)
        returns = torch.zeros_like(batch.mask, dtype=out.returns.dtype)
        adv[rows], returns[rows] = out.adv, out.returns
        sums = s3ac_gae_metric_sums(values[rows], out.returns, out.adv, batch.scores[rows], batch.mask[rows],
                                    a.reward_min, a.reward_max)
        return AdvOutput(adv, returns), s3ac_gae_metrics(global_sums(tr, "critic", batch, sums))
    out = est(AdvInputs(meta_scores, meta_mask, gather_full(batch, values, "critic"), k), a)
    return _rows_of(out, gid), dict(out.metrics)


def entropy_control(tr, batch) -> dict:
    """batch.adv := the entropy-control hook's (its group statistics are the whole batch's: adv and
    entropy are assembled from their actor owners when sharded); returns its metrics."""
    k = tr.cfg.rollout.k
    shard = getattr(batch, "shard", None)
    if shard is None:
        batch.adv, em = tr.entropy_control(batch.adv, batch.old_entropy, batch.mask, k)
    else:
        dev = batch.mask.device
        full, em = tr.entropy_control(gather_full(batch, batch.adv, "actor"),
                                      gather_full(batch, batch.old_entropy, "actor"), shard.meta.mask().to(dev), k)
        batch.adv = full[shard.gid.to(dev)]
    return {f"entropy_control/{key}": v for key, v in em.items()}

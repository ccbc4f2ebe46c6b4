"""The one mini-batch runner: rows -> shard over DP -> micro-batches -> zero_grad -> forward_backward
-> (skip if non-finite) -> optimizer step. Used by the actor and critic updates, value pretraining
and the demo's supervised warm-up; plus the forward-only pass (log-probs, entropies, values).

Every function here is collective over the model's ranks and runs inside the model's parallel scope
(``Trainer.model_scope``): DP rank and size come from megatron's parallel state.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_s3ac.trainer.step.batch import MicroBatch, RolloutBatch, micro_batches, pad_micro_batches, shard_rows
from megatron_s3ac.trainer.step.device import trainer_device


@dataclasses.dataclass(frozen=True)
class MicroBatcher:
    """This rank's rows -> micro-batches (padded, ``mbs`` rows each, or packed under ``token_budget``),
    as many on every rank (EP all-to-alls and pipeline schedules are collective): ranks with fewer
    get fully masked no-op ones. The token budget is per rank: under context parallelism (the model
    whose parallel state is active) a packed row holds up to cp x ``token_budget`` tokens, budget of
    them on each CP rank."""
    mbs: int = 0
    token_budget: int = 0
    pad_to: int = 8

    def __call__(self, batch: RolloutBatch, rows: torch.Tensor, real: torch.Tensor) -> list[MicroBatch]:
        from megatron_s3ac.models.context_parallel import cp_group_info

        budget = self.token_budget * cp_group_info()[1]
        mbs = micro_batches(batch, rows, real, self.mbs, token_budget=budget, pad_to=self.pad_to)
        if dist.get_world_size() > 1:
            n = torch.tensor([len(mbs)], device=trainer_device())
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            mbs = pad_micro_batches(mbs, int(n))
        return mbs


def shuffled_minibatches(n: int, epochs: int, generator: torch.Generator, *, count: int = 0,
                         size: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """(epoch, rows) of ``epochs`` passes over ``n`` rows, each a fresh permutation from ``generator``
    cut into ``count`` near-equal mini-batches (at most n) or into mini-batches of ``size`` rows."""
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=generator)
        yield from ((epoch, rows) for rows in (perm.tensor_split(min(count, n)) if count else perm.split(size)))


@dataclasses.dataclass
class MinibatchResult:
    epoch: int
    outputs: list  # the loss function's metric dicts of this rank's micro-batches (last pipeline stage)
    grad_norm: Optional[float]  # None: the step was skipped (non-finite loss)
    before_step: object = None  # what ``before_step`` returned


def _my_rows(batch: RolloutBatch, rows: torch.Tensor, model: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Global rows of one mini-batch -> (rows of ``batch`` this rank runs, real): a sharded batch runs
    the rows its ``model`` owns here; a whole batch (every rank holds it) is dealt over DP."""
    if batch.shard is not None:
        return batch.shard.minibatch_rows(rows, model)
    from megatron.core import parallel_state as ps

    return shard_rows(rows, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())


def run_minibatches(ddp, opt, batch: RolloutBatch, minibatches: Iterable[tuple[int, torch.Tensor]], loss_fn,
                    make_micro_batches: Callable, *, replay: Optional[Callable] = None,
                    skip_nonfinite: bool = False, before_step: Optional[Callable] = None,
                    model: str = "actor") -> Iterator[MinibatchResult]:
    """One optimizer step per mini-batch of global row indices; yields a ``MinibatchResult`` after
    each. ``loss_fn(mb, output) -> (loss_sum, count, metrics)`` (models.pipeline); ``replay(mbs)``: a
    context around the forward-backward (R3); ``skip_nonfinite``: a non-finite ``loss_sum`` on any
    rank drops the step (weights unchanged); ``before_step(outputs)`` runs between backward and step
    (the gradients are reduced then); ``model``: whose rows of a sharded batch this rank runs."""
    from megatron_s3ac.models.pipeline import forward_backward

    for epoch, rows in minibatches:
        mine, real = _my_rows(batch, rows, model)
        mbs = make_micro_batches(batch, mine, real)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        with (replay(mbs) if replay is not None else contextlib.nullcontext()):
            out = forward_backward([ddp], mbs, loss_fn)
        if skip_nonfinite:
            finite = torch.tensor([float(all(math.isfinite(float(o["loss_sum"])) for o in out))],
                                  device=trainer_device())
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
            if finite.item() < 1:  # weights unchanged: drop the reduced grads, no optimizer step
                ddp.zero_grad_buffer()
                opt.zero_grad()
                yield MinibatchResult(epoch, out, None)
                continue
        pre = before_step(out) if before_step is not None else None
        _, gn, _ = opt.step()
        yield MinibatchResult(epoch, out, float(gn) if gn is not None else float("nan"), pre)


def forward_only(ddp, batch: RolloutBatch, keys: list[str], loss_fn, make_micro_batches: Callable,
                 ctx_fn: Callable = lambda mbs: contextlib.nullcontext(), model: str = "actor"):
    """Per-response-token outputs [len(keys), N, T] (fp32, on the batch's device), the micro-batches and
    what ``ctx_fn(mbs)``'s context yielded. ``loss_fn`` returns the per-token outputs under ``keys`` in
    its metrics dict.

    A sharded batch (``batch.shard``): the rows ``model`` owns here are computed and stay here (rows
    it does not own are 0); nothing crosses DP ranks. A whole batch (every rank holds it, e.g. DAPS's
    V(s0)): rows are dealt over DP and summed back so every rank gets every row. Either way the last
    pipeline stage broadcasts to the other stages of its DP rank (they log the same metrics)."""
    from megatron.core import parallel_state as ps

    from megatron_s3ac.models.pipeline import forward_backward

    n, T = batch.mask.shape
    if batch.shard is not None:
        rows, real = batch.shard.rows(model)
    else:
        rows, real = shard_rows(torch.arange(n), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    mbs = make_micro_batches(batch, rows, real)
    ddp.eval()
    with torch.no_grad(), ctx_fn(mbs) as recorded:
        outs = forward_backward([ddp], mbs, loss_fn, forward_only=True)
    ddp.train()
    full = torch.zeros(len(keys), n, T, device=batch.mask.device)
    for mb, o in zip(mbs, outs):
        r = mb.real_rows.to(full.device)
        for j, k in enumerate(keys):
            full[j, mb.row_ids.to(full.device)[r]] = o[k][r].float()
    if batch.shard is None and ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(full, group=ps.get_data_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(full, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return full, mbs, recorded

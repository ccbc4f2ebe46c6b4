"""Rollout samples -> a typed batch, row sharding over DP, micro-batches.

Layout: ``tokens`` [N, L] = prompt + response, right-padded (L a multiple of ``pad_to`` so sequence
parallelism can split it). Response token t of row i sits at position P_i + t and is predicted by the
model output at position P_i - 1 + t; ``idx`` [N, T] holds those positions, so any per-position output
[N, L] becomes per-response-token [N, T] with one gather. The critic's output at that same position is
V(s_t) (state = prompt + first t response tokens), and at P_i - 1 it is V(s_0).

Micro-batches are either padded (rows of the batch, cut to their own longest row) or packed (sequence
packing with a token budget: several samples back to back in one row, block-diagonal causal mask).
Either way ``flat_idx`` [n, T] indexes the flattened per-position output [b * s] of the micro-batch,
so the losses never depend on the layout (``per_token``). Packing relies on the attention honouring
``attention_mask`` (the torch spec's SDPAttention); RoPE only sees relative positions inside a
block, so a sample's outputs do not depend on where in the packed row it sits.

``RolloutBatch`` and ``MicroBatch`` are dataclasses: a misspelt field is an AttributeError. A
``MicroBatch`` also reads like a mapping (``mb["input_ids"]``, ``mb.get("position_ids")``) because
``models.pipeline.forward_backward`` feeds micro-batches to the model that way.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
from torch import Tensor


def _pick(v, rows: Tensor, idx: list[int]):
    if torch.is_tensor(v):
        return v[rows.to(v.device)]
    return [v[i] for i in idx] if isinstance(v, list) else v  # None and non-row fields (shard) pass through


def _moved(v, device):
    return v.to(device, non_blocking=True) if torch.is_tensor(v) else v


@dataclasses.dataclass
class RolloutBatch:
    """One step's trajectories, [N, ...] rows; the training fields are filled by the step's phases."""
    tokens: Tensor  # [N, L] long: prompt + response, right-padded
    idx: Tensor  # [N, T] position whose output predicts response token t
    mask: Tensor  # [N, T] 0/1 valid response tokens
    rollout_logp: Tensor  # [N, T] the engine's (behaviour) log-probs
    scores: Tensor  # [N] rewards
    pid: Tensor  # [N] prompt index
    prompt_len: Tensor  # [N]
    resp_len: Tensor  # [N]
    routes: Optional[list] = None  # R3: per-sample rollout routes [P + R - 1, layers, top_k] (ragged)
    # image prompts: per-sample models.multimodal.ImageInputs (None for a text row); None: no image in the batch.
    # Selected with the rows like routes; models.pipeline turns them into vision embeddings + mRoPE positions
    images: Optional[list] = None
    # filled by the step: old log-probs, advantages, IS corrections, critic targets; value pretraining
    # fills returns only
    old_logp: Optional[Tensor] = None
    old_entropy: Optional[Tensor] = None  # [N, T] the actor's entropy at old_logp (the entropy-control hook)
    adv: Optional[Tensor] = None
    is_w: Optional[Tensor] = None
    keep: Optional[Tensor] = None
    old_values: Optional[Tensor] = None
    returns: Optional[Tensor] = None
    # sharded data flow (trainer.step.sharding): which global rows this rank holds and which of them each
    # model owns (None: every rank holds the whole batch); the MoE layers the routes were cut to
    # (global indices, in order; None: all layers)
    shard: Optional[Any] = None
    route_layers: Optional[tuple] = None

    def __len__(self) -> int:
        return len(self.tokens)

    def global_len(self) -> int:
        """Rows of the whole step's batch (= len(self) unless sharded)."""
        return len(self) if self.shard is None else self.shard.n_global

    def to(self, device) -> "RolloutBatch":
        """Every tensor field on ``device`` (routes stay compact host arrays; the shard's row
        bookkeeping stays on the host)."""
        return dataclasses.replace(self, **{f.name: _moved(getattr(self, f.name), device)
                                            for f in dataclasses.fields(self) if f.name != "shard"})

    def select(self, rows: Tensor) -> "RolloutBatch":
        """Rows of every field: tensors indexed, lists (per-sample ragged data) picked, None kept."""
        idx = rows.tolist()
        return RolloutBatch(**{f.name: _pick(getattr(self, f.name), rows, idx) for f in dataclasses.fields(self)})


@dataclasses.dataclass(kw_only=True)
class MicroBatch(RolloutBatch):
    """Rows of a ``RolloutBatch`` laid out for one forward: ``input_ids`` [b, s] (b rows padded, or
    one packed row with ``position_ids`` and a block-diagonal ``attention_mask``), ``flat_idx`` [n, T]
    into the flattened output, ``placements`` [(row, start, length)] for R3, ``row_ids`` [n] (batch
    rows held here) and ``real_rows`` [n] (False = a DP-padding duplicate or a filler: mask 0)."""
    input_ids: Tensor  # [b, s] model input
    flat_idx: Tensor  # [n, T] into the flattened per-position output
    placements: list  # [(row in input_ids, start, length)] per sample
    row_ids: Tensor  # [n] batch rows held here
    real_rows: Tensor  # [n] bool
    position_ids: Optional[Tensor] = None  # packed only: [1, s], restarting per sample
    attention_mask: Optional[Tensor] = None  # packed only: [1, 1, s, s] bool, True = masked

    # mapping view for models.pipeline (model inputs only)
    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def get(self, key: str, default=None) -> Any:
        v = getattr(self, key)
        return default if v is None else v


@dataclasses.dataclass
class RolloutMeta:
    """Per-sample metadata of a step's samples, [N] each, held by every rank (the samples themselves
    stay with rank 0 until ``RolloutPhases.distribute``): what the group filter, DAPS, the rollout
    metrics and the critic-free advantage estimators need."""
    pid: Tensor  # [N] long
    scores: Tensor  # [N] float32 rewards
    prompt_len: Tensor  # [N] long
    resp_len: Tensor  # [N] long (an empty response counts 1: it is collated as one pad token)

    @classmethod
    def of(cls, samples: list[dict]) -> "RolloutMeta":
        return cls(pid=torch.tensor([int(s["pid"]) for s in samples]),
                   scores=torch.tensor([float(s["reward"]) for s in samples]),
                   prompt_len=torch.tensor([int(s["plen"]) for s in samples]),
                   resp_len=torch.tensor([int(s["rlen"]) for s in samples]))

    def mask(self) -> Tensor:
        """[N, T] 0/1 valid response tokens, T = the longest response (exactly ``collate``'s mask)."""
        T = max(1, int(self.resp_len.max()))
        return (torch.arange(T)[None] < self.resp_len[:, None]).float()


def collate(samples: list[dict], pad_to: int = 8, width: int | None = None) -> RolloutBatch:
    """samples: dicts with prompt_ids, response_ids, logprobs, reward, pid (+ routes, + images: ImageInputs or
    its ``state()`` dict) -> batch (host).
    width: T of the per-token fields (default: the longest response here; a shard of a batch passes
    the whole batch's so its rows look exactly like the whole batch's)."""
    n = len(samples)
    P = torch.tensor([len(s["prompt_ids"]) for s in samples])
    R = torch.tensor([len(s["response_ids"]) for s in samples])
    T = max(1, int(R.max()), width or 0)
    L = int(math.ceil(int((P + R).max()) / pad_to) * pad_to)
    tokens = torch.zeros(n, L, dtype=torch.long)
    beh = torch.zeros(n, T)
    for i, s in enumerate(samples):  # building the batch once per step; not a per-token hot path
        seq = list(s["prompt_ids"]) + list(s["response_ids"])
        tokens[i, :len(seq)] = torch.tensor(seq)
        beh[i, :len(s["response_ids"])] = torch.as_tensor(s["logprobs"], dtype=torch.float32)
    t = torch.arange(T)
    mask = (t[None] < R[:, None]).float()
    idx = (P[:, None] - 1 + t[None]).clamp(max=L - 1)
    routes = None
    if any(s.get("routes") is not None for s in samples):
        # R3: per-sample rollout routes [P + R - 1, num_layers, top_k], compact dtype; kept as a list
        # (ragged) and aligned to each micro-batch's layout (r3.glue); None for a row only the critic
        # uses (sharded data flow)
        routes = [s.get("routes") for s in samples]
    images = None
    if any(s.get("images") is not None for s in samples):
        from megatron_s3ac.models.multimodal import ImageInputs

        images = [im if im is None or isinstance(im, ImageInputs) else ImageInputs.from_state(im)
                  for im in (s.get("images") for s in samples)]
    return RolloutBatch(tokens=tokens, idx=idx, mask=mask, rollout_logp=beh,
                        scores=torch.tensor([float(s["reward"]) for s in samples]),
                        pid=torch.tensor([int(s["pid"]) for s in samples]), prompt_len=P, resp_len=R, routes=routes,
                        images=images)


def shard_rows(rows: Tensor, dp_rank: int, dp: int) -> tuple[Tensor, Tensor]:
    """Rows of one mini-batch for this DP rank, padded to ceil(n/dp) so every rank runs the same
    number of micro-batches (EP all-to-alls and DDP reductions must match). Returns (rows, real [k] bool):
    padding rows repeat a real row and must get mask 0."""
    k = int(math.ceil(len(rows) / dp))
    mine = rows[dp_rank::dp]
    real = torch.ones(len(mine), dtype=torch.bool)
    if len(mine) < k:
        pad = rows[:1].repeat(k - len(mine))
        mine, real = torch.cat([mine, pad]), torch.cat([real, torch.zeros(k - len(real), dtype=torch.bool)])
    return mine, real


def per_token(out: Tensor, mb: MicroBatch) -> Tensor:
    """Per-position model output [b, s] (padded or packed micro-batch) -> per-response-token [n, T].

    Context parallel: ``out`` holds this CP rank's positions [b, s / cp]; they are gathered over the CP
    group first (``context_parallel.gather_from_cp``: per-token scalars, a few bytes per token; its
    backward keeps this rank's slice), so everything downstream (losses, GAE, IS / IcePoP / MIS,
    metrics) sees whole sequences, as at cp = 1. The identity gather when CP is off."""
    from megatron_s3ac.models.context_parallel import gather_from_cp

    return gather_from_cp(out, 1).reshape(-1)[mb.flat_idx]


def next_token_targets(mb: MicroBatch) -> Tensor:
    """Targets of this CP rank's positions: token p + 1 for position p, [b, s / cp] (all of them at cp = 1)."""
    from megatron_s3ac.models.context_parallel import split_for_cp

    return split_for_cp(torch.roll(mb.input_ids, -1, dims=1), 1)


def cp_count(count: Tensor) -> Tensor:
    """A loss's token (or sequence) count as ``forward_backward`` must report it: megatron sums counts
    over DP x CP, and every CP rank computes the whole sequence's loss (``per_token``), so only CP
    rank 0 reports it (0 elsewhere). Unchanged without CP."""
    from megatron_s3ac.models.context_parallel import cp_group_info

    rank, _, _ = cp_group_info()
    return count if rank == 0 else torch.zeros_like(count)


def _micro(batch: RolloutBatch, r: Tensor, real: Tensor, **layout) -> MicroBatch:
    sel = batch.select(r)
    fields = {f.name: getattr(sel, f.name) for f in dataclasses.fields(sel)}
    fields["mask"] = sel.mask * real.to(sel.mask.device)[:, None].float()
    return MicroBatch(**fields, row_ids=r, real_rows=real.clone(), **layout)


def _padded(batch: RolloutBatch, r: Tensor, real: Tensor, pad_to: int) -> MicroBatch:
    dev = batch.tokens.device  # index tensors where the batch lives (the model's device)
    rd = r.to(dev)
    lengths = (batch.prompt_len[rd] + batch.resp_len[rd]).tolist()
    # this micro-batch's own length (not the whole batch's): right padding costs compute
    s = min(batch.tokens.shape[1], int(math.ceil(max(lengths) / pad_to) * pad_to))
    return _micro(batch, r, real, input_ids=batch.tokens[rd][:, :s],
                  flat_idx=torch.arange(len(r), device=dev)[:, None] * s + batch.idx[rd].clamp(max=s - 1),
                  placements=[(i, 0, int(n)) for i, n in enumerate(lengths)])


def _packed(batch: RolloutBatch, r: Tensor, real: Tensor, pad_to: int) -> MicroBatch:
    """Rows ``r`` back to back in one row [1, S] (S = total rounded up to ``pad_to``), a block-diagonal
    causal mask (megatron convention: True = masked) and positions restarting per sample; the
    padding tail is its own causal block so no query row is fully masked."""
    dev = batch.tokens.device
    rd = r.to(dev)
    lengths = (batch.prompt_len[rd] + batch.resp_len[rd]).tolist()
    total = sum(lengths)
    s = int(math.ceil(total / pad_to) * pad_to)
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    seg_len = torch.tensor(lengths + ([s - total] if s > total else []), device=dev)
    seg = torch.repeat_interleave(torch.arange(len(seg_len), device=dev), seg_len)  # [S] segment id per position
    seg_start = torch.cumsum(seg_len, 0) - seg_len
    pos = torch.arange(s, device=dev) - seg_start[seg]
    ids = torch.zeros(1, s, dtype=torch.long, device=dev)
    tokens = batch.tokens[rd]
    keep = torch.arange(tokens.shape[1], device=dev)[None] < torch.tensor(lengths, device=dev)[:, None]
    ids[0, :total] = tokens[keep]  # row-major: sample by sample, each left-aligned
    causal = torch.ones(s, s, dtype=torch.bool, device=dev).tril()
    return _micro(batch, r, real, input_ids=ids, position_ids=pos[None],
                  attention_mask=~((seg[:, None] == seg[None, :]) & causal)[None, None],
                  flat_idx=(torch.tensor(starts, device=dev)[:, None] + batch.idx[rd]).clamp(max=s - 1),  # tail in range
                  placements=[(0, a, n) for a, n in zip(starts, lengths)])


def pack_rows(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: indices into ``lengths`` grouped so each group's total is <= ``budget``
    (a single longer sequence gets a group of its own). Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, left in enumerate(room):
            if n <= left:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return [sorted(b) for b in bins]


def micro_batches(batch: RolloutBatch, rows: Tensor, real: Tensor, mbs: int = 0, token_budget: int = 0,
                  pad_to: int = 8) -> list[MicroBatch]:
    """This rank's rows -> micro-batches. ``token_budget`` > 0: sequence packing, each micro-batch one
    packed row of at most ``token_budget`` tokens (plus rounding to ``pad_to``); else ``mbs`` rows per
    padded micro-batch (0 = all rows in one)."""
    if token_budget > 0:
        rd = rows.to(batch.prompt_len.device)
        lengths = (batch.prompt_len[rd] + batch.resp_len[rd]).tolist()
        groups = [torch.tensor(g) for g in pack_rows(lengths, token_budget)]
        return [_packed(batch, rows[g], real[g], pad_to) for g in groups]
    mbs = len(rows) if mbs <= 0 else mbs
    return [_padded(batch, rows[s:s + mbs], real[s:s + mbs], pad_to) for s in range(0, len(rows), mbs)]


def pad_micro_batches(mbs: list[MicroBatch], count: int) -> list[MicroBatch]:
    """Append no-op micro-batches (the first one with every token masked) up to ``count``, so that
    all ranks run the same number of forwards (EP all-to-alls and pipeline schedules are collective)."""
    out = list(mbs)
    while len(out) < count:
        out.append(dataclasses.replace(out[0], mask=torch.zeros_like(out[0].mask),
                                       real_rows=torch.zeros_like(out[0].real_rows)))
    return out

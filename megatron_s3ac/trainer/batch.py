"""Rollout samples -> padded tensors, row sharding over DP, micro-batches.

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
"""
from __future__ import annotations

import math

import torch


def collate(samples: list[dict], pad_to: int = 8) -> dict:
    """samples: dicts with prompt_ids, response_ids, logprobs, reward, pid -> batch of tensors."""
    n = len(samples)
    P = torch.tensor([len(s["prompt_ids"]) for s in samples])
    R = torch.tensor([len(s["response_ids"]) for s in samples])
    T = max(1, int(R.max()))
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
    out = {"tokens": tokens, "idx": idx, "mask": mask, "rollout_logp": beh,
           "scores": torch.tensor([float(s["reward"]) for s in samples]),
           "pid": torch.tensor([int(s["pid"]) for s in samples]), "prompt_len": P, "resp_len": R}
    if n and samples[0].get("routes") is not None:
        # R3: per-sample rollout routes [P + R - 1, num_layers, top_k], compact dtype; kept as a list
        # (ragged) and aligned to each micro-batch's layout by the trainer (r3.align)
        out["routes"] = [s["routes"] for s in samples]
    return out


def select_rows(batch: dict, rows: torch.Tensor) -> dict:
    """Rows of every entry: tensors are indexed, lists (per-sample ragged data) picked."""
    idx = rows.tolist()
    return {k: (v[rows] if torch.is_tensor(v) else [v[i] for i in idx]) for k, v in batch.items()}


def shard_rows(rows: torch.Tensor, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def per_token(out: torch.Tensor, mb: dict) -> torch.Tensor:
    """Per-position model output [b, s] (padded or packed micro-batch) -> per-response-token [n, T]."""
    return out.reshape(-1)[mb["flat_idx"]]


def _padded(batch: dict, r: torch.Tensor, real: torch.Tensor, extra: dict | None, pad_to: int) -> dict:
    mb = select_rows(batch, r)
    for k, v in (extra or {}).items():
        mb[k] = v[r]
    lengths = mb["prompt_len"] + mb["resp_len"]
    # this micro-batch's own length (not the whole batch's): right padding costs compute
    s = min(mb["tokens"].shape[1], int(math.ceil(int(lengths.max()) / pad_to) * pad_to))
    mb["input_ids"] = mb["tokens"][:, :s]
    mb["flat_idx"] = torch.arange(len(r))[:, None] * s + mb["idx"].clamp(max=s - 1)
    mb["placements"] = [(i, 0, int(n)) for i, n in enumerate(lengths.tolist())]
    mb["mask"] = mb["mask"] * real[:, None].float()
    mb["row_ids"], mb["real_rows"] = r, real.clone()  # batch rows held here; False = DP-padding duplicate
    return mb


def _packed(batch: dict, r: torch.Tensor, real: torch.Tensor, extra: dict | None, pad_to: int) -> dict:
    """Rows ``r`` back to back in one row [1, S] (S = total rounded up to ``pad_to``), a block-diagonal
    causal mask (megatron convention: True = masked) and positions restarting per sample; the
    padding tail is its own causal block so no query row is fully masked."""
    mb = select_rows(batch, r)
    for k, v in (extra or {}).items():
        mb[k] = v[r]
    lengths = (mb["prompt_len"] + mb["resp_len"]).tolist()
    total = sum(lengths)
    s = int(math.ceil(total / pad_to) * pad_to)
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    seg_len = torch.tensor(lengths + ([s - total] if s > total else []))
    seg = torch.repeat_interleave(torch.arange(len(seg_len)), seg_len)  # [S] segment id per position
    seg_start = torch.cumsum(seg_len, 0) - seg_len
    pos = torch.arange(s) - seg_start[seg]
    ids = torch.zeros(1, s, dtype=torch.long)
    keep = torch.arange(mb["tokens"].shape[1])[None] < torch.tensor(lengths)[:, None]
    ids[0, :total] = mb["tokens"][keep]  # row-major: sample by sample, each left-aligned
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    mb["input_ids"] = ids
    mb["position_ids"] = pos[None]
    mb["attention_mask"] = ~((seg[:, None] == seg[None, :]) & causal)[None, None]
    mb["flat_idx"] = (torch.tensor(starts)[:, None] + mb["idx"]).clamp(max=s - 1)  # masked tail stays in range
    mb["placements"] = [(0, a, n) for a, n in zip(starts, lengths)]
    mb["mask"] = mb["mask"] * real[:, None].float()
    mb["row_ids"], mb["real_rows"] = r, real.clone()  # batch rows held here; False = DP-padding duplicate
    return mb


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


def micro_batches(batch: dict, rows: torch.Tensor, real: torch.Tensor, mbs: int = 0, extra: dict | None = None,
                  token_budget: int = 0, pad_to: int = 8) -> list[dict]:
    """This rank's rows -> micro-batches. ``token_budget`` > 0: sequence packing, each micro-batch one
    packed row of at most ``token_budget`` tokens (plus rounding to ``pad_to``); else ``mbs`` rows per
    padded micro-batch (0 = all rows in one). Every micro-batch carries ``input_ids`` [b, s],
    ``flat_idx`` [n, T] (see ``per_token``), ``placements`` [(row, start, length)] for R3, and the
    selected rows of every batch entry and of ``extra``."""
    if token_budget > 0:
        lengths = (batch["prompt_len"][rows] + batch["resp_len"][rows]).tolist()
        groups = [torch.tensor(g) for g in pack_rows(lengths, token_budget)]
        return [_packed(batch, rows[g], real[g], extra, pad_to) for g in groups]
    mbs = len(rows) if mbs <= 0 else mbs
    return [_padded(batch, rows[s:s + mbs], real[s:s + mbs], extra, pad_to) for s in range(0, len(rows), mbs)]


def pad_micro_batches(mbs: list[dict], count: int) -> list[dict]:
    """Append no-op micro-batches (the first one with every token masked) up to ``count``, so that
    all ranks run the same number of forwards (EP all-to-alls and pipeline schedules are collective)."""
    out = list(mbs)
    while len(out) < count:
        out.append(dict(out[0], mask=torch.zeros_like(out[0]["mask"]),
                        real_rows=torch.zeros_like(out[0]["real_rows"])))
    return out

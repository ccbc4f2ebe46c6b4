"""Rollout samples -> padded tensors, row sharding over DP, micro-batches.

Layout: ``tokens`` [N, L] = prompt + response, right-padded (L a multiple of ``pad_to`` so sequence
parallelism can split it). Response token t of row i sits at position P_i + t and is predicted by the
model output at position P_i - 1 + t; ``idx`` [N, T] holds those positions, so any per-position output
[N, L] becomes per-response-token [N, T] with one gather. The critic's output at that same position is
V(s_t) (state = prompt + first t response tokens), and at P_i - 1 it is V(s_0).
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


def micro_batches(batch: dict, rows: torch.Tensor, real: torch.Tensor, mbs: int, extra: dict | None = None) -> list[dict]:
    """Split this rank's rows into micro-batches of ``mbs`` rows (0 = one micro-batch)."""
    mbs = len(rows) if mbs <= 0 else mbs
    out = []
    for s in range(0, len(rows), mbs):
        r = rows[s:s + mbs]
        mb = select_rows(batch, r)
        for k, v in (extra or {}).items():
            mb[k] = v[r]
        mb["mask"] = mb["mask"] * real[s:s + mbs, None].float()
        mb["input_ids"] = mb["tokens"]
        out.append(mb)
    return out

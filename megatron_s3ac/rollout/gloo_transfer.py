"""The wire of the CPU weight transfer trainer -> vLLM workers: a stateless gloo group and flat buckets.

Imported on both sides of the process boundary (the trainer's environment and the vLLM engine's, which share
torch==2.13.0 and nothing else), so it needs torch only. Nothing is pickled: a bucket travels as one flat uint8
tensor (each tensor at an 8-byte aligned offset), its (name, dtype, shape) list as JSON in the control call.

    group = join_group(host, port, rank, world_size)      # trainer: rank 0 (hosts the store); workers: 1 + tp rank
    meta = bucket_meta(bucket); flat = pack(bucket)        # sender
    group.broadcast(flat, 0).wait()
    tensors = unpack(flat, meta)                           # receiver: [(name, view of flat)]
"""
from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist


def _pad8(n: int) -> int:
    return n + (-n % 8)


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def bucket_meta(bucket) -> dict:
    """{names, dtype_names, shapes} of a [(name, tensor)] bucket (vLLM's NCCL update-info fields)."""
    return {"names": [n for n, _ in bucket], "dtype_names": [dtype_name(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


def flat_nbytes(meta: dict) -> int:
    """Bytes of the flat bucket ``meta`` describes (every tensor 8-byte aligned)."""
    return sum(_pad8(math.prod(s) * torch_dtype(d).itemsize) for d, s in zip(meta["dtype_names"], meta["shapes"]))


def pack(bucket) -> torch.Tensor:
    """One flat uint8 CPU tensor holding the bucket's tensors back to back (8-byte aligned)."""
    parts = []
    for _, t in bucket:
        b = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        parts.append(b)
        if b.numel() % 8:
            parts.append(b.new_zeros(-b.numel() % 8))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack(flat: torch.Tensor, meta: dict) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] views of ``flat`` laid out by ``pack``."""
    out, at = [], 0
    for name, dt, shape in zip(meta["names"], meta["dtype_names"], meta["shapes"]):
        dtype = torch_dtype(dt)
        n = math.prod(shape) * dtype.itemsize
        out.append((name, flat[at:at + n].view(dtype).view(tuple(shape))))
        at += _pad8(n)
    return out


def join_group(host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0):
    """A gloo process group outside torch.distributed's default group (the trainer keeps its own): rank 0 hosts the
    TCP store. Both sides must call it; it returns once every rank has joined."""
    timeout = datetime.timedelta(seconds=float(timeout_s))
    store = dist.TCPStore(host, int(port), int(world_size), is_master=(rank == 0), timeout=timeout)
    prefixed = dist.PrefixStore("s3ac-vllm-weights", store)
    return GlooGroup(dist.ProcessGroupGloo(prefixed, int(rank), int(world_size), timeout), store)


class GlooGroup:
    """A gloo process group and the store it was made from (the store must outlive the group)."""

    def __init__(self, pg, store):
        self.pg, self.store = pg, store

    def broadcast(self, tensor: torch.Tensor, root: int = 0):
        """Start a broadcast of ``tensor`` from ``root``; returns the work (``wait()`` / ``is_completed()``)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = int(root)
        return self.pg.broadcast([tensor], opts)

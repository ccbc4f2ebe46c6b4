"""Weight sync trainer -> rollout engine, through the converter's in-memory export.

``sync_weights(model_chunks, info, engine_or_None, bucket_bytes)`` is called by every trainer rank;
exactly one rank passes the engine. Each pipeline stage runs ``export_hf_weights`` (the converter's
one name/layout mapping: TP/EP/ETP shards are gathered to the stage leader, bucket by bucket), and
each stage leader hands its buckets to the engine rank:

* the engine rank's own stage (when it is that stage's leader): buckets go straight to
  ``engine.update_weights``; an engine with ``weight_buffer`` (the colocated ``CPUEngine``) has the
  tensors assembled directly in its own parameter memory (``export_hf_weights(into=...)``), so each
  byte is copied once: from the local shard, or received from the owning rank straight into place;
* any other stage: the leader sends each bucket with plain point-to-point ``send``/``recv`` of tensors
  (an int64 header [header bytes, payload bytes], a UTF-8 JSON header of (name, dtype, shape) and one
  flat uint8 payload), then an end marker. No object collectives, so it works on gloo and NCCL alike
  (on NCCL the messages live on the current CUDA device).

The engine rank consumes its own stage first (interleaved with that stage's export when it is not the
leader), then the other stages in order; leaders of other stages block in ``send`` until then.
Afterwards the engine's ``flush_cache()`` is called. Memory on the engine rank: one bucket at a time.

Quantized rollout weights (``quantize``, e.g. ``functools.partial(convert.fp8.quantize_stream, keep=...)``):
each exported bucket is quantized on its stage leader, before it is sent or fed, so the bytes that
cross ranks (and ``SyncStats.bytes``) are the fp8 + scale pairs, not the trainer's dtype. The in-place
assembly into ``weight_buffer`` is then off: the engine must receive the pairs through ``update_weights``.

Names: the HF checkpoint names of the model the trainer was converted from (the converter's plan, e.g.
``model.language_model.*`` + ``lm_head.weight`` for a vision-language Qwen3.5-MoE checkpoint, text model
only). The engine maps them onto the module it holds (``CPUEngine``: ``cpu_engine.LM_PREFIXES``; SGLang:
its own checkpoint loader), so an engine built from the VL checkpoint, its text-only causal LM, or its
config all take the same stream; a vision tower in the engine is left as it is.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from megatron_s3ac.convert.export import export_hf_weights

_END = -1


@dataclass
class SyncStats:
    """What this rank did. On the engine rank: bytes/tensors/buckets fed to the engine."""

    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    seconds: float = 0.0
    engine_rank: int = -1

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def _comm_device() -> torch.device:
    backend = dist.get_backend()
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _pad8(n: int) -> int:
    return n + (-n % 8)


def _send_bucket(bucket: list[tuple[str, torch.Tensor]], dst: int, dev: torch.device) -> int:
    header = json.dumps([(n, _dtype_name(t.dtype), list(t.shape)) for n, t in bucket]).encode()
    parts = []
    for _, t in bucket:
        b = t.detach().contiguous().view(torch.uint8).reshape(-1).to(dev)
        parts.append(b)
        if b.numel() % 8:
            parts.append(b.new_zeros(-b.numel() % 8))  # every tensor starts 8-byte aligned on arrival
    payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=dev)
    dist.send(torch.tensor([len(header), payload.numel()], dtype=torch.int64, device=dev), dst=dst)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(dev), dst=dst)
    if payload.numel():
        dist.send(payload, dst=dst)
    return sum(t.numel() * t.element_size() for _, t in bucket)


def _send_end(dst: int, dev: torch.device) -> None:
    dist.send(torch.tensor([_END, 0], dtype=torch.int64, device=dev), dst=dst)


def _recv_bucket(src: int, dev: torch.device) -> list[tuple[str, torch.Tensor]] | None:
    sizes = torch.empty(2, dtype=torch.int64, device=dev)
    dist.recv(sizes, src=src)
    hlen, plen = (int(x) for x in sizes.tolist())
    if hlen == _END:
        return None
    hbuf = torch.empty(hlen, dtype=torch.uint8, device=dev)
    dist.recv(hbuf, src=src)
    header = json.loads(bytes(hbuf.cpu().numpy()).decode())
    payload = torch.empty(plen, dtype=torch.uint8, device=dev)
    if plen:
        dist.recv(payload, src=src)
    out, at = [], 0
    for name, dt, shape in header:
        dtype = getattr(torch, dt)
        n = math.prod(shape) * dtype.itemsize
        out.append((name, payload[at:at + n].view(dtype).view(shape)))
        at += _pad8(n)
    return out


def _roles(has_engine: bool, group) -> tuple[int, dict[int, int], int, int]:
    """(engine global rank, {pp stage: leader global rank}, my stage, my stage's leader)."""
    from megatron.core import parallel_state as ps

    me = dist.get_rank()
    stage = ps.get_pipeline_model_parallel_rank()
    leader = dist.get_global_rank(group, 0)
    dev = _comm_device()
    mine = torch.tensor([1 if has_engine else 0, stage, leader], dtype=torch.int64, device=dev)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    rows = [r.tolist() for r in rows]
    engines = [r for r, row in enumerate(rows) if row[0]]
    if len(engines) != 1:
        raise ValueError(f"sync_weights needs exactly one rank holding the engine; ranks {engines} pass one "
                         f"(rank {me})")
    leaders = {}
    for row in rows:
        leaders.setdefault(row[1], row[2])
    return engines[0], leaders, stage, leader


@torch.no_grad()
def sync_weights(model_chunks, info, engine=None, bucket_bytes: int = 256 << 20, group=None,
                 quantize: Optional[Callable[[list], Iterable]] = None) -> SyncStats:
    """Copy the live sharded actor's weights into ``engine`` (held by exactly one rank; ``None`` elsewhere).

    Collective over the whole default process group. ``model_chunks``: this rank's model chunks (one per
    virtual pipeline stage). ``group``: the export group of this rank's pipeline stage (default: megatron's
    tensor x data (x context) parallel group). ``quantize``: bucket [(name, tensor)] -> (name, tensor)
    stream, applied on the stage leader before the transfer (e.g. ``convert.fp8.quantize_stream``); the same
    on every rank. Returns this rank's ``SyncStats``.
    """
    from megatron.core import parallel_state as ps

    if group is None:
        group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    t0 = time.perf_counter()
    engine_rank, leaders, stage, leader = _roles(engine is not None, group)
    me, dev = dist.get_rank(), _comm_device()
    stats = SyncStats(engine_rank=engine_rank)

    def feed(bucket):
        engine.update_weights(bucket)
        stats.buckets += 1
        stats.tensors += len(bucket)
        stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)

    # 1) every stage exports; leaders either feed the engine (same rank) or send to the engine rank
    # A colocated engine that exposes its weight memory gets the stage assembled in place: one copy
    # from the trainer's shards (local pieces copied, remote ones received straight into it).
    into = getattr(engine, "weight_buffer", None) if (engine is not None and me == leader) else None
    if quantize is not None:
        into = None  # the quantized pairs must reach the engine through update_weights
    for bucket in export_hf_weights(model_chunks, info, bucket_bytes, group=group, into=into):
        if me == leader:
            if quantize is not None:  # before the transfer: fp8 + scales cross ranks, not the trainer's dtype
                bucket = list(quantize(bucket))
            if me == engine_rank:
                feed(bucket)
            else:
                stats.bytes += _send_bucket(bucket, engine_rank, dev)
                stats.buckets += 1
                stats.tensors += len(bucket)
        elif me == engine_rank:  # engine on a non-leader: take this bucket from our leader now
            got = _recv_bucket(leader, dev)
            assert got is not None, "stage leader ended the sync early"
            feed(got)
    if me == leader and me != engine_rank:
        _send_end(engine_rank, dev)

    # 2) the engine rank drains its own stage's end marker, then every other stage in order
    if me == engine_rank:
        for s in sorted(leaders):
            src = leaders[s]
            if src == me:
                continue
            if s == stage:  # our own stage's leader: its buckets were taken above
                if _recv_bucket(src, dev) is not None:
                    raise RuntimeError("stage leader sent more buckets than the export yielded")
                continue
            while (got := _recv_bucket(src, dev)) is not None:
                feed(got)
        engine.flush_cache()
    stats.seconds = time.perf_counter() - t0
    return stats

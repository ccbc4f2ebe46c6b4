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

* any other stage whose leader shares the engine rank's host, on CPU (``handoff=True``, the default): the leader
  assembles each bucket in a POSIX shared-memory segment of its own (``_SharedArena``: local pieces copied once,
  remote ones received in place) and hands the engine rank only a handle (segment name, offsets, names, dtypes,
  shapes); the engine rank reads the tensors in place and acknowledges, so the leader can reuse the segment. No
  byte of another stage crosses the engine rank's sockets: the CPU counterpart of handing a CUDA IPC handle per
  bucket. On CUDA, or across hosts, the leader sends the bucket's bytes point to point (above).

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
from megatron_s3ac.rollout.sync.strategy import WeightSyncStrategy

_END = -1


@dataclass
class SyncStats:
    """What this rank did. On the engine rank: bytes/tensors/buckets fed to the engine."""

    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    seconds: float = 0.0
    engine_rank: int = -1
    handed_bytes: int = 0  # a stage leader: bytes handed over in shared memory (read in place by the engine rank)

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


def _ack(dst: int, dev: torch.device) -> None:
    dist.send(torch.ones(1, dtype=torch.int64, device=dev), dst=dst)


def _send_end(dst: int, dev: torch.device) -> None:
    dist.send(torch.tensor([_END, 0], dtype=torch.int64, device=dev), dst=dst)


def _recv_bucket(src: int, dev: torch.device, views: "Optional[_SharedViews]" = None
                 ) -> list[tuple[str, torch.Tensor]] | None:
    """The next bucket from ``src`` (None at its end marker). A handed-over bucket comes back as views of the
    sender's shared memory: the caller must ``_ack(src)`` once it has read them."""
    sizes = torch.empty(2, dtype=torch.int64, device=dev)
    dist.recv(sizes, src=src)
    hlen, plen = (int(x) for x in sizes.tolist())
    if hlen == _END:
        return None
    hbuf = torch.empty(hlen, dtype=torch.uint8, device=dev)
    dist.recv(hbuf, src=src)
    header = json.loads(bytes(hbuf.cpu().numpy()).decode())
    if plen == _HANDOFF:
        buf = views.open(header["shm"], header["size"])
        return [(name, buf[at:at + math.prod(shape) * getattr(torch, dt).itemsize].view(getattr(torch, dt)).view(shape))
                for name, dt, shape, at in header["items"]]
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


_HANDOFF = -2  # payload-length marker: the bucket lies in the sender's shared memory, only its handle is sent


class _SharedArena:
    """A stage leader's bucket assembly area in POSIX shared memory (``into`` for ``export_hf_weights``): tensors back
    to back, each at an offset aligned to its element size. One segment, reused by every bucket and sync; replaced
    by a larger one only for a single tensor larger than it."""

    def __init__(self, nbytes: int):
        self.shm, self.buf = None, None
        self._new(max(int(nbytes), 8))

    def _new(self, n: int) -> None:
        from multiprocessing.shared_memory import SharedMemory

        self.close()
        self.shm = SharedMemory(create=True, size=n)
        self.buf = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=n)
        self.at, self.items = 0, []
        self.linked = True  # unlinked once the engine rank has mapped it (its first acknowledgement)

    def reset(self) -> None:
        self.at, self.items = 0, []

    def __call__(self, name: str, shape, dtype: torch.dtype):
        n = math.prod(shape) * dtype.itemsize
        at = _pad8(self.at)
        if at + n > self.buf.numel():
            if self.at:  # a bucket exceeds its bound only as a single tensor
                return None
            self._new(_pad8(n))
            at = 0
        t = self.buf[at:at + n].view(dtype).view(tuple(shape))
        self.items.append((name, _dtype_name(dtype), list(shape), at))
        self.at = at + n
        return t

    def holds(self, bucket) -> bool:
        """Every tensor of the bucket was assembled here, in order (none made elsewhere, none transformed)."""
        base = self.buf.data_ptr()
        return len(bucket) == len(self.items) and all(
            n == it[0] and t.data_ptr() == base + it[3] for (n, t), it in zip(bucket, self.items))

    def mapped(self) -> None:
        """The engine rank has mapped the segment: drop its name (nothing leaks if a rank is killed)."""
        if self.linked:
            self.shm.unlink()
            self.linked = False

    def close(self) -> None:
        if self.shm is not None:
            self.buf = None
            try:
                self.shm.close()
                if self.linked:
                    self.shm.unlink()
            except (BufferError, FileNotFoundError):
                pass
            self.shm = None


class _SharedViews:
    """The engine rank's side: segments of other ranks mapped once (by name) and read in place."""

    def __init__(self):
        self.maps: dict = {}

    def open(self, name: str, nbytes: int):
        if name not in self.maps:
            from megatron_s3ac.convert.export import attach_shared

            # not through multiprocessing.shared_memory: attaching would register the segment with this process's
            # resource tracker (Python < 3.13), which unlinks it at exit; its owner does that
            self.maps[name] = attach_shared(name, nbytes)
        return self.maps[name]


def _send_handoff(arena: _SharedArena, dst: int, dev: torch.device) -> int:
    header = json.dumps({"shm": arena.shm.name, "size": arena.buf.numel(), "items": arena.items}).encode()
    dist.send(torch.tensor([len(header), _HANDOFF], dtype=torch.int64, device=dev), dst=dst)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(dev), dst=dst)
    ack = torch.empty(1, dtype=torch.int64, device=dev)
    dist.recv(ack, src=dst)  # the engine rank has read the bucket: the segment may be reused
    arena.mapped()
    return sum(math.prod(sh) * getattr(torch, dt).itemsize for _, dt, sh, _ in arena.items)


def _roles(has_engine: bool, group) -> tuple[int, dict[int, int], int, int]:
    """(engine global rank, {pp stage: leader global rank}, my stage, my stage's leader)."""
    return _roles_hosts(has_engine, group)[:4]


def _host_id() -> int:
    import socket
    import zlib

    return zlib.crc32(socket.gethostname().encode())


def _roles_hosts(has_engine: bool, group, bucket_bytes: int = 0):
    """_roles + {global rank: host id} (ranks on one host share memory) + the engine rank's ``bucket_bytes``."""
    from megatron.core import parallel_state as ps

    me = dist.get_rank()
    stage = ps.get_pipeline_model_parallel_rank()
    leader = dist.get_global_rank(group, 0)
    dev = _comm_device()
    mine = torch.tensor([1 if has_engine else 0, stage, leader, _host_id(), int(bucket_bytes)], dtype=torch.int64,
                        device=dev)
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
    return engines[0], leaders, stage, leader, {r: row[3] for r, row in enumerate(rows)}, rows[engines[0]][4]


def _handing(leaders: dict, hosts: dict, engine_rank: int, handoff: bool) -> set:
    """The stage leaders that hand their buckets over in shared memory (CPU, same host as the engine rank)."""
    return {src for src in leaders.values() if handoff and _comm_device().type == "cpu"
            and src != engine_rank and hosts[src] == hosts[engine_rank]}


def _arena_for(model_chunks, bucket_bytes: int) -> _SharedArena:
    arena = model_chunks[0].__dict__.get("_s3ac_shared_arena")
    if arena is None:
        arena = model_chunks[0].__dict__["_s3ac_shared_arena"] = _SharedArena(bucket_bytes)
        arena.buf.zero_()  # its pages allocated now, not on the first sync's writes
    return arena


@torch.no_grad()
def prepare_weight_sync(model_chunks, info, engine=None, bucket_bytes: int = 256 << 20, group=None,
                        quantize: Optional[Callable[[list], Iterable]] = None, handoff: bool = True,
                        export_shm: Optional[bool] = None) -> float:
    """Build, at start-up, what the first ``sync_weights`` with the same arguments would otherwise build inside
    itself: the export plan of every stage (``convert.export.prepare_export``: pieces, metadata exchange, buckets,
    connections, shared-memory segments with their pages touched), the stage leaders' hand-over arenas, and the
    engine's name map. Collective over the whole default process group, like the sync. Returns its seconds."""
    from megatron.core import parallel_state as ps

    from megatron_s3ac.convert.export import prepare_export

    t0 = time.perf_counter()
    if group is None:
        group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    engine_rank, leaders, _, leader, hosts, bucket_bytes = _roles_hosts(engine is not None, group, bucket_bytes)
    prepare_export(model_chunks, info, bucket_bytes, group=group, shm=export_shm)
    if dist.get_rank() == leader and leader in _handing(leaders, hosts, engine_rank, handoff and quantize is None):
        _arena_for(model_chunks, bucket_bytes)
    names = getattr(engine, "hf_weight_names", None)
    if callable(names):
        names()  # CPUEngine: its checkpoint-name -> parameter map
    dist.barrier()
    return time.perf_counter() - t0


@torch.no_grad()
def sync_weights(model_chunks, info, engine=None, bucket_bytes: int = 256 << 20, group=None,
                 quantize: Optional[Callable[[list], Iterable]] = None, handoff: bool = True,
                 export_shm: Optional[bool] = None) -> SyncStats:
    """Copy the live sharded actor's weights into ``engine`` (held by exactly one rank; ``None`` elsewhere).

    Collective over the whole default process group. ``model_chunks``: this rank's model chunks (one per
    virtual pipeline stage). ``bucket_bytes``: the engine rank's value is used on every rank (the engine's choice;
    ranks of one stage must export with the same buckets). ``group``: the export group of this rank's pipeline
    stage (default: megatron's tensor x data (x context) parallel group). ``quantize``: bucket [(name, tensor)] -> (name, tensor)
    stream, applied on the stage leader before the transfer (e.g. ``convert.fp8.quantize_stream``); the same
    on every rank. ``handoff``: other stages' leaders on the engine rank's host hand buckets over in shared
    memory (CPU) instead of sending their bytes. ``export_shm``: inside a stage, TP/EP ranks on the leader's host
    hand their pieces over in shared memory (``export_hf_weights(shm=)``; None: its default). Returns this rank's
    ``SyncStats``.
    """
    from megatron.core import parallel_state as ps

    if group is None:
        group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    t0 = time.perf_counter()
    # the engine rank's bucket size on every rank (it is the engine's choice: a session engine sets it there), so
    # every rank of a stage runs the same export plan
    engine_rank, leaders, stage, leader, hosts, bucket_bytes = _roles_hosts(engine is not None, group, bucket_bytes)
    me, dev = dist.get_rank(), _comm_device()
    stats = SyncStats(engine_rank=engine_rank)
    handing = _handing(leaders, hosts, engine_rank, handoff and quantize is None)
    views = None
    if me == engine_rank and handing:
        views = model_chunks[0].__dict__.setdefault("_s3ac_shared_views", _SharedViews())

    failed: list = []

    def feed(bucket):
        # an engine that fails (its process died mid-sync) takes no more buckets, but this rank still runs the rest
        # of the export and the transfers, so the other ranks finish their side (no one left inside a collective);
        # the error is raised once the protocol is through
        if failed:
            return
        try:
            engine.update_weights(bucket)
        except Exception as err:  # noqa: BLE001 - re-raised below, with its own type
            failed.append(err)
            return
        stats.buckets += 1
        stats.tensors += len(bucket)
        stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)

    # 1) every stage exports; leaders either feed the engine (same rank) or send to the engine rank
    # A colocated engine that exposes its weight memory gets the stage assembled in place: one copy
    # from the trainer's shards (local pieces copied, remote ones received straight into it).
    into = getattr(engine, "weight_buffer", None) if (engine is not None and me == leader) else None
    arena = None
    if me in handing and me == leader:
        into = arena = _arena_for(model_chunks, bucket_bytes)
    if quantize is not None:
        into = None  # the quantized pairs must reach the engine through update_weights
    for bucket in export_hf_weights(model_chunks, info, bucket_bytes, group=group, into=into, shm=export_shm):
        if me == leader:
            if quantize is not None:  # before the transfer: fp8 + scales cross ranks, not the trainer's dtype
                bucket = list(quantize(bucket))
            if me == engine_rank:
                feed(bucket)
            elif arena is not None and bucket and arena.holds(bucket):
                n = _send_handoff(arena, engine_rank, dev)
                stats.bytes += n
                stats.handed_bytes += n
                stats.buckets += 1
                stats.tensors += len(bucket)
            else:
                stats.bytes += _send_bucket(bucket, engine_rank, dev)
                stats.buckets += 1
                stats.tensors += len(bucket)
            if arena is not None:
                arena.reset()
        elif me == engine_rank:  # engine on a non-leader: take this bucket from our leader now
            got = _recv_bucket(leader, dev, views)
            assert got is not None, "stage leader ended the sync early"
            feed(got)
            if leader in handing:
                _ack(leader, dev)
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
            while (got := _recv_bucket(src, dev, views)) is not None:
                feed(got)
                if src in handing:
                    _ack(src, dev)
        if failed:
            raise failed[0]
        engine.flush_cache()
    stats.seconds = time.perf_counter() - t0
    return stats


class RankZeroSync(WeightSyncStrategy):
    """cpu / hf engines (registered in ``rollout.sync.strategy``): rank 0's engine receives every pipeline stage's
    tensors through ``sync_weights`` (in process, or a ``RemoteEngine`` at ``rollout.placement: separate``). A
    sleeping engine is woken whole first: its weights come back re-allocated but stale, the sync refills every one."""

    def sync(self, chunks, info, weights_loaded=None):
        if self.engine is not None and self.asleep:
            self.engine.wake()
            self.asleep = False
        q = self.quantize  # every rank: stage leaders quantize before the transfer
        stats = sync_weights(chunks, info, self.engine, **({} if q is None else {"quantize": q}))
        if weights_loaded is not None:
            weights_loaded()
        return stats


class ColocatedRankZeroSync(RankZeroSync):
    """The rank-0 path with the engine in rank 0's process: released while the models train (``sleep``), and left
    to the process at the end of a run (no processes of its own to shut down)."""

    sleeps = True
    shuts_down_engine = False

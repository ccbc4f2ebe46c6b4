"""Separate-GPU weight sync, trainer side: ``init_weights_update_group`` + broadcast, bucket by bucket.

sglang's engine side (0.5.23, model_executor/model_runner_components/weight_updater.py:100-144, 260-310): each
engine TP rank joins a torch.distributed group of ``world_size`` = 1 + sum of the engines' TP sizes as rank
``rank_offset + tp_rank`` (the trainer's sender is rank 0), through ``init_custom_process_group``
(utils/common.py:2859-2927: rendezvous on ``init_method``, a PrefixStore named after the group, a group outside
the default world). For each bucket the engine allocates the tensors and receives them with
``broadcast(src=0)``: one broadcast per tensor, or one of the whole flat uint8 bucket with
``load_format="flattened_bucket"`` (weight_sync/tensor_bucket.py:86-112: tensors back to back, no padding, each
starting at a multiple of its element size).

``WeightBroadcaster`` is that rank 0: it asks every engine to join (asynchronously: joining blocks until all
members have), joins itself, then per bucket asks every engine to receive and broadcasts the flat bucket.
The engines must be inside a weight-update session (``EnginePool.begin_weight_update`` / ``finish_sync``),
opened once around the whole sync. The bytes come from the rank that owns them: with pipeline parallelism each
stage leader runs its own broadcaster (group ``<name>-pp<stage>``) over the stage's exported buckets, taking
turns in stage order, so nothing is gathered through one rank.
"""
from __future__ import annotations

import datetime
import math
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_s3ac.rollout.engines.sglang import ipc
from megatron_s3ac.rollout.sync.messages import recv_obj, send_obj
from megatron_s3ac.rollout.sync.planned import planned_weights
from megatron_s3ac.rollout.sync.rendezvous import free_port, rendezvous_address
from megatron_s3ac.rollout.sync.strategy import WeightSyncStrategy


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: Optional[datetime.timedelta] = None):
    """A process group independent of the default one (which may not exist), the way sglang's engine creates its
    side (utils/common.py:2859-2927), so both sides rendezvous on the same store keys. Blocks until all join."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    from megatron_s3ac.rollout.sync.transfer_groups import transfer_group_error_handling

    timeout = timeout or datetime.timedelta(minutes=10)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # NCCL: TORCH_NCCL_ASYNC_ERROR_HANDLING=2 for this group only, so an engine that dies mid-broadcast does not take
    # the trainer down through the group's watchdog (rollout.sync.transfer_groups)
    with transfer_group_error_handling():
        pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                          backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def flat_bucket(bucket: Sequence[tuple[str, torch.Tensor]], device: torch.device):
    """(names, dtype names, shapes, flat uint8 tensor on device) in sglang's flattened-bucket layout. Tensors are
    ordered by decreasing element size so each starts aligned (the receiver refuses unaligned offsets)."""
    order = sorted(bucket, key=lambda nt: -nt[1].element_size())
    names, dtypes, shapes, parts = [], [], [], []
    for name, t in order:
        t = t.detach().contiguous()
        names.append(name)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append(list(t.shape))
        parts.append(t.reshape(-1).view(torch.uint8).to(device))
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    return names, dtypes, shapes, flat


class WeightBroadcaster:
    """Rank 0 of a weight-update group with the engines of ``pool`` (an EnginePool: its ``submit``/``wait``
    run engine methods asynchronously, errors name the engine).

    backend: "nccl" on GPUs (engine TP ranks receive on their GPUs), "gloo" on CPU (tests).
    """

    def __init__(self, pool, group_name: str = "s3ac-weights", master_address: Optional[str] = None,
                 master_port: Optional[int] = None, backend: str = "nccl", device: Optional[torch.device] = None,
                 timeout_s: float = 600.0):
        self.pool, self.group_name, self.backend = pool, group_name, backend
        self.master_address = master_address or rendezvous_address()
        self.master_port = int(master_port or free_port())
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                                 else torch.device("cpu"))
        self.timeout_s = float(timeout_s)
        self.group = None
        self.tp_sizes = list(pool.tp_sizes)
        self.world_size = 1 + sum(self.tp_sizes)

    def connect(self) -> None:
        """Every engine joins (rank_offset = 1 + TP ranks of the engines before it), then this rank; both sides
        block until the group is complete, hence the asynchronous engine calls."""
        offsets = [1 + sum(self.tp_sizes[:i]) for i in range(len(self.tp_sizes))]
        refs = [self.pool.submit(i, "init_weights_update_group", self.master_address, self.master_port, off,
                                 self.world_size, self.group_name, self.backend)
                for i, off in enumerate(offsets)]
        self.group = init_custom_process_group(self.backend, f"tcp://{self.master_address}:{self.master_port}",
                                               self.world_size, 0, self.group_name,
                                               timeout=datetime.timedelta(seconds=self.timeout_s))
        self.pool.wait(refs, "init_weights_update_group", self.timeout_s)

    def send(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> dict:
        """Broadcast each bucket (engines inside a session). Returns {"tensors", "bytes", "buckets", "names"}."""
        if self.group is None:
            raise RuntimeError("WeightBroadcaster.connect() first")
        stats = {"tensors": 0, "bytes": 0, "buckets": 0, "names": []}
        for bucket in buckets:
            if not bucket:
                continue
            names, dtypes, shapes, flat = flat_bucket(bucket, self.device)
            # names/shapes against each served checkpoint first: sglang would skip unknown names silently
            self.pool.wait([self.pool.submit(i, "check_weights", names, shapes) for i in range(len(self.tp_sizes))],
                           "check_weights", self.timeout_s)
            refs = [self.pool.submit(i, "update_weights_from_distributed", names, dtypes, shapes, self.group_name)
                    for i in range(len(self.tp_sizes))]
            work = dist.broadcast(flat, src=0, group=self.group, async_op=True)
            self.pool.wait(refs, f"update_weights_from_distributed (bucket {stats['buckets']}: {names[0]} ..)",
                           self.timeout_s)
            work.wait()
            stats["tensors"] += len(names)
            stats["bytes"] += int(flat.numel())
            stats["buckets"] += 1
            stats["names"].extend(names)
        return stats

    def close(self) -> None:
        if self.group is None:
            return
        refs = [self.pool.submit(i, "destroy_weights_update_group", self.group_name) for i in range(len(self.tp_sizes))]
        dist.destroy_process_group(self.group)
        self.group = None
        self.pool.wait(refs, "destroy_weights_update_group", self.timeout_s)


# ------------------------------------------------------------------------------------------------
# The trainer's whole separate-GPU sync: every pipeline stage's leader broadcasts its own stage
# ------------------------------------------------------------------------------------------------
class _FlatArena:
    """``into`` for ``export_hf_weights``: assembles a bucket's HF tensors back to back in one uint8 buffer, so the
    flattened bucket to broadcast IS the assembly (no concatenating copy). A tensor that would start unaligned for
    its dtype (sglang's receiver has no padding) is refused (None): the export then makes it a tensor of its own and
    the bucket falls back to ``flat_bucket``."""

    def __init__(self, nbytes: int, device: torch.device):
        self.buf = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=device)
        self.at, self.placed = 0, {}

    def reset(self) -> None:
        self.at, self.placed = 0, {}

    def __call__(self, name: str, shape, dtype: torch.dtype):
        n = math.prod(shape) * dtype.itemsize
        if self.at % dtype.itemsize:
            return None
        if self.at + n > self.buf.numel():
            if self.at:  # a bucket never exceeds its bound unless it is one tensor: grow only then
                return None
            self.buf = torch.empty(n, dtype=torch.uint8, device=self.buf.device)
        t = self.buf[self.at:self.at + n].view(dtype).view(tuple(shape))
        self.placed[name] = (self.at, n)
        self.at += n
        return t

    def flat(self, bucket) -> Optional[torch.Tensor]:
        """The bucket's flattened tensor if every tensor of it was assembled here in order, else None."""
        at = 0
        for name, t in bucket:
            if self.placed.get(name, (None,))[0] != at or t.data_ptr() != self.buf.data_ptr() + at:
                return None
            at += t.numel() * t.element_size()
        return self.buf[:at]


def _header(bucket) -> tuple[list, list, list]:
    """(names, dtype names, shapes) of a bucket, in its order."""
    return ([n for n, _ in bucket], [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            [list(t.shape) for _, t in bucket])


def leader_arena(sync, is_leader: bool, bucket_bytes: int, dev: torch.device, quantize=None):
    """The ``into`` a stage leader passes ``export_hf_weights``: ``sync._arena`` (made on first use), None off the
    leader or when the stream is quantized (the fp8 pairs are new tensors: nothing to assemble in place)."""
    if not is_leader:
        return None
    if sync._arena is None:
        sync._arena = _FlatArena(bucket_bytes, dev)
    return sync._arena if quantize is None else None


def leader_flat(bucket, into: "Optional[_FlatArena]", quantize, dev: torch.device):
    """A stage leader's exported bucket -> ((names, dtype names, shapes), flat uint8 bucket): quantized first when
    asked; the arena's own buffer when the export assembled the bucket there in order, else a flattening copy."""
    if bucket and quantize is not None:
        bucket = list(quantize(bucket))
    flat = into.flat(bucket) if into is not None and bucket else None
    if flat is None:
        names, dtypes, shapes, flat = flat_bucket(bucket, dev)
        return (names, dtypes, shapes), flat
    return _header(bucket), flat


def open_sync(pool, info, controller: int, cache: Optional[dict] = None) -> None:
    """Every rank, at the start of a weight sync (collective over the default group). The controller checks every
    tensor the export will send against each engine's served checkpoint (names and shapes: sglang would skip an
    unknown name silently) and opens the engines' weight-update sessions; its verdict reaches every rank, so a
    refusal stops all of them before the first bucket moves and no engine is left with half the new weights.
    ``cache``: a dict kept by the caller across syncs (the plan of a 397B model takes ~0.5 s to build)."""
    me, error = dist.get_rank(), None
    if me == controller:
        try:
            cache = {} if cache is None else cache
            if cache.get("info") is not info:
                cache.update(info=info, planned=planned_weights(info))
            names, shapes = cache["planned"]
            pool.wait([pool.submit(e, "check_weights", names, shapes) for e in range(len(pool.tp_sizes))],
                      "check_weights (every tensor of the sync)")
            pool.begin_weight_update()
        except BaseException as err:
            error = err
    box = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(box, src=controller)
    if error is not None:
        raise error
    if box[0] is not None:
        raise RuntimeError(f"rank {me}: rank {controller}, which drives the engines, refused the weight sync before "
                           f"it started: {box[0]}")


def start_sync(sync, info, export_group=None):
    """The start of a stage-wise sync on every rank (StageBroadcastSync, ColocatedIPCSync): connect once
    (``sync.connect``), then ``open_sync``. Returns (the export group, this rank's SyncStats)."""
    from megatron_s3ac.rollout.sync.weight_sync import SyncStats

    if export_group is None:
        from megatron.core import parallel_state as ps

        export_group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    if sync.roles is None:
        sync.connect(export_group)
    ctl = sync.roles["controller"]
    open_sync(sync.pool, info, ctl, sync._planned)
    return export_group, SyncStats(engine_rank=ctl)


def abort_sync(pool) -> None:
    """The controller, after a failed stage-wise sync (StageBroadcastSync, ColocatedIPCSync): end the engines' open
    weight-update session so the next sync can open one; an error of this end is secondary to the one raised."""
    try:
        pool.end_weight_update()
    except Exception:
        pass

class StageBroadcastSync:
    """Separate-GPU weight sync from the ranks that own the bytes (every trainer rank builds one; the rank that
    holds the engine pool passes ``pool``, the others None).

    Each pipeline stage's export leader (``weight_sync`` roles: tp = dp = ep = 0 of that stage) is rank 0 of its own
    weight-update group with every engine TP rank (group ``<group_name>-pp<stage>``, as slime gives each PP source
    rank its own group) and broadcasts its stage's flattened buckets straight to the engines. TP/EP/ETP shards reach
    their stage leader inside the stage (``export_hf_weights``: main replicas only, point-to-point within the
    stage's tensor x data group, i.e. experts within their EP group); nothing goes through the pool's rank. That
    rank (the *controller*, which must lead its own stage) only drives the engines: per bucket it receives the
    bucket's (names, dtypes, shapes) from the stage leader (a few hundred bytes), checks them against every served
    checkpoint (sglang would skip unknown names silently), lets the leader broadcast and asks the engines to receive
    (``update_weights_from_distributed``, flattened bucket), then checks every ``(success, message)``.

    One weight-update session per engine around the whole sync (``pool.begin_weight_update`` ...
    ``pool.finish_sync``: end, flush retried, completeness over all stages' names). Stages take turns in stage
    order (each engine receives one bucket at a time); a later stage's leader waits in its first header send.
    The bucket is assembled straight into the flat tensor that is broadcast (``_FlatArena``): one copy of the
    leader's own pieces, received pieces land in place, no concatenation.

        sync = StageBroadcastSync(pool if rank == 0 else None)   # every rank
        stats = sync.sync(model_chunks, info, bucket_bytes)       # every rank, every weight sync
    """

    def __init__(self, pool=None, group_name: str = "s3ac-weights", master_address: Optional[str] = None,
                 backend: Optional[str] = None, timeout_s: float = 600.0, require_complete: bool = True):
        self.pool, self.group_name = pool, group_name
        self.master_address, self.backend = master_address, backend
        self.timeout_s, self.require_complete = float(timeout_s), bool(require_complete)
        self.group = None  # this rank's group with the engines (stage leaders only)
        self.roles = None
        self._arena = None
        self._planned: dict = {}  # open_sync's cache of the export's names/shapes

    def _group_name(self, stage: int) -> str:
        return f"{self.group_name}-pp{stage}"

    def connect(self, export_group=None) -> None:
        """Collective over the default group, once: the stage leaders and every engine join the per-stage groups."""
        from megatron_s3ac.rollout.sync.weight_sync import _comm_device, _roles

        if export_group is None:
            from megatron.core import parallel_state as ps

            export_group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        ctl, leaders, stage, leader = _roles(self.pool is not None, export_group)
        me = dist.get_rank()
        if me == ctl and leaders[stage] != me:
            raise ValueError(f"rank {me} holds the engine pool but does not lead its pipeline stage {stage} (rank "
                             f"{leaders[stage]} does): build the pool on a stage leader (e.g. global rank 0)")
        backend = self.backend or ("nccl" if "nccl" in str(dist.get_backend()).lower() else "gloo")
        mine = None
        if me == leader:
            addr = self.master_address or rendezvous_address()
            mine = (stage, addr, free_port(addr))
        rows = [None] * dist.get_world_size()
        key = ipc.device_key() if torch.cuda.is_available() else None  # CPU slots are not devices: nothing to share
        dist.all_gather_object(rows, (mine, list(self.pool.tp_sizes) if me == ctl else None, key))
        tp_sizes = next(t for _, t, _ in rows if t is not None)
        addrs = {m[0]: (m[1], m[2]) for m, _, _ in rows if m is not None}
        self._check_disjoint(ctl, [k for _, _, k in rows])
        world = 1 + sum(tp_sizes)
        self.roles = dict(controller=ctl, leaders=leaders, stage=stage, leader=leader, tp_sizes=tp_sizes,
                          device=_comm_device(), backend=backend)
        refs = []
        if me == ctl:
            offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
            for s in sorted(addrs):  # each engine joins the stages' groups in this order (one call at a time)
                a, p = addrs[s]
                refs += [self.pool.submit(e, "init_weights_update_group", a, p, off, world, self._group_name(s),
                                          backend) for e, off in enumerate(offsets)]
        if me == leader:
            a, p = addrs[stage]
            self.group = init_custom_process_group(backend, f"tcp://{a}:{p}", world, 0, self._group_name(stage),
                                                   timeout=datetime.timedelta(seconds=self.timeout_s))
        if refs:
            self.pool.wait(refs, "init_weights_update_group", self.timeout_s)
        dist.barrier()

    def _check_disjoint(self, ctl: int, trainer_keys) -> None:
        """Collective: every rank raises when an engine shares a GPU with a trainer rank (``shared_devices``)."""
        from megatron_s3ac.rollout.engines.pool import shared_devices

        box = [None]
        if dist.get_rank() == ctl and any(k is not None for k in trainer_keys):
            try:
                box[0] = shared_devices(trainer_keys, self.pool.device_keys())
            except Exception as err:  # every rank raises it, none waits forever
                box[0] = [f"{type(err).__name__}: {err}"]
        dist.broadcast_object_list(box, src=ctl)
        if box[0]:
            raise ValueError(
                f"rank {dist.get_rank()}: rollout.placement: separate, but the engines share GPUs with the trainer: "
                f"{'; '.join(box[0][:4])}{' ...' if len(box[0]) > 4 else ''}. Give the engines GPUs of their own "
                f"(examples/paper/launch.sh: TRAINER_GPUS_PER_NODE < GPUS_PER_NODE; Ray then gets the rest)")

    # -- one sync -------------------------------------------------------------------------------
    def _serve(self, stage: int, header, broadcast) -> None:
        """Controller: one bucket of ``stage`` into every engine. ``broadcast()`` starts the leader's side (local
        broadcast, or the go-ahead to a remote leader) and returns something with ``wait()`` or None."""
        names, dtypes, shapes = header
        n = len(self.roles["tp_sizes"])
        self.pool.wait([self.pool.submit(e, "check_weights", names, shapes) for e in range(n)], "check_weights",
                       self.timeout_s)
        refs = [self.pool.submit(e, "update_weights_from_distributed", names, dtypes, shapes,
                                 self._group_name(stage)) for e in range(n)]
        work = broadcast()
        self.pool.wait(refs, f"update_weights_from_distributed (stage {stage}: {names[0]} .. {names[-1]}, "
                             f"{len(names)} tensors)", self.timeout_s)
        if work is not None:
            work.wait()

    def _serve_remote(self, stage: int, src: int, dev: torch.device) -> list[str]:
        """Controller: every bucket stage ``stage``'s leader (global rank ``src``) announces, until its end marker."""
        names = []
        while (header := recv_obj(src, dev)) is not None:
            said = []

            def go():
                dist.send(torch.ones(1, dtype=torch.int64, device=dev), dst=src)
                said.append(True)

            try:
                self._serve(stage, header, go)
            except BaseException:
                if not said:  # the leader waits for its go-ahead: tell it no, so it stops instead of broadcasting
                    dist.send(torch.zeros(1, dtype=torch.int64, device=dev), dst=src)
                raise
            names += header[0]
        return names

    @torch.no_grad()
    def sync(self, model_chunks, info, bucket_bytes: int = 512 << 20, export_group=None, quantize=None):
        """Every rank, every weight sync (collective over the default group). ``quantize``: as in
        ``weight_sync.sync_weights`` (applied on the stage leader before the broadcast). Returns this rank's
        SyncStats: bytes/buckets this rank broadcast; on the controller ``tensors`` counts every stage's."""
        import time

        from megatron_s3ac.convert.export import export_hf_weights

        t0 = time.perf_counter()
        export_group, stats = start_sync(self, info, export_group)
        r, me = self.roles, dist.get_rank()
        ctl, leader, stage, dev = r["controller"], r["leader"], r["stage"], r["device"]
        names_all: list[str] = []
        try:
            into = leader_arena(self, me == leader, bucket_bytes, dev, quantize)
            for bucket in export_hf_weights(model_chunks, info, bucket_bytes, group=export_group, into=into):
                if me != leader or not bucket:
                    continue
                header, flat = leader_flat(bucket, into, quantize, dev)
                start = lambda: dist.broadcast(flat, src=0, group=self.group, async_op=True)
                if me == ctl:
                    self._serve(stage, header, start)
                else:
                    send_obj(header, ctl, dev)
                    ok = torch.empty(1, dtype=torch.int64, device=dev)
                    dist.recv(ok, src=ctl)
                    if not int(ok.item()):
                        raise RuntimeError(f"rank {me} (stage {stage} leader): rank {ctl}, which drives the engines, "
                                           f"refused bucket {header[0][0]} .. (its error names the cause)")
                    start().wait()
                names_all += header[0]
                stats.buckets += 1
                stats.tensors += len(header[0])
                stats.bytes += int(flat.numel())
                if into is not None:
                    self._arena.reset()
            if me == leader and me != ctl:
                send_obj(None, ctl, dev)  # end of this stage
            if me == ctl:  # then every other stage, in order, as its leader sends it
                for s in sorted(r["leaders"]):
                    if r["leaders"][s] != me:
                        names_all += self._serve_remote(s, r["leaders"][s], dev)
                self.pool.finish_sync(names_all, self.require_complete)
                stats.tensors = len(names_all)
        except BaseException:
            if me == ctl:
                abort_sync(self.pool)
            raise
        stats.seconds = time.perf_counter() - t0
        return stats

    def close(self) -> None:
        """Engines leave every stage's group, then the leaders (collective over the default group)."""
        if self.roles is None:
            return
        me = dist.get_rank()
        refs = []
        # a pool whose engine died (EnginePool._failure: its process is gone, and with it the engine's side of every
        # group) takes no more calls: the asynchronous loop's restart closes the sync of a dead pool
        dead = getattr(self.pool, "_failure", None) is not None
        if me == self.roles["controller"] and not dead:
            for s in sorted(self.roles["leaders"]):
                refs += [self.pool.submit(e, "destroy_weights_update_group", self._group_name(s))
                         for e in range(len(self.roles["tp_sizes"]))]
        if self.group is not None:
            from megatron_s3ac.rollout.sync.transfer_groups import abort_group

            # a dead pool's engines left the group with a broadcast pending: NCCL aborts it (destroy would flush it
            # first, ProcessGroupNCCL::shutdown); gloo's is destroyed as before
            if not (dead and abort_group(self.group)):
                dist.destroy_process_group(self.group)
            self.group = None
        if refs:
            self.pool.wait(refs, "destroy_weights_update_group", self.timeout_s)
        self.roles = None


class SGLangSync(WeightSyncStrategy):
    """What both sglang strategies share: ``settings`` (``rollout.sglang``, default ``SGLangSettings()``), the
    stage-wise sync object they drive (``_make()``, built on first use) and its ``close``."""

    def __init__(self, engine=None, *, settings=None, quantize=None):
        from megatron_s3ac.rollout.engines.sglang.settings import SGLangSettings

        super().__init__(engine, settings=SGLangSettings() if settings is None else settings, quantize=quantize)
        self._inner = None

    def _make(self):
        raise NotImplementedError

    def _built(self):
        """The stage-wise sync object, built on first use (before the engine wakes: it connects nothing yet)."""
        if self._inner is None:
            self._inner = self._make()
        return self._inner

    def _sync(self, chunks, info):
        return self._built().sync(chunks, info, self.settings.bucket_bytes, quantize=self.quantize)

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
            self._inner = None


class SGLangBroadcastSync(SGLangSync):
    """sglang engines on their own GPUs (``rollout.placement: separate``; registered in ``rollout.sync.strategy``):
    each pipeline stage's leader broadcasts its own stage (``StageBroadcastSync``, connected on first use). The
    engines keep their memory between rollouts (no sleep / wake)."""

    def _make(self):
        return StageBroadcastSync(self.engine, timeout_s=self.settings.timeout_s)

    def sync(self, chunks, info, weights_loaded=None):
        stats = self._sync(chunks, info)
        if weights_loaded is not None:
            weights_loaded()
        return stats

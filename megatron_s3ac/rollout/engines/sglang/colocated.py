"""Colocated weight sync to SGLang engines: each engine TP rank reads its buckets from the trainer rank on its own GPU.

With ``rollout.placement: colocated`` the engines' TP ranks run on the trainer's GPUs. sglang loads a bucket
with ``update_weights_from_tensor(named_tensors=[one serialized payload per TP rank],
load_format="flattened_bucket")`` (entrypoints/engine.py:1679-1700, 1743-1759): TP rank r deserializes payload r
(managers/tp_worker.py:194-201), a CUDA IPC handle, and loads the whole HF tensors of the bucket, narrowing its
own shard. So every GPU that hosts an engine TP rank needs the bucket in its own memory, and a handle to it must
reach the engine. Per bucket (``ColocatedIPCSync.sync``, every trainer rank):

1. the bucket's pipeline-stage leader assembles it (TP/EP/ETP pieces arrive inside the stage,
   ``export_hf_weights``) and broadcasts its header (names, dtypes, shapes);
2. the flat bucket is broadcast from that leader to every trainer rank (NCCL on GPUs: each GPU receives each byte
   once, the minimum, since each TP rank needs the full tensors);
3. each rank serializes one handle per engine TP rank on its GPU (``rollout.engines.sglang.ipc``: one per bucket, not per
   tensor) and the handles (a few hundred bytes each) are gathered on the rank that drives the engines;
4. that rank (the *controller*, global rank 0) checks the names/shapes against every served checkpoint and calls
   each engine with its TP ranks' handles (engines in parallel), checks every ``(success, message)``, then
   broadcasts the verdict, after which the ranks may reuse their buffers (the handle's memory must stay valid until
   the engine has loaded it).

Stages take turns in stage order: while stage s exports, the other stages' ranks only take part in steps 1-4. One
weight-update session per engine around the whole sync; completeness is checked over all stages' names. The map
engine TP rank -> trainer rank is made once by device identity (``ipc.device_key``: the GPU's UUID, so any GPU
assignment Ray makes is matched; on CPU ``<host>:cpu<slot>``); an engine TP rank on a GPU without a trainer rank is
refused naming the engine, the TP rank and the device.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_s3ac.rollout.engines.sglang import ipc
from megatron_s3ac.rollout.engines.sglang.broadcast import SGLangSync


class ColocationError(ValueError):
    """An engine TP rank does not share a device with any trainer rank."""


class _Inline:
    """The pool interface (submit/wait/sessions) over one in-process engine (``rollout.sglang.num_engines: 1``)."""

    def __init__(self, engine):
        self.engine = engine
        self.tp_sizes = [int(engine.config.tp_size)]

    def submit(self, e, method, *args, **kwargs):
        try:
            return True, getattr(self.engine, method)(*args, **kwargs)
        except BaseException as err:  # raised by wait, as a pool's error would be
            return False, err

    @staticmethod
    def wait(refs, what, timeout=None):
        out = []
        for ok, val in refs:
            if not ok:
                raise val
            out.append(val)
        return out

    def device_keys(self):
        return [list(self.engine.device_keys())]

    def begin_weight_update(self):
        self.engine.begin_weight_update()

    def end_weight_update(self):
        self.engine.end_weight_update()

    def finish_sync(self, names, require_complete=False):
        self.engine.finish_sync(set(names), require_complete)


def _as_pool(engines):
    return engines if engines is None or hasattr(engines, "submit") else _Inline(engines)


def _bcast_obj(obj, src: int):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


_END = "__end_of_stage__"


class ColocatedIPCSync:
    """Every trainer rank builds one; the rank that drives the engines passes ``engines`` (an ``EnginePool`` or one
    ``SGLangEngine``), the others None.

        sync = ColocatedIPCSync(engines if rank == 0 else None)
        stats = sync.sync(model_chunks, info, bucket_bytes)   # every rank, every weight sync (collective)
    """

    def __init__(self, engines=None, timeout_s: float = 600.0, require_complete: bool = True):
        self.pool = _as_pool(engines)
        self.timeout_s, self.require_complete = float(timeout_s), bool(require_complete)
        self.roles: Optional[dict] = None
        self._buf: Optional[torch.Tensor] = None
        self._arena = None
        self._planned: dict = {}  # open_sync's cache of the export's names/shapes

    # -- once: who hands which engine TP rank its buckets -------------------------------------------
    def connect(self, export_group) -> None:
        """Collective: match every engine TP rank with the trainer rank on its device."""
        from megatron_s3ac.rollout.sync.weight_sync import _comm_device, _roles

        ctl, leaders, stage, leader = _roles(self.pool is not None, export_group)
        me = dist.get_rank()
        keys = [None] * dist.get_world_size()
        dist.all_gather_object(keys, ipc.device_key())
        plan = None
        if me == ctl:
            try:
                plan = self._plan(self.pool.device_keys(), keys)
            except Exception as err:  # every rank raises it, none waits forever
                plan = f"{type(err).__name__}: {err}"
        plan = _bcast_obj(plan, ctl)
        if isinstance(plan, str):
            raise ColocationError(f"rank {me}: colocated weight sync: {plan}")
        duties = [(e, r) for e, ranks in enumerate(plan) for r, x in enumerate(ranks) if x == me]
        self.roles = dict(controller=ctl, leaders=leaders, stage=stage, leader=leader, plan=plan, duties=duties,
                          device=_comm_device())

    @staticmethod
    def _plan(engine_keys: list[list[str]], trainer_keys: list[str]) -> list[list[int]]:
        """plan[e][r] = the trainer rank on engine e's TP rank r's device."""
        where = {}
        for rank, k in enumerate(trainer_keys):
            where.setdefault(k, rank)
        plan = []
        for e, ks in enumerate(engine_keys):
            row = []
            for r, k in enumerate(ks):
                if k not in where:
                    raise ColocationError(
                        f"engine {e}'s TP rank {r} runs on device {k}, where no trainer rank runs (trainer devices: "
                        f"{sorted(set(trainer_keys))}); colocated engines must sit on the trainer's GPUs "
                        f"(rollout.sglang.num_engines x gpus_per_engine = the trainer's GPUs), or use "
                        f"rollout.placement: separate")
                row.append(where[k])
            plan.append(row)
        return plan

    # -- one sync ----------------------------------------------------------------------------------
    def _recv_buffer(self, nbytes: int, dev: torch.device) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None  # the old one's handles are no longer in use (the engines answered)
            self._buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=dev)
        return self._buf[:nbytes]

    def _bucket(self, header, flat: Optional[torch.Tensor], src: int) -> None:
        """Steps 2-4 for one bucket whose header every rank has; ``flat`` on its leader ``src``."""
        names, dtypes, shapes, nbytes = header
        r, me = self.roles, dist.get_rank()
        buf = flat if me == src else self._recv_buffer(nbytes, r["device"])
        dist.broadcast(buf, src=src)
        mine = [(e, tp, ipc.serialize(ipc.flat_payload(buf, names, dtypes, shapes))) for e, tp in r["duties"]]
        ctl = r["controller"]
        rows = [None] * dist.get_world_size() if me == ctl else None
        dist.gather_object(mine, rows, dst=ctl)
        if me != ctl:
            verdict = _bcast_obj(None, ctl)
            if verdict is not None:
                raise RuntimeError(f"rank {me}: rank {ctl}, which drives the engines, stopped the weight sync at "
                                   f"bucket {names[0]} .. {names[-1]}: {verdict}")
            return
        error = None
        try:
            payloads = [[None] * len(ks) for ks in r["plan"]]
            for row in rows:
                for e, tp, p in row:
                    payloads[e][tp] = p
            pool = self.pool
            refs = [pool.submit(e, "load_serialized_bucket", payloads[e], list(names), [list(s) for s in shapes],
                                dtypes=list(dtypes), nbytes=int(nbytes)) for e in range(len(payloads))]
            pool.wait(refs, f"update_weights_from_tensor (bucket {names[0]} .. {names[-1]}, {len(names)} tensors)",
                      self.timeout_s)
        except BaseException as err:
            error = err
        _bcast_obj(None if error is None else f"{type(error).__name__}: {error}", ctl)
        if error is not None:
            raise error

    @torch.no_grad()
    def sync(self, model_chunks, info, bucket_bytes: int = 512 << 20, export_group=None, quantize=None):
        """Every rank, every weight sync. ``quantize``: the stage leader's stream quantizer (rollout.weights_dtype=fp8).
        Returns this rank's SyncStats: bytes/buckets it broadcast as a stage leader; on the controller ``tensors``
        counts every stage's."""
        from megatron_s3ac.convert.export import export_hf_weights
        from megatron_s3ac.rollout.engines.sglang.broadcast import abort_sync, leader_arena, leader_flat, start_sync

        t0 = time.perf_counter()
        export_group, stats = start_sync(self, info, export_group)
        r, me = self.roles, dist.get_rank()
        ctl, leader, stage, dev = r["controller"], r["leader"], r["stage"], r["device"]
        names_all: list[str] = []
        try:
            for s in sorted(r["leaders"]):
                src = r["leaders"][s]
                if s != stage:  # another stage's turn: take part in its buckets until its end marker
                    while (header := _bcast_obj(None, src)) != _END:
                        if header[0]:
                            self._bucket(header, None, src)
                            names_all += header[0]
                    continue
                into = leader_arena(self, me == leader, bucket_bytes, dev, quantize)
                for bucket in export_hf_weights(model_chunks, info, bucket_bytes, group=export_group, into=into):
                    flat, header = None, None
                    if me == leader:
                        (names, dtypes, shapes), flat = leader_flat(bucket, into, quantize, dev)
                        header = (names, dtypes, shapes, int(flat.numel()))
                    header = _bcast_obj(header, src)
                    if header[0]:
                        self._bucket(header, flat, src)
                        names_all += header[0]
                        if me == leader:
                            stats.buckets += 1
                            stats.tensors += len(header[0])
                            stats.bytes += header[3]
                    if into is not None:
                        self._arena.reset()
                _bcast_obj(_END if me == leader else None, src)
            if me == ctl:
                self.pool.finish_sync(names_all, self.require_complete)
                stats.tensors = len(names_all)
        except BaseException:
            if me == ctl:
                abort_sync(self.pool)
            raise
        finally:
            # the engines have answered (loaded or failed): the buffers behind the handles go back to the trainer
            # (on GPUs, bucket_mb per rank that the engine's KV cache needs next)
            self._buf, self._arena = None, None
        stats.seconds = time.perf_counter() - t0
        return stats

    def close(self) -> None:
        self.roles, self._buf, self._arena = None, None, None


class SGLangColocatedSync(SGLangSync):
    """sglang engines on the trainer's GPUs (``rollout.placement: colocated``; registered in
    ``rollout.sync.strategy``): released while the models train; each sync wakes them in sglang's order,
    ``wake(["weights"])`` -> ``ColocatedIPCSync.sync`` (every rank hands the engine TP rank on its GPU a handle to
    each bucket) -> ``wake(["kv_cache", "cuda_graph"])``. ``settings``: ``rollout.sglang`` (default: ``SGLangSettings()``)."""

    sleeps = True

    def _make(self):
        return ColocatedIPCSync(self.engine, timeout_s=self.settings.timeout_s)

    def sync(self, chunks, info, weights_loaded=None):
        self._built()
        woke = self.engine is not None and self.asleep
        if woke:  # weights re-allocated but stale: the sync below refills every one
            self.engine.wake(["weights"])
            self.asleep = False
        stats = self._sync(chunks, info)
        if weights_loaded is not None:
            weights_loaded()
        if woke:
            self.engine.wake(["kv_cache", "cuda_graph"])
        return stats

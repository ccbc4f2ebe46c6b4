"""The wire of the weight transfer trainer -> vLLM workers (the ``s3ac_gloo`` / ``s3ac_nccl`` / ``s3ac_ipc``
backends): flat buckets over a stateless process group, or shared through IPC handles.

Imported on both sides of the process boundary (the trainer's environment and the vLLM engine's, which share the
torch release and nothing else), so it needs torch only. Nothing is pickled: a bucket travels as one flat uint8
tensor (each tensor at an 8-byte aligned offset), its (name, dtype, shape) list as JSON in the control call.

    group = join_group(host, port, rank, world_size, backend="gloo" | "nccl")   # sender: rank 0 (hosts the store)
    meta = bucket_meta(bucket); flat = pack(bucket, group.device)                # sender
    group.broadcast(flat, 0).wait()
    tensors = unpack(flat, meta)                                                 # receiver: [(name, view of flat)]

    handle = share_flat(flat)             # IPC sender: JSON-safe fields of the storage (CUDA IPC / shared memory)
    flat = open_shared(handle)            # IPC receiver (same host, same GPU): the storage rebuilt from the fields

``gloo`` runs on host tensors (CPU, or a GPU box without NCCL between the processes); ``nccl`` is a torch
``ProcessGroupNCCL`` over the same TCP store with CUDA buckets: the trainer needs torch only, not vLLM (vLLM's own
nccl backend builds its group with vLLM's ``PyNcclCommunicator``, ``weight_transfer/nccl_common.py:139-159``).
"""
from __future__ import annotations

import base64
import datetime
import math

import torch
import torch.distributed as dist

from megatron_s3ac.rollout.sync.transfer_groups import transfer_group_error_handling

BACKENDS = ("gloo", "nccl")


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


def pack(bucket, device="cpu") -> torch.Tensor:
    """One flat uint8 tensor on ``device`` holding the bucket's tensors back to back (8-byte aligned)."""
    parts = []
    for _, t in bucket:
        b = t.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
        parts.append(b)
        if b.numel() % 8:
            parts.append(b.new_zeros(-b.numel() % 8))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def unpack(flat: torch.Tensor, meta: dict) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] views of ``flat`` laid out by ``pack``."""
    out, at = [], 0
    for name, dt, shape in zip(meta["names"], meta["dtype_names"], meta["shapes"]):
        dtype = torch_dtype(dt)
        n = math.prod(shape) * dtype.itemsize
        out.append((name, flat[at:at + n].view(dtype).view(tuple(shape))))
        at += _pad8(n)
    return out


def join_group(host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0, backend: str = "gloo"):
    """A process group outside torch.distributed's default group (the trainer keeps its own): rank 0 hosts the
    TCP store. Both sides must call it; gloo returns once every rank has joined, NCCL builds its communicator at
    the first broadcast (every rank is in it by then). ``backend``: "gloo" (host tensors) or "nccl" (CUDA
    tensors on the current device)."""
    if backend not in BACKENDS:
        raise ValueError(f"weight-transfer group backend {backend!r} is not one of {BACKENDS}")
    timeout = datetime.timedelta(seconds=float(timeout_s))
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise RuntimeError("the s3ac_nccl weight transfer needs CUDA and a torch built with NCCL; this process has "
                           f"cuda={torch.cuda.is_available()}, nccl={dist.is_nccl_available()} (use s3ac_gloo)")
    store = dist.TCPStore(host, int(port), int(world_size), is_master=(rank == 0), timeout=timeout)
    prefixed = dist.PrefixStore(f"s3ac-vllm-weights-{backend}", store)
    if backend == "gloo":
        return TransferGroup(dist.ProcessGroupGloo(prefixed, int(rank), int(world_size), timeout), store,
                             torch.device("cpu"))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    device = torch.device("cuda", torch.cuda.current_device())
    with transfer_group_error_handling():  # an engine's death must not take this process down (rollout.sync.transfer_groups)
        pg = dist.ProcessGroupNCCL(prefixed, int(rank), int(world_size), opts)
    return TransferGroup(pg, store, device)


def await_broadcast(work, receiver, box: dict, timeout_s: float, timed_out) -> None:
    """Wait for a started broadcast ``work`` while thread ``receiver`` (the engine's workers asked to receive it) runs,
    its error in ``box["error"]``: a receive that failed (engine died, refused) is seen at once, not after the group's
    timeout. Raises that error, or ``timed_out()`` (an exception) past ``timeout_s``; returns once both are done."""
    import time

    deadline = time.monotonic() + float(timeout_s)
    while not work.is_completed():
        if "error" in box or time.monotonic() > deadline:
            raise box.get("error") or timed_out()
        time.sleep(0.002)
    work.wait()
    receiver.join()
    if "error" in box:
        raise box["error"]


class TransferGroup:
    """A process group, the store it was made from (the store must outlive the group) and its buckets' device."""

    def __init__(self, pg, store, device=torch.device("cpu")):
        self.pg, self.store, self.device = pg, store, torch.device(device)

    def abort(self) -> None:
        """An NCCL group whose peer will not answer: abort its communicators (its pending work raises, no watchdog
        timeout later); nothing for gloo (kept as it is, see ``VLLMEngine._abandon_group``)."""
        if self.device.type == "cuda" and hasattr(self.pg, "abort"):
            self.pg.abort()

    def broadcast(self, tensor: torch.Tensor, root: int = 0):
        """Start a broadcast of ``tensor`` from ``root``; returns the work (``wait()`` / ``is_completed()``)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = int(root)
        return self.pg.broadcast([tensor], opts)


GlooGroup = TransferGroup  # the name of the CPU-only first version


# -- IPC: a storage's sharing fields as JSON (no pickle) ---------------------------------------------------------
_CLASSES = {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter, "UntypedStorage": torch.UntypedStorage,
            "TypedStorage": torch.storage.TypedStorage}


def _encode(v):
    """reduce_tensor / reduce_storage arguments -> JSON values (allow-listed kinds only)."""
    if isinstance(v, bytes):
        return {"bytes": base64.b64encode(v).decode()}
    if isinstance(v, torch.dtype):
        return {"dtype": dtype_name(v)}
    if isinstance(v, type):
        name = next((k for k, c in _CLASSES.items() if c is v), None)
        if name is None:
            raise TypeError(f"IPC handle field of class {v!r}: not one this wire rebuilds")
        return {"cls": name}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, (tuple, list, torch.Size)):
        return {"seq": [_encode(x) for x in v]}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"IPC handle field {v!r} ({type(v).__name__}) cannot travel as JSON")


def _decode(v):
    if isinstance(v, dict):
        if "bytes" in v:
            return base64.b64decode(v["bytes"])
        if "dtype" in v:
            return torch_dtype(v["dtype"])
        if "cls" in v:
            if v["cls"] not in _CLASSES:
                raise ValueError(f"IPC handle names class {v['cls']!r}: not one of {sorted(_CLASSES)}")
            return _CLASSES[v["cls"]]
        if "device" in v:
            return torch.device(v["device"])
        if "seq" in v:
            return tuple(_decode(x) for x in v["seq"])
        raise ValueError(f"IPC handle field {sorted(v)} is not one this wire writes")
    return v


def _gpu_uuid(device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def share_flat(flat: torch.Tensor) -> dict:
    """The JSON handle of a flat uint8 tensor for a process on the same host (CPU: shared memory of the
    ``file_system`` strategy, ``torch.multiprocessing.reductions.reduce_storage``) or the same GPU (CUDA IPC,
    ``reduce_tensor``). The caller keeps ``flat`` alive until the receiver has copied it out."""
    from torch.multiprocessing import get_sharing_strategy, reductions, set_sharing_strategy

    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("share_flat takes a flat uint8 tensor (pack's output)")
    if flat.is_cuda:
        _, args = reductions.reduce_tensor(flat)  # rebuild_cuda_tensor's 15 arguments
        return {"kind": "cuda", "gpu_uuid": _gpu_uuid(flat.device), "nbytes": flat.numel(), "args": _encode(args)}
    prev = get_sharing_strategy()
    set_sharing_strategy("file_system")  # a named segment another process opens by name (fds do not cross HTTP)
    try:
        _, args = reductions.reduce_storage(flat.untyped_storage())  # (cls, manager, handle, size); increfs it
    finally:
        set_sharing_strategy(prev)
    return {"kind": "cpu", "nbytes": flat.numel(), "offset": flat.storage_offset(), "args": _encode(args)}


def open_shared(handle: dict) -> torch.Tensor:
    """The flat uint8 tensor ``share_flat`` described, mapped in this process (CUDA: on the current device, which
    must be the sender's GPU; the handle's device index is the sender's and is replaced, as vLLM's ipc backend does,
    ``weight_transfer/ipc_engine.py:228-233``)."""
    from torch.multiprocessing import reductions

    kind = handle.get("kind")
    args = _decode(handle["args"])
    n = int(handle["nbytes"])
    if kind == "cpu":
        if len(args) != 4 or args[0] is not torch.UntypedStorage:
            raise ValueError("a CPU IPC handle holds (UntypedStorage, manager, handle, size)")
        storage = reductions.rebuild_storage_filename(*args)  # decrefs what the sender's reduce_storage increfed
        at = int(handle.get("offset", 0))
        return torch.empty(0, dtype=torch.uint8).set_(storage, at, (n,), (1,))
    if kind == "cuda":
        here = _gpu_uuid(torch.cuda.current_device())
        if handle.get("gpu_uuid") != here:
            raise ValueError(f"CUDA IPC handle of GPU {handle.get('gpu_uuid')} opened on GPU {here}: colocated "
                             f"weight transfer needs the sender and the receiver on the same GPU")
        args = list(args)
        if len(args) != 15:
            raise ValueError(f"a CUDA IPC handle holds rebuild_cuda_tensor's 15 arguments, got {len(args)}")
        args[6] = torch.cuda.current_device()
        return reductions.rebuild_cuda_tensor(*args)[:n]
    raise ValueError(f"IPC handle kind {kind!r} is not 'cpu' or 'cuda'")

"""The colocated hand-over of weights to SGLang engine TP ranks: one payload per TP rank per flattened bucket,
a *handle* to memory the producing trainer rank keeps alive (the bytes never travel through a socket).

What sglang 0.5.23 does with a payload (``update_weights_from_tensor(named_tensors=[payload per TP rank],
load_format="flattened_bucket")``):

* entrypoints/engine.py:1743-1759: flattened-bucket payloads must already be serialized, one per TP rank
  (str or bytes; anything else: TypeError, utils/common.py:3109-3131); each TP rank deserializes only its own
  (managers/tp_worker.py:194-201), because producer-side CUDA-IPC refcounts expect one consumer per serialization.
* utils/common.py:3144-3372: ``SafeUnpickler`` allows a fixed set of globals (torch rebuild functions, dtypes,
  ``types.SimpleNamespace``, sglang's own FlattenedTensorMetadata ...) and raises "Blocked unsafe global
  (<module>.<name>) during pickle deserialization" for anything else: a project dataclass in the metadata kills
  the scheduler. The loader reads six attributes per entry
  (model_executor/model_runner_components/weight_updater.py:383-413), so the metadata here are
  ``SimpleNamespace(name, shape, dtype, start_idx, end_idx, numel)``: allowed, and no sglang import needed.
* CUDA: pickling a CUDA tensor with ForkingPickler yields its CUDA IPC handle. sglang's
  ``monkey_patch_torch_reductions`` (utils/patch_torch.py:41-100) writes the GPU's UUID where torch writes the
  producer's device index, so a consumer with its own CUDA_VISIBLE_DEVICES opens the right GPU; producers call it
  before serializing (as sglang's own SPMD producer does, weight_sync/utils.py:40-42).
* CPU (tests and small runs): the same pickling under torch's ``file_system`` sharing strategy: the payload names
  a shared-memory segment (``/torch_<producer pid>_...``) that any process on the host can map — the CPU
  counterpart of a CUDA IPC handle (``file_descriptor`` handles cannot cross unrelated processes).

The producer must keep the tensor alive until the engine has loaded it (the caller waits for the engine's answer).
"""
from __future__ import annotations

import contextlib
import io
import os
import socket
from types import SimpleNamespace
from typing import Optional, Sequence

import torch


def flat_payload(flat: torch.Tensor, names: Sequence[str], dtypes: Sequence, shapes: Sequence[Sequence[int]]) -> dict:
    """sglang's flattened bucket (weight_sync/tensor_bucket.py:19-80) over ``flat`` (uint8 [nbytes], tensors back to
    back in ``names`` order): {"flattened_tensor": flat, "metadata": [SimpleNamespace per tensor]}."""
    metadata, at = [], 0
    for name, dt, shape in zip(names, dtypes, shapes):
        dt = getattr(torch, dt) if isinstance(dt, str) else dt
        numel = 1
        for s in shape:
            numel *= int(s)
        n = numel * dt.itemsize
        if at % dt.itemsize:
            raise ValueError(f"flattened bucket: {name} ({dt}) would start at unaligned byte {at}")
        metadata.append(SimpleNamespace(name=name, shape=tuple(int(s) for s in shape), dtype=dt, start_idx=at,
                                        end_idx=at + n, numel=n))
        at += n
    if at != flat.numel():
        raise ValueError(f"flattened bucket: the tensors take {at} bytes, the flat tensor has {flat.numel()}")
    return {"flattened_tensor": flat, "metadata": metadata}


@contextlib.contextmanager
def _file_system_sharing():
    import torch.multiprocessing as tmp

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(old)


def serialize(payload) -> bytes:
    """One consumer's serialized payload: ForkingPickler bytes holding a handle to the tensors' memory (CUDA IPC with
    the device UUID; on CPU a named shared-memory segment). Call once per consumer TP rank."""
    from multiprocessing.reduction import ForkingPickler

    tensors = [payload["flattened_tensor"]] if isinstance(payload, dict) else []
    on_cuda = any(t.is_cuda for t in tensors)
    if on_cuda:
        try:
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        except ImportError as err:
            raise RuntimeError("colocated weight sync to SGLang hands CUDA IPC handles over and needs sglang importable "
                               "in the trainer processes (its device-UUID reduction, utils/patch_torch.py)") from err
        monkey_patch_torch_reductions()
    buf = io.BytesIO()
    with (contextlib.nullcontext() if on_cuda else _file_system_sharing()):
        ForkingPickler(buf).dump(payload)
    return buf.getvalue()


def device_key(index: Optional[int] = None) -> str:
    """Identity of the device a process computes on, comparable across processes of a cluster.
    CUDA: the GPU's UUID (visible device ``index``, default the current one). CPU: ``<host>:cpu<index>`` with
    ``index`` a slot number (a trainer rank's LOCAL_RANK; an engine TP rank's base_gpu_id + tp_rank)."""
    if torch.cuda.is_available():
        i = torch.cuda.current_device() if index is None else int(index)
        return str(torch.cuda.get_device_properties(i).uuid)
    if index is None:
        index = int(os.environ.get("LOCAL_RANK", "0"))
    return f"{socket.gethostname()}:cpu{int(index)}"


def engine_device_keys(tp_size: int, base_gpu_id: int = 0, gpu_id_step: int = 1, nnodes: int = 1,
                       node_rank: int = 0) -> dict[int, str]:
    """{tp_rank: device_key} of the TP ranks an sglang engine launches on this node: sglang puts TP rank r on visible
    GPU base_gpu_id + (r % tp_per_node) * gpu_id_step (entrypoints/engine.py:928-939, 2045-2077; pp_size 1)."""
    per_node = max(1, int(tp_size) // max(1, int(nnodes)))
    ranks = range(per_node * int(node_rank), per_node * (int(node_rank) + 1))
    return {r: device_key(int(base_gpu_id) + (r % per_node) * int(gpu_id_step)) for r in ranks}

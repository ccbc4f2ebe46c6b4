"""The sglang engine kind (sglang==0.5.23 ``SGLangEngine``s), registered with ``rollout.engines.registry``.

Its section is ``rollout.sglang`` (``SGLangSettings``); ``num_engines`` engines in a Ray ``EnginePool`` (one
colocated engine runs in rank 0's process). Import-light: sglang loads on ``build``."""
from __future__ import annotations


from megatron_s3ac.rollout.engines.registry import EngineRequest, EngineSpec, register_engine
from megatron_s3ac.rollout.engines.sglang.settings import TOKENIZER_FILES, SGLangSettings, validate_sglang_settings
from megatron_s3ac.rollout.errors import ConfigError


class SGLangSpec(EngineSpec):
    kind = "sglang"
    settings_cls = SGLangSettings
    section = "sglang"
    partial_rollout = True  # through sglang.Engine's tokenizer_manager coroutines (engine.py)
    stage_refusal = (
        "rollout.sync.overlap=true with rollout.engine=sglang: sglang 0.5.23 cannot receive weights while it "
        "generates: update_weights_from_distributed / _from_tensor take the tokenizer manager's model_update_lock "
        "writer lock (managers/tokenizer_control_mixin.py:523, :586), which waits for every running request (each "
        "holds the reader lock for its whole life, tokenizer_manager.py:941), and load straight into the live "
        "parameters (scheduler_components/weight_updater.py:187-225); docs/rollout.md \"Overlapped weight sync\". "
        "Use rollout.engine=cpu / vllm or rollout.sync.overlap=false")

    def check_settings(self, settings) -> None:
        validate_sglang_settings(settings)

    def check_cluster(self, settings, *, cluster_gpus, trainer_gpus, placement) -> None:
        validate_sglang_settings(settings, cluster_gpus=cluster_gpus, trainer_gpus=trainer_gpus, placement=placement)

    def config_errors(self, cfg) -> list[str]:
        s = self.settings_of(cfg.rollout)
        if cfg.train.dist_timeout_s < float(s.timeout_s):
            return [f"train.dist_timeout_s={cfg.train.dist_timeout_s:g} is shorter than rollout.sglang.timeout_s="
                    f"{float(s.timeout_s):g}: the other ranks would give up on rank 0's generation before the engine "
                    f"does (raise train.dist_timeout_s)"]
        return []

    def check_model(self, model_dir, *, tiny, key) -> None:
        from megatron_s3ac.rollout.engines.sglang.engine import UnservableModelError, check_servable
        from megatron_s3ac.rollout.errors import check_checkpoint_dir

        cfg = check_checkpoint_dir("sglang", model_dir, tiny=tiny, key=key, tokenizer_files=TOKENIZER_FILES)
        try:
            check_servable(cfg, model_dir)
        except UnservableModelError as err:
            raise ConfigError(f"{key}: {err}") from None

    def prepare(self, kwargs: dict) -> dict:
        if kwargs.get("engine_cls") is None:  # the tests' stand-in for sglang.Engine (rollout.factory's seam)
            from megatron_s3ac.rollout import factory

            kwargs["engine_cls"] = factory.SGLANG_ENGINE_CLS
        return kwargs

    def factory(self, req: EngineRequest):
        from megatron_s3ac.rollout.factory import make_engine_factory

        s = req.settings
        if s is None:  # s3ac-eval: one engine of tp_size GPUs; seeds honoured only with deterministic inference
            s = SGLangSettings(tp_size=req.tp_size, gpus_per_engine=req.tp_size, deterministic_inference=req.seeded)
        # routes only for R3 (a dense model has none: sglang refuses the flag); resident weights make the factory
        # ask for sglang's weights CPU backup (sleep would lose them otherwise)
        return make_engine_factory(self.kind, model_dir=req.model_dir, settings=s, seed=req.seed,
                                   torch_threads=req.torch_threads, return_routed_experts=req.routes,
                                   resident_prefixes=req.resident_prefixes)

    def env_vars(self, factory) -> dict:
        """sglang refuses a ``context_length`` above the model's own unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN
        is true in the engine's process (configs/model_config.py:1291-1316); ``rollout.sglang.context_length`` asks
        for it."""
        s = factory.settings
        if s is None or not s.context_length or not factory.model_dir:
            return {}
        from megatron_s3ac.rollout.engines.sglang.engine import _context_length, read_hf_config

        hf = read_hf_config(factory.model_dir) or {}
        derived = _context_length(hf.get("text_config") or hf)
        return {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"} if derived and s.context_length > derived else {}

    def build(self, factory, slot=None):
        from megatron_s3ac.rollout.engines.sglang.engine import SGLangConfig, SGLangEngine

        index = getattr(slot, "index", 0)
        s = factory.settings or SGLangSettings()
        cfg = SGLangConfig(
            model_path=factory.model_dir, dtype=s.dtype, tp_size=s.tp_size, ep_size=s.ep_size,
            attn_dp_size=s.attn_dp_size, moe_a2a_backend=s.moe_a2a_backend, mem_fraction_static=s.mem_fraction_static,
            context_length=s.context_length, enable_return_routed_experts=factory.return_routed_experts,
            enable_memory_saver=True,
            enable_weights_cpu_backup=s.weights_cpu_backup or bool(factory.resident_prefixes),
            enable_deterministic_inference=s.deterministic_inference, disable_cuda_graph=not s.cuda_graphs,
            random_seed=factory.seed + index, nnodes=getattr(slot, "nnodes", 1),
            node_rank=getattr(slot, "node_rank", 0), dist_init_addr=getattr(slot, "dist_init_addr", None),
            extra=dict(s.extra))
        return SGLangEngine(cfg, engine_cls=factory.engine_cls, name=f"sglang engine {index}",
                            bucket_bytes=s.bucket_bytes, seed=factory.seed + index,
                            resident_prefixes=factory.resident_prefixes)

    def in_process(self, placement, settings) -> bool:
        return placement == "colocated" and settings.num_engines == 1

    def host(self, factory, placement="colocated", *, num_cpus=1, ray_init_kwargs=None, pausable=False):
        """An ``EnginePool`` of ``num_engines`` engines, each pinned to its GPUs by a placement group."""
        from megatron_s3ac.rollout.engines.pool import EnginePool

        s = factory.settings or SGLangSettings()
        gpus = 0 if factory.engine_cls is not None else s.gpus_per_engine  # a CPU stand-in takes no GPUs
        return EnginePool(factory, s.num_engines, gpus_per_engine=gpus, gpus_per_node=s.gpus_per_node,
                          cpus_per_engine=num_cpus, timeout_s=s.timeout_s, bucket_bytes=s.bucket_bytes,
                          ray_init_kwargs=ray_init_kwargs, pausable=pausable)


register_engine(SGLangSpec())

"""The cpu and hf engine kinds (``CPUEngine``: transformers, exact), registered with ``rollout.engines.registry``.

cpu: on the CPU; hf: the same engine on rank 0's GPU when CUDA is present. Either in this process (colocated) or in a
Ray ``RemoteEngine`` actor (separate); no config section of their own. Import-light: torch loads on ``build``."""
from __future__ import annotations

from typing import Optional

from megatron_s3ac.rollout.engines.registry import EngineRequest, EngineSpec, register_engine


class CPUSpec(EngineSpec):
    kind = "cpu"
    partial_rollout = True  # CPUEngine pauses between decode steps
    # separate placement: its RemoteEngine actor receives the next version into a staging copy on a thread of its
    # own while the default thread generates, and swaps it in between two generate calls (remote.py EngineHost)
    stage_weights = True
    needs_model_dir = False  # an HF config object suffices: random init, the trainer's weights come at the first sync
    multimodal_flag = True

    def check_request(self, *, model_dir, hf_config, multimodal) -> None:
        super().check_request(model_dir=model_dir, hf_config=hf_config, multimodal=multimodal)
        if not model_dir and hf_config is None:
            raise ValueError("the CPU engine needs model_dir or hf_config")

    def local_device(self) -> Optional[str]:
        return "cpu"

    def factory(self, req: EngineRequest):
        from megatron_s3ac.rollout.factory import make_engine_factory

        dev = {k: v for k, v in (("dtype", req.dtype), ("device", req.device)) if v is not None}
        if req.multimodal:  # sglang / vllm read a VL checkpoint as it says; this engine needs the flag
            dev.update(multimodal=True, resident_prefixes=req.resident_prefixes)
        common = dict(torch_threads=req.torch_threads, return_routed_experts=req.routes, **dev)
        # the trainer's engine takes the actor's weights at the first sync: a random init seeded init_seed (torch's
        # global generator on rank 0, as before the registry); s3ac-eval / coverage data serve the directory's
        seed = req.init_seed if req.purpose == "train" else req.seed
        if req.weights_dir:
            return make_engine_factory(self.kind, model_dir=req.weights_dir, seed=seed, **common)
        return make_engine_factory(self.kind, hf_config=req.hf_config(), seed=seed, **common)

    def build(self, factory, slot=None):
        from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine

        dev = {k: v for k, v in (("dtype", factory.dtype), ("device", factory.device)) if v is not None}
        if factory.multimodal:
            dev["multimodal"] = True
        if factory.model_dir:
            engine = CPUEngine.from_pretrained(factory.model_dir, **dev)
        else:
            engine = CPUEngine.from_config(factory.hf_config, seed=factory.seed, **dev)
        engine.resident_prefixes = tuple(factory.resident_prefixes)
        return engine


class HFSpec(CPUSpec):
    kind = "hf"

    def local_device(self) -> Optional[str]:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


register_engine(CPUSpec())
register_engine(HFSpec())

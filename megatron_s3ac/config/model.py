"""The ``model``, ``actor_layout`` / ``critic_layout`` and ``optim`` sections."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional
from megatron_s3ac.config.enums import CriticHead, CriticPrivileged, DType, TinyModel, _missing_paths


@dataclass
class ModelCfg:
    hf_config: Optional[str] = None  # HF dir or config.json (architecture; engine weights if hf_weights)
    tiny: Optional[TinyModel] = None  # arithmetic_moe: the CPU demo's tiny Qwen3-MoE (no files needed)
    actor_init: Optional[str] = None  # megatron torch_dist dir (checkpoints_convert hf->mcore)
    critic_init: Optional[str] = None  # torch_dist dir of a (value-pretrained) critic
    critic_head: CriticHead = CriticHead.linear
    # the critic's privileged input (trainer.step.privileged): every critic forward sees prompt + a block built from the
    # row's reference (+ its solution) + response; the actor, the engines and the evaluation never see it
    critic_privileged: CriticPrivileged = CriticPrivileged.none
    # the longest block the trainer accepts (a longer one is an error naming the prompt): the planner's critic
    # sequences are prompt + this + response
    critic_privileged_max_tokens: int = 64
    # std of the fresh value head's weights (None: the recipe's 1/(H+1)); paper Table 4 ablates 0.01
    value_head_init_std: Optional[float] = None
    engine_hf_dir: Optional[str] = None  # HF dir the rollout engine loads (else built from config)
    # actor and critic params and activations (bf16: fp32 main grads / main params / Adam states via
    # megatron's distributed optimizer); log-probs, values, advantages and losses are fp32 either way
    dtype: DType = DType.fp32

    def errors(self) -> list[str]:
        out = [] if (self.tiny is None) != (self.hf_config is None) else [
            "set exactly one of model.tiny and model.hf_config"]
        if self.critic_privileged_max_tokens < 1:
            out.append(f"model.critic_privileged_max_tokens={self.critic_privileged_max_tokens} must be >= 1")
        if self.value_head_init_std is not None and not self.value_head_init_std > 0:
            out.append(f"model.value_head_init_std={self.value_head_init_std} must be > 0 (or null: 1/(H+1))")
        return out + _missing_paths("model", self, ("hf_config", "actor_init", "critic_init", "engine_hf_dir"))


@dataclass
class LayoutCfg:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    # context parallel: every sequence split over cp ranks (models/context_parallel.py); dp = world / (tp*cp*pp)
    cp: int = 1
    # CP attention communication of the torch spec: allgather (default) | ring (models/context_parallel.py)
    cp_comm: str = "allgather"
    # uneven pipeline: layers on the first / last stage (the rest split evenly); both None and
    # num_layers % pp != 0: split automatically (models.parallel.auto_stage_layers)
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None


@dataclass
class ModelOptimCfg:
    """Optimizer placement of one model (megatron-core's OptimizerConfig; models.optim.build_optimizer)."""
    cpu_offload: bool = False  # optimizer state + update on the host (HybridDeviceOptimizer; needs CUDA)
    offload_fraction: float = 1.0  # share of the state offloaded
    precision_aware: bool = False  # bf16 Adam moments (needs Transformer Engine)


@dataclass
class OptimCfg:
    actor: ModelOptimCfg = field(default_factory=ModelOptimCfg)
    critic: ModelOptimCfg = field(default_factory=ModelOptimCfg)

    def errors(self) -> list[str]:
        return [f"optim.{n}.offload_fraction={getattr(self, n).offload_fraction} must be in [0, 1]"
                for n in ("actor", "critic") if not 0 <= getattr(self, n).offload_fraction <= 1]

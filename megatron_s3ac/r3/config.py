"""The R3 switch and the megatron-core settings replay needs, with refusals for those that skip it.

megatron-core 0.19.2 replays top-k *indices* inside ``topk_routing_with_score_function``
(transformer/moe/moe_utils.py:710, the hook at :826-833). Some settings route around that code or undo
its result without any error, so a run would silently train on native routing. ``check_replay_config``
refuses them by name (line numbers: 0.19.2's transformer/moe/):
  * ``moe_router_fusion=True``: TE's fused top-k returns before the replay hook is consulted (moe_utils.py:772-791);
  * ``moe_router_load_balancing_type`` ``"sinkhorn"`` or ``"quantile_balancing"`` (new in 0.19): other routing
    functions, no replay hook (router.py:766-772);
  * ``moe_expert_capacity_factor``: token dropping runs after replay and drops replayed tokens;
  * ``moe_router_force_load_balancing`` / ``moe_router_force_biased`` (new in 0.19): random logits (benchmark
    modes, router.py:856-864), the gates would be noise;
  * CUDA graphs (``cuda_graph_impl != "none"``): the captured graph bakes in one set of indices;
  * MTP layers (``mtp_num_layers``): their routers have replay instances but no rollout routes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class R3ConfigError(ValueError):
    """A configuration under which routing replay would not (fully) happen; the message names it."""


@dataclass(frozen=True)
class R3Config:
    """``enabled=None`` means: on for MoE models, off for dense ones.

    ``agreement_every``: run a native-routing (RECORD) forward every this many steps to measure
    how often the trainer's own top-k agrees with the rollout's (0 = never; it costs one extra
    forward-only pass over the micro-batches it is given).
    """

    enabled: Optional[bool] = None
    agreement_every: int = 1

    def is_on(self, info) -> bool:
        """Whether replay runs for the model described by ``info`` (a registry.ModelInfo)."""
        if self.enabled is None:
            return info.is_moe
        if self.enabled and not info.is_moe:
            raise R3ConfigError(f"R3 is enabled but {info.model_type} has no MoE layers")
        return bool(self.enabled)

    def transformer_config_overrides(self, info) -> dict:
        """Overrides for ``build_transformer_config`` so the routers get RouterReplay instances."""
        if not self.is_on(info):
            return {}
        return dict(moe_enable_routing_replay=True, moe_router_fusion=False)


def check_replay_config(config) -> None:
    """Raise R3ConfigError if replay cannot happen, or would be skipped or undone, under ``config``
    (a megatron TransformerConfig)."""
    if not config.num_moe_experts:
        raise R3ConfigError("routing replay needs an MoE model (num_moe_experts is not set)")
    if not config.moe_enable_routing_replay:
        raise R3ConfigError("routing replay needs moe_enable_routing_replay=True in the TransformerConfig "
                            "(R3Config.transformer_config_overrides sets it)")
    if config.moe_router_fusion:
        raise R3ConfigError("moe_router_fusion=True: the fused TE top-k bypasses RouterReplay, so replay "
                            "would be silently skipped; set moe_router_fusion=False")
    lb = config.moe_router_load_balancing_type
    for other in ("sinkhorn", "quantile_balancing"):
        if lb == other or (isinstance(lb, list) and other in lb):
            raise R3ConfigError(f"moe_router_load_balancing_type='{other}' routes without the replay hook")
    if config.moe_expert_capacity_factor is not None:
        raise R3ConfigError(f"moe_expert_capacity_factor={config.moe_expert_capacity_factor}: token dropping "
                            "runs after replay and would drop replayed tokens; use dropless MoE (None)")
    if config.moe_router_force_load_balancing:
        raise R3ConfigError("moe_router_force_load_balancing=True replaces router logits with noise")
    if getattr(config, "moe_router_force_biased", None) is not None:
        raise R3ConfigError(f"moe_router_force_biased={config.moe_router_force_biased} replaces router logits with "
                            "biased noise")
    if getattr(config, "cuda_graph_impl", "none") != "none" or getattr(config, "enable_cuda_graph", False):
        raise R3ConfigError("CUDA graphs capture one set of routing indices; replay needs them off")
    if getattr(config, "mtp_num_layers", None):
        raise R3ConfigError("MTP layers have routers the rollout engine reports no routes for")

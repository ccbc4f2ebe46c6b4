"""``train.recompute`` -> megatron-core's activation-recompute fields (no torch / megatron import:
the config validation uses it)."""
from __future__ import annotations

RECOMPUTE_MODES = ("none", "selective", "full")
SELECTIVE_MODULES = ("core_attn", "mlp", "moe", "shared_experts", "layernorm", "moe_act")
# Recomputed through CheckpointWithoutOutput, which needs Transformer Engine (see recompute_kwargs).
TE_ONLY_RECOMPUTE_MODULES = ("layernorm", "moe_act")


def _have_te() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def recompute_kwargs(recompute: str = "none", modules: list[str] | None = None,
                     num_layers: int | None = None) -> dict:
    """megatron-core's activation-recompute fields for ``train.recompute``.

    none:      no recompute (all activations kept).
    selective: recompute the submodules in ``modules`` (megatron's ``recompute_modules``: e.g.
               ``core_attn``, ``mlp``, ``moe``, ``layernorm``; megatron's default ``["core_attn"]``);
               ``num_layers`` must be None.
    full:      recompute whole transformer layers: ``recompute_method='uniform'`` with chunks of
               ``num_layers`` layers (default 1: only each layer's input is kept).
    Under R3 a recomputed router pops its replayed indices (REPLAY_BACKWARD, see r3/replay.py).
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"train.recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if recompute == "none":
        if modules or num_layers:
            raise ValueError("recompute_modules / recompute_num_layers need train.recompute != 'none'")
        return {}
    if recompute == "selective":
        if num_layers is not None:
            raise ValueError("recompute_num_layers applies to train.recompute='full' only")
        needs_te = sorted(set(modules or ()) & set(TE_ONLY_RECOMPUTE_MODULES))
        if needs_te and not _have_te():
            raise ValueError(
                f"train.recompute_modules {needs_te} need Transformer Engine: megatron-core 0.19.2 recomputes them "
                "through tensor_parallel.CheckpointWithoutOutput, whose __init__ sets fp8 = (fp8 is not None), "
                "i.e. always True (tensor_parallel/random.py:739-740), and then calls TE's FP8GlobalStateManager "
                "(:692-695, a NameError without TE); "
                f"use {sorted(set(SELECTIVE_MODULES) - set(TE_ONLY_RECOMPUTE_MODULES))} or install transformer-engine")
        kw = dict(recompute_granularity="selective")
        if modules:
            kw["recompute_modules"] = list(modules)
        return kw
    if modules:
        raise ValueError("recompute_modules applies to train.recompute='selective' only")
    n = 1 if num_layers is None else int(num_layers)
    if n < 1:
        raise ValueError(f"recompute_num_layers must be >= 1, got {n}")
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=n)

"""Layout rules megatron-core enforces only when it builds the model (so ``ParallelLayout.validate``,
owned by models/parallel.py, does not check them yet); none needs the world size."""
from __future__ import annotations

from megatron_s3ac.models.registry import ModelInfo


def extra_layout_errors(info: ModelInfo, layout) -> list[str]:
    errs = []
    tp = layout.tp
    if info.shared_expert_size and info.shared_expert_size % tp:
        errs.append(f"shared_expert_intermediate_size {info.shared_expert_size} is not divisible by tp {tp}")
    if info.model_type.startswith("qwen3_5_moe"):
        from megatron_s3ac.models.qwen3_5 import text_config

        tc = text_config(info.hf)
        for key, default in (("linear_num_key_heads", 16), ("linear_num_value_heads", 32)):
            n = tc.get(key, default)
            if n % tp:  # megatron's GatedDeltaNet splits its heads over TP (gated_delta_net.py)
                errs.append(f"{key} {n} is not divisible by tp {tp}")
    if layout.pp > info.num_layers:
        errs.append(f"pp={layout.pp} > num_layers {info.num_layers}")
    return errs

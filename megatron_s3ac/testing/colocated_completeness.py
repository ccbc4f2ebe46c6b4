"""The colocated weight sync's completeness check against a served checkpoint with tensors the trainer never has.

Published Qwen3.5 checkpoints carry a vision tower (``model.visual.*``) and an MTP head (``mtp.*``) beside the
language model; the trainer trains (and exports) the language model only. ``add_served_tensors`` writes such
extra tensors into a saved tiny checkpoint (its ``model.safetensors``), and ``colocated_sync_once`` (a rank body
for ``models.gloo_ranks.run_distributed``) runs one real ``ColocatedIPCSync(require_complete=True)`` from a megatron
actor of that checkpoint's architecture into an ``SGLangEngine`` started from it (``sglang.Engine`` replaced by
``rollout.engines.sglang.startup_stand_in.StartupEngine``).
"""
from __future__ import annotations

import os


def add_served_tensors(hf_dir: str, tensors: dict) -> None:
    """Add ``tensors`` ({name: torch.Tensor}) to ``hf_dir``'s single-file safetensors checkpoint."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(hf_dir, "model.safetensors")
    sd = load_file(path)
    sd.update({k: v.contiguous() for k, v in tensors.items()})
    save_file(sd, path, metadata={"format": "pt"})


def colocated_sync_once(hf_dir: str, bucket_bytes: int = 1 << 20) -> dict:
    """One colocated sync of a freshly built actor (fp32, TP = PP = EP = 1) into an engine serving ``hf_dir``.
    Returns {"sent": tensors sent, "served": tensors the engine serves, "missing": the engine's unsent list}."""
    import torch
    import torch.distributed as dist

    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.rollout.engines.sglang.colocated import ColocatedIPCSync
    from megatron_s3ac.rollout.engines.sglang.engine import SGLangConfig, SGLangEngine
    from megatron_s3ac.rollout.engines.sglang.startup_stand_in import StartupEngine

    info = model_info(hf_dir)
    layout = ParallelLayout()
    initialize_model_parallel(layout)
    model = build_actor(info, build_transformer_config(info, layout, torch.float32))
    engine = SGLangEngine(SGLangConfig(model_path=hf_dir), engine_cls=StartupEngine) if dist.get_rank() == 0 else None
    sync = ColocatedIPCSync(engine, require_complete=True)
    sync.connect(dist.group.WORLD)
    stats = sync.sync([model], info, bucket_bytes=bucket_bytes, export_group=dist.group.WORLD)
    last = dict(engine.last_sync) if engine is not None else {}
    return {"stats": stats, "served": len(engine.served_shapes or {}) if engine is not None else 0,
            "missing": list(last.get("missing", []))}

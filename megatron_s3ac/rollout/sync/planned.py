"""What a whole-model weight sync will send, known before the first bucket moves: every engine checks it against
its served checkpoint first, so a refusal loads nothing (every engine's update is all or nothing)."""
from __future__ import annotations


def planned_weights(info) -> tuple[list[str], list[list[int]]]:
    """(names, shapes) of every HF tensor a whole-model export sends (all stages together; before any FP8
    quantization, which keeps each weight's name and shape and adds ``*_scale_inv`` tensors)."""
    from megatron_s3ac.convert.plan import build_plan

    shapes = build_plan(info).hf_shapes
    return list(shapes), [list(v) for v in shapes.values()]

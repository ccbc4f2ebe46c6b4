"""What a served HF checkpoint holds that the trained model never has (so no export ever sends it).

The architecture's conversion plan says it: ``Plan.ignorable_hf``, the HF tensors dropped on import (Qwen3.5: the
vision tower ``model.visual.*`` and the MTP head ``mtp.*``; a tied model: ``lm_head.weight``). The rollout engines'
completeness check after a weight sync counts every served tensor except these.
"""
from __future__ import annotations

from megatron_s3ac.convert.plan import build_plan  # importing the package registers the built-in plans
from megatron_s3ac.models.registry import UnsupportedModelError, model_info


def not_exported(hf_config):
    """Container (``name in it``) of the served tensors no export sends, for ``hf_config`` (a config dict,
    config.json or its directory); empty for an architecture without a conversion plan."""
    try:
        return build_plan(model_info(hf_config)).ignorable_hf
    except (UnsupportedModelError, KeyError):
        return frozenset()

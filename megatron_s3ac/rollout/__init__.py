"""Rollout: engine interface (base), CPU engine, SGLang engine (GPU), verifiable rewards.

Kept import-light on purpose (numpy only): reward worker processes import this package, and the
engines pull in torch / transformers / sglang only when their modules are imported.
"""
from megatron_s3ac.rollout.base import (  # noqa: F401
    FINISH_REASONS, RolloutEngine, Sample, SamplingParams, routed_experts_dtype,
)

"""S3AC algorithm core: pure-torch advantages, losses, mismatch corrections, DAPS, filters, metrics.

No Megatron import: every function works on plain [B, T] tensors with a 0/1 ``mask`` of valid
response tokens. See docs/algorithms.md for shapes and conventions.
"""
from .advantages import (
    compact_valid,
    compute_gae,
    discounted_reverse_cumsum,
    flash_reinforce_advantages,
    flash_reinforce_trust_region,
    grpo_advantages,
    length_adaptive_lambda,
    reinforce_pp_advantages,
    terminal_rewards,
)
from .corrections import icepop_mask, mis_sequence_mask, token_is_weights
from .daps import DAPSSampler, Selection
from .filters import dynamic_sampling_filter
from .losses import (
    AGG_MODES,
    agg_loss,
    cispo_loss,
    dppo_tv_loss,
    flash_reinforce_loss,
    masked_mean,
    ppo_clip_loss,
    value_loss,
)
from .metrics import (
    approx_kl,
    entropy_from_logits,
    explained_variance,
    grad_norm_split,
    masked_fraction,
    value_error,
)
from .packing import compute_gae_packed, packed_to_padded, padded_to_packed

__all__ = [
    # advantages
    "compute_gae",
    "length_adaptive_lambda",
    "terminal_rewards",
    "discounted_reverse_cumsum",
    "compact_valid",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "flash_reinforce_advantages",
    "flash_reinforce_trust_region",
    # losses
    "AGG_MODES",
    "agg_loss",
    "masked_mean",
    "cispo_loss",
    "ppo_clip_loss",
    "dppo_tv_loss",
    "flash_reinforce_loss",
    "value_loss",
    # corrections
    "token_is_weights",
    "icepop_mask",
    "mis_sequence_mask",
    # DAPS and filters
    "DAPSSampler",
    "Selection",
    "dynamic_sampling_filter",
    # metrics
    "explained_variance",
    "value_error",
    "approx_kl",
    "entropy_from_logits",
    "masked_fraction",
    "grad_norm_split",
    # packed layout
    "packed_to_padded",
    "padded_to_packed",
    "compute_gae_packed",
]

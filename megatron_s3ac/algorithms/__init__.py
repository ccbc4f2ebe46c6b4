"""S3AC algorithm core: pure-torch advantages, losses, mismatch corrections, DAPS, filters, metrics.

No Megatron import: every function works on plain [B, T] tensors with a 0/1 ``mask`` of valid
response tokens. See docs/algorithms.md for shapes and conventions. The names below are the public
API (``from megatron_s3ac import algorithms as A``); ``algorithms.registry`` holds the estimator and
policy-loss registries and the ``AlgoSpec`` of each algorithm.
"""
import sys as _sys

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
from .entropy_control import make_entropy_control, register_entropy_control
from .filters import dynamic_sampling_filter, dynamic_sampling_refill
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

# the public API: every name imported above (the submodules stay reachable as attributes)
__all__ = sorted(n for n, v in dict(globals()).items() if not n.startswith("_") and not isinstance(v, type(_sys)))

"""Algorithm registries (in the style of verl's ``core_algos``): advantage estimators, policy losses
and the ``AlgoSpec`` that says what an algorithm needs from the trainer.

- ``register_adv_est(name)``: fn(inp: AdvInputs, cfg) -> AdvOutput. ``inp`` holds the rollout
  batch's scores [N], response mask [N, T], the critic's values [N, T] (None without a critic) and
  the group size K; ``cfg`` is the ``algo`` config section (read by attribute).
- ``register_policy_loss(name, normalizer=...)``: fn(inp: PolicyLossInputs, cfg) -> (loss, metrics),
  the loss a SUM over tokens (``normalizer="tokens"``) or over sequences (``"seqs"``): the trainer
  divides by the global count of that unit (megatron's per-token normalisation).
- ``AlgoSpec``: one per algorithm name (``algo.name``); the trainer asks the spec, not the name.

Everything here is pure torch; the built-ins are registered at the bottom of this module, where
the registries live.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import Tensor

from .advantages import (compute_gae, flash_reinforce_advantages, grpo_advantages, length_adaptive_lambda,
                         reinforce_pp_advantages, terminal_rewards)
from .losses import cispo_loss, dppo_tv_loss, flash_reinforce_loss, masked_mean, ppo_clip_loss
from .metrics import explained_variance


@dataclasses.dataclass(frozen=True)
class AlgoSpec:
    """What one algorithm (``algo.name``) is made of and what it needs from the trainer."""
    name: str
    adv_estimator: str  # key of the advantage registry
    policy_loss: str  # default key of the policy-loss registry (``algo.policy_loss`` overrides it)
    uses_critic: bool  # a value model is built, trained and used for advantages (and DAPS)
    uses_is_corrections: bool  # token IS weights + IcePoP + MIS masks from old vs rollout log-probs
    needs_groups: bool  # advantages need K >= 2 responses per prompt (rollout.k)


@dataclasses.dataclass
class AdvInputs:
    scores: Tensor  # [N] outcome rewards
    mask: Tensor  # [N, T] 0/1 valid response tokens
    values: Optional[Tensor] = None  # [N, T] critic V(s_t) (uses_critic only), unclamped
    group_size: int = 1  # K responses per prompt, contiguous


@dataclasses.dataclass
class AdvOutput:
    adv: Tensor  # [N, T] (or [N] for sequence-level estimators)
    returns: Optional[Tensor] = None  # [N, T] critic targets (uses_critic only)
    metrics: dict = dataclasses.field(default_factory=dict)  # full metric names ("critic/...", "adv/...")


@dataclasses.dataclass
class PolicyLossInputs:
    logp: Tensor  # [n, T] current log-probs (with grad)
    old_logp: Tensor  # [n, T] log-probs of the policy before this step's updates
    rollout_logp: Tensor  # [n, T] the engine's (behaviour) log-probs
    adv: Tensor  # [n, T] or [n]
    mask: Tensor  # [n, T]
    is_weights: Optional[Tensor] = None  # [n, T] token IS weights (uses_is_corrections)
    keep_mask: Optional[Tensor] = None  # [n, T] IcePoP x MIS keep mask (uses_is_corrections)


AdvFn = Callable[[AdvInputs, object], AdvOutput]
PolicyLossFn = Callable[[PolicyLossInputs, object], "tuple[Tensor, dict]"]

_ADV: dict[str, AdvFn] = {}
_LOSS: dict[str, tuple[PolicyLossFn, str]] = {}
_ALGOS: dict[str, AlgoSpec] = {}


def _unknown(kind: str, name: str, known) -> KeyError:
    return KeyError(f"unknown {kind} {name!r}; registered: {sorted(known)}")


def register_adv_est(name: str) -> Callable[[AdvFn], AdvFn]:
    def deco(fn: AdvFn) -> AdvFn:
        if name in _ADV and _ADV[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ADV[name] = fn
        return fn
    return deco


def register_policy_loss(name: str, normalizer: str = "tokens") -> Callable[[PolicyLossFn], PolicyLossFn]:
    if normalizer not in ("tokens", "seqs"):
        raise ValueError(f"normalizer must be 'tokens' or 'seqs', got {normalizer!r}")

    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _LOSS and _LOSS[name][0] is not fn:
            raise ValueError(f"policy loss {name!r} is already registered")
        _LOSS[name] = (fn, normalizer)
        return fn
    return deco


def register_algo(spec: AlgoSpec) -> AlgoSpec:
    if spec.adv_estimator not in _ADV:
        raise _unknown("advantage estimator", spec.adv_estimator, _ADV)
    if spec.policy_loss not in _LOSS:
        raise _unknown("policy loss", spec.policy_loss, _LOSS)
    if spec.name in _ALGOS and _ALGOS[spec.name] != spec:
        raise ValueError(f"algorithm {spec.name!r} is already registered")
    _ALGOS[spec.name] = spec
    return spec


def get_adv_est(name: str) -> AdvFn:
    if name not in _ADV:
        raise _unknown("advantage estimator", name, _ADV)
    return _ADV[name]


def get_policy_loss(name: str) -> tuple[PolicyLossFn, str]:
    """(fn, normalizer) registered under ``name``."""
    if name not in _LOSS:
        raise _unknown("policy loss", name, _LOSS)
    return _LOSS[name]


def get_algo(name: str) -> AlgoSpec:
    if name not in _ALGOS:
        raise _unknown("algorithm", name, _ALGOS)
    return _ALGOS[name]


def registered(kind: str) -> list[str]:
    """Names in one registry: "algo" | "adv_est" | "policy_loss"."""
    return sorted({"algo": _ALGOS, "adv_est": _ADV, "policy_loss": _LOSS}[kind])


def clamp_values(values: Tensor, cfg) -> Tensor:
    """V outside [reward_min, reward_max] is estimation error that would flip advantage signs."""
    return values.clamp(cfg.reward_min, cfg.reward_max) if cfg.clamp_values else values


# ---- built-in advantage estimators ----------------------------------------------------------------
@register_adv_est("s3ac_gae")
def s3ac_gae(inp: AdvInputs, cfg) -> AdvOutput:
    """S3AC §3.2: actor GAE with length-adaptive lambda = 1 - 1/(alpha T) (or a fixed ``actor_lambda``), critic returns with
    ``critic_lambda``, on terminal +-1 rewards; values clamped to the reward range; no normalisation."""
    values, mask, scores = inp.values, inp.mask, inp.scores
    rew_tok = terminal_rewards(scores, mask)
    v_gae = clamp_values(values, cfg)
    # ``actor_lambda`` (a number) fixes lambda instead (the ablation of paper §3.1 / VAPO)
    fixed = getattr(cfg, "actor_lambda", None)
    lam = length_adaptive_lambda(mask.sum(1), alpha=cfg.actor_alpha) if fixed is None else float(fixed)
    adv, _ = compute_gae(rew_tok, v_gae, mask, lam=lam)
    _, returns = compute_gae(rew_tok, v_gae, mask, lam=cfg.critic_lambda)
    m = {"critic/explained_variance": float(explained_variance(values, returns, mask)),
         "critic/v0_mean": float(values[:, 0].mean()),
         "critic/values_out_of_range_frac": float(masked_mean(
             ((values < cfg.reward_min) | (values > cfg.reward_max)).float(), mask))}
    # sign check: with +-1 rewards, A at the last token = R - V(s_T-1); a correct answer's advantage
    # must be positive and a wrong one's negative
    last = terminal_rewards(torch.ones_like(scores), mask).bool()
    pos, neg = scores > 0, scores <= 0
    if pos.any():
        m["adv/last_token_correct"] = float(adv[last][pos].mean())
    if neg.any():
        m["adv/last_token_wrong"] = float(adv[last][neg].mean())
    return AdvOutput(adv, returns, m)


@register_adv_est("grpo")
def grpo(inp: AdvInputs, cfg) -> AdvOutput:
    return AdvOutput(grpo_advantages(inp.scores, inp.group_size, normalize_std=cfg.grpo_normalize_std,
                                     mask=inp.mask))


@register_adv_est("reinforce_pp")
def reinforce_pp(inp: AdvInputs, cfg) -> AdvOutput:
    return AdvOutput(reinforce_pp_advantages(inp.scores, inp.mask))


@register_adv_est("flash_reinforce")
def flash_reinforce(inp: AdvInputs, cfg) -> AdvOutput:
    """One scalar per row, centred on the batch."""
    return AdvOutput(flash_reinforce_advantages(inp.scores))


# ---- built-in policy losses (sums: num_global_tokens / num_global_seqs = 1) -------------------------
@register_policy_loss("cispo")
def cispo(inp: PolicyLossInputs, cfg):
    return cispo_loss(inp.logp, inp.old_logp, inp.adv, inp.mask, cfg.eps_low, cfg.eps_high,
                      is_weights=inp.is_weights, keep_mask=inp.keep_mask, num_global_tokens=1)


@register_policy_loss("ppo_clip")
def ppo_clip(inp: PolicyLossInputs, cfg):
    return ppo_clip_loss(inp.logp, inp.old_logp, inp.adv, inp.mask, cfg.eps_low, cfg.eps_high,
                         cfg.dual_clip_c, is_weights=inp.is_weights, keep_mask=inp.keep_mask,
                         num_global_tokens=1)


@register_policy_loss("dppo_tv")
def dppo_tv(inp: PolicyLossInputs, cfg):
    return dppo_tv_loss(inp.logp, inp.old_logp, inp.adv, inp.mask, cfg.tv_delta_low, cfg.tv_delta_high,
                        is_weights=inp.is_weights, keep_mask=inp.keep_mask, num_global_tokens=1)


@register_policy_loss("flash_reinforce", normalizer="seqs")
def flash_reinforce_pl(inp: PolicyLossInputs, cfg):
    """Against the behaviour (rollout) log-probs, with its own sequence-level trust region."""
    return flash_reinforce_loss(inp.logp, inp.rollout_logp, inp.adv, inp.mask, cfg.flash_delta, num_global_seqs=1)


# ---- built-in algorithms -----------------------------------------------------------------------------
register_algo(AlgoSpec("s3ac", "s3ac_gae", "cispo", uses_critic=True, uses_is_corrections=True, needs_groups=False))
register_algo(AlgoSpec("grpo_x", "grpo", "cispo", uses_critic=False, uses_is_corrections=True, needs_groups=True))
register_algo(AlgoSpec("reinforce_pp", "reinforce_pp", "cispo", uses_critic=False, uses_is_corrections=False,
                       needs_groups=False))
register_algo(AlgoSpec("flash_reinforce", "flash_reinforce", "flash_reinforce", uses_critic=False,
                       uses_is_corrections=False, needs_groups=False))

"""The ``algo``, ``daps`` and ``value_pretrain`` sections."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional
from megatron_s3ac.config.enums import _missing_paths


@dataclass
class AlgoCfg:
    name: str = "s3ac"  # an algorithms.registry AlgoSpec: s3ac | grpo_x | reinforce_pp | flash_reinforce
    # policy loss (algorithms.registry): None = the algorithm's own (CISPO; FlashREINFORCE's for
    # flash_reinforce); cispo | ppo_clip | dppo_tv | flash_reinforce
    policy_loss: Optional[str] = None
    actor_lr: float = 1e-4
    critic_lr_mult: float = 5.0
    actor_minibatches: int = 8
    actor_epochs: int = 1
    critic_minibatches: int = 8
    critic_epochs: int = 2
    micro_batch_size: int = 0  # rows per micro-batch (0 = whole mini-batch on this rank)
    # sequence packing: > 0 packs samples back to back into micro-batches of at most this many tokens
    # (first-fit decreasing; micro_batch_size is then unused). 0 = padded micro-batches
    max_tokens_per_micro_batch: int = 0
    eps_low: float = 0.2  # CISPO / PPO clip-higher: [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.28
    actor_clip_grad: float = 1.0
    critic_clip_grad: float = 10.0
    value_clip: float = 0.2
    critic_lambda: float = 1.0
    actor_alpha: float = 1.5  # length-adaptive lambda = 1 - 1/(alpha T)
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    mis_threshold: float = 2.0  # nats: mask a response whose max log-ratio exceeds this
    # false: the token IS weights and IcePoP/MIS masks are computed and logged but not applied
    # (the "corrections disabled" arm of docs/fp8.md); only for algorithms that use them
    mismatch_corrections: bool = True
    dynamic_sampling: bool = True  # DAPO group filter (K > 1)
    # DAPO refill: when the filter drops groups, draw and roll out more prompts until the step holds
    # rollout.prompts_per_step informative groups, at most refill_max_factor x prompts_per_step groups
    # drawn per step (then the step trains on what it kept). Off: train on the kept groups only.
    # Default off from measurement (docs/reproduction.md "DAPO refill"): critic EV +0.005 [-0.004, 0.015]
    # over 3 seeds, within noise, for 1.2-1.5x the rollouts per step
    dynamic_sampling_refill: bool = False
    refill_max_factor: float = 3.0
    # DAPO refill as groups stream back: a replacement prompt group goes to the engine the moment a group is scored
    # uninformative, not after the round (candidates chosen with the round; docs/trainer.md "DAPO"). Needs
    # dynamic_sampling_refill and a streaming engine (rollout.placement=separate, rollout.stream_rewards).
    # Off: the round-by-round refill, unchanged
    refill_eager: bool = False
    # actor GAE lambda: None = length-adaptive 1 - 1/(actor_alpha T) (S3AC); a number = fixed lambda
    actor_lambda: Optional[float] = None
    # entropy control hook on the advantages (algorithms.entropy_control; GRPO-X's GEPO slot):
    # none | gepo_candidate (a documented candidate form, not the paper's exact GEPO), with params
    entropy_control: str = "none"
    entropy_control_params: Dict[str, float] = field(default_factory=dict)
    grpo_normalize_std: bool = True
    # whiten the step's advantages over its valid tokens ((A - mean) / std): off in the S3AC recipe (paper §3.1);
    # on for the sanity test's "critic baseline" arm (tools/sanity_test.py)
    normalize_advantages: bool = False
    flash_delta: float = 3e-3
    dual_clip_c: Optional[float] = None  # ppo_clip: dual clip c > 1 for A < 0 (None = off)
    tv_delta_low: float = 0.2  # dppo_tv: trust region on p - p_old (probability units)
    tv_delta_high: float = 0.2
    weight_decay: float = 0.0
    # the critic's V estimates an expected return in [reward_min, reward_max]; values outside that
    # range are estimation error and would flip advantage signs (V < -1 gives a wrong answer A > 0):
    # clamp them before GAE and DAPS (the critic's own regression target is unaffected)
    clamp_values: bool = True
    reward_min: float = -1.0
    reward_max: float = 1.0
    # token log-probs / entropy over at most this many tokens' fp32 logits at a time (0 = all at once)
    logprob_chunk_tokens: int = 0

    def errors(self) -> list[str]:
        from megatron_s3ac.algorithms.registry import get_algo, get_policy_loss

        out = []
        for key, get in (("name", get_algo), ("policy_loss", get_policy_loss)):
            try:
                if getattr(self, key) is not None:
                    get(getattr(self, key))
            except KeyError as e:
                out.append(f"algo.{key}: {e.args[0]}")
        for key in ("actor_minibatches", "actor_epochs", "critic_minibatches", "critic_epochs"):
            if getattr(self, key) < 1:
                out.append(f"algo.{key}={getattr(self, key)} must be >= 1")
        if self.micro_batch_size < 0:
            out.append("algo.micro_batch_size must be >= 0")
        if self.max_tokens_per_micro_batch < 0:
            out.append("algo.max_tokens_per_micro_batch must be >= 0 (0 = no packing)")
        for key in ("actor_lr", "critic_lr_mult", "actor_clip_grad", "critic_clip_grad", "actor_alpha"):
            if not getattr(self, key) > 0:
                out.append(f"algo.{key}={getattr(self, key)} must be > 0")
        if not 0 <= self.eps_low <= 1 or self.eps_high < 0:
            out.append(f"algo.eps_low must be in [0, 1] and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if not 0 <= self.critic_lambda <= 1:
            out.append(f"algo.critic_lambda={self.critic_lambda} must be in [0, 1]")
        if not 0 < self.icepop_low < 1 < self.icepop_high:
            out.append(f"algo.icepop_low/high must satisfy 0 < low < 1 < high, got {self.icepop_low}, {self.icepop_high}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            out.append(f"algo.dual_clip_c={self.dual_clip_c} must be > 1 (or null)")
        if self.tv_delta_low < 0 or self.tv_delta_high < 0:
            out.append("algo.tv_delta_low and algo.tv_delta_high must be >= 0")
        if self.logprob_chunk_tokens < 0:
            out.append("algo.logprob_chunk_tokens must be >= 0 (0 = unchunked)")
        if not self.refill_max_factor >= 1:
            out.append(f"algo.refill_max_factor={self.refill_max_factor} must be >= 1")
        if self.actor_lambda is not None and not 0 <= self.actor_lambda <= 1:
            out.append(f"algo.actor_lambda={self.actor_lambda} must be in [0, 1] (or null: length-adaptive)")
        from megatron_s3ac.algorithms.entropy_control import make_entropy_control

        try:
            make_entropy_control(self.entropy_control, **self.entropy_control_params)
        except (KeyError, TypeError, ValueError) as e:
            out.append(f"algo.entropy_control: {e.args[0] if e.args else e}")
        return out


@dataclass
class DAPSCfg:
    enabled: bool = True
    n_c: float = 4.0
    a_min: float = 0.1
    warmup_steps: int = 2
    rampup_steps: int = 4
    half_life_steps: float = 100.0


@dataclass
class ValuePretrainCfg:
    enabled: bool = True
    coverage_path: Optional[str] = None  # jsonl from tools/build_coverage_data.py
    epochs: int = 2
    lr: float = 5e-4
    batch_size: int = 64
    clip_grad: float = 10.0
    # null: frozen for the plain critic (the paper's recipe), trained when model.critic_privileged is set: comparing
    # a response token with the answer's is attention's work (issue 37; docs/trainer.md "The critic's privileged input")
    freeze_attention_and_router: Optional[bool] = None

    def freezes(self, privileged: bool) -> bool:
        """Whether value pretraining freezes attention + router, for a critic with (or without) the privileged block."""
        return (not privileged) if self.freeze_attention_and_router is None else bool(self.freeze_attention_and_router)

    def errors(self) -> list[str]:
        out = _missing_paths("value_pretrain", self, ("coverage_path",))
        if self.epochs < 1 or self.batch_size < 1:
            out.append("value_pretrain.epochs and value_pretrain.batch_size must be >= 1")
        return out

"""Pluggable entropy control for GRPO-X (pure torch).

What the paper says: GRPO-X is "the shared recipe, with Rollout Routing Replay (R3) and GEPO entropy
control (Cheng et al., 2026) configured as in Table 6" (S3AC §4.1, Baselines). Neither the GEPO
formula nor Table 6's settings are in the seed papers (the stored text ends before the appendix).

What is known of GEPO (Group Entropy-Controlled Policy Optimization, arXiv 2607.16850; abstract only,
see shared/research/algorithms.md §5): a lightweight GRPO extension that computes a group entropy
from the G samples of a prompt and shapes advantages asymmetrically -- positive advantages are
attenuated in low-entropy groups (curbing over-exploitation), negative advantages in high-entropy
groups (preserving exploration) -- with adaptive thresholds from running group-entropy statistics.

Unknown, therefore chosen here and named as choices: how group entropy is aggregated (we take the
token-mean of the rollout policy's per-token entropy over the group's valid tokens), the threshold
rule (running mean +- tau running std, an exponential moving average), the attenuation (a constant
factor, not a function of the distance to the threshold), the statistics window (EMA decay) and
warm-up. Hence the hook is pluggable and off by default: ``ENTROPY_CONTROLS["none"]`` is the
identity, ``"gepo_candidate"`` the candidate form below; a better-sourced form registers itself with
``@register_entropy_control(name)`` and the trainer picks it by name.

Interface: a controller is built by ``make_entropy_control(name, **params)`` and called once per
rollout step, after advantages are computed and before the actor update:

    adv, metrics = ctl(adv, entropy, mask, group_size)
    adv      [B, T] (token advantages) or [B] (one per response); rows are groups of group_size
             contiguous responses (the GRPO layout); returned with the same shape
    entropy  [B, T] per-token entropy of the policy that generated the rows (nats)
    mask     [B, T] 0/1 valid response tokens
    metrics  python floats (logged under "entropy_control/...")
Stateful controllers expose state_dict / load_state_dict so a resumed run continues the statistics.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

Tensor = torch.Tensor

ENTROPY_CONTROLS: dict[str, Callable[..., "EntropyControl"]] = {}


def register_entropy_control(name: str):
    """Class decorator: register a controller factory under ``name``."""

    def deco(cls):
        if name in ENTROPY_CONTROLS and ENTROPY_CONTROLS[name] is not cls:
            raise ValueError(f"entropy control {name!r} is already registered")
        ENTROPY_CONTROLS[name] = cls
        return cls

    return deco


def make_entropy_control(name: str = "none", **params) -> "EntropyControl":
    if name not in ENTROPY_CONTROLS:
        raise KeyError(f"unknown entropy control {name!r}; registered: {sorted(ENTROPY_CONTROLS)}")
    return ENTROPY_CONTROLS[name](**params)


class EntropyControl:
    """Base: the identity (no control)."""

    def __call__(self, adv: Tensor, entropy: Tensor, mask: Tensor, group_size: int) -> tuple[Tensor, dict]:
        return adv, {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


register_entropy_control("none")(EntropyControl)


def group_entropy(entropy: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """Token-mean entropy over each group's valid tokens: [B, T] -> [B / group_size] (float64)."""
    b = mask.shape[0]
    if group_size < 1 or b % group_size:
        raise ValueError(f"{b} rows cannot be split into groups of {group_size}")
    m = mask.to(torch.float64).reshape(b // group_size, -1)
    e = entropy.to(torch.float64).reshape(b // group_size, -1)
    return (e * m).sum(1) / m.sum(1).clamp(min=1.0)


@register_entropy_control("gepo_candidate")
@dataclasses.dataclass
class GEPOCandidate(EntropyControl):
    """Candidate GEPO form (see the module docstring for what is sourced and what is chosen).

    With H_g the group entropy and (mu, sigma) the running mean and std of H_g over past steps:
      low-entropy group  (H_g < mu - tau * sigma): positive advantages x attenuation;
      high-entropy group (H_g > mu + tau * sigma): negative advantages x attenuation;
      otherwise unchanged. No shaping until ``warmup_steps`` steps of statistics exist.
    Statistics: EMA with ``decay`` of the per-step mean of H_g and of its second moment, updated
    after the step is shaped (a step is judged against the past only).
    """

    tau: float = 1.0
    attenuation: float = 0.5
    decay: float = 0.9
    warmup_steps: int = 1
    steps: int = 0
    mean: float = 0.0
    sq_mean: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.attenuation <= 1.0:
            raise ValueError(f"attenuation must be in [0, 1], got {self.attenuation}")
        if not 0.0 <= self.decay < 1.0 or self.tau < 0 or self.warmup_steps < 1:
            raise ValueError("need 0 <= decay < 1, tau >= 0, warmup_steps >= 1")

    def thresholds(self) -> tuple[float, float]:
        sigma = max(self.sq_mean - self.mean ** 2, 0.0) ** 0.5
        return self.mean - self.tau * sigma, self.mean + self.tau * sigma

    def __call__(self, adv, entropy, mask, group_size):
        h = group_entropy(entropy, mask, group_size)  # [G]
        metrics = {"group_entropy_mean": float(h.mean()), "low_groups": 0.0, "high_groups": 0.0}
        out = adv
        if self.steps >= self.warmup_steps:
            lo, hi = self.thresholds()
            low, high = h < lo, h > hi
            row_low = low.repeat_interleave(group_size)
            row_high = high.repeat_interleave(group_size)
            if adv.dim() == 2:
                row_low, row_high = row_low[:, None], row_high[:, None]
            damp = ((row_low & (adv > 0)) | (row_high & (adv < 0))).to(adv.dtype)
            out = adv * (1 - damp * (1 - self.attenuation))
            metrics.update(low_groups=float(low.sum()), high_groups=float(high.sum()), threshold_low=lo,
                           threshold_high=hi)
        # update the running statistics with this step's groups
        step_mean, step_sq = float(h.mean()), float((h ** 2).mean())
        if self.steps == 0:
            self.mean, self.sq_mean = step_mean, step_sq
        else:
            self.mean = self.decay * self.mean + (1 - self.decay) * step_mean
            self.sq_mean = self.decay * self.sq_mean + (1 - self.decay) * step_sq
        self.steps += 1
        return out, metrics

    def state_dict(self) -> dict:
        return {"steps": self.steps, "mean": self.mean, "sq_mean": self.sq_mean}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.mean, self.sq_mean = int(state["steps"]), float(state["mean"]), float(state["sq_mean"])


__all__ = ["ENTROPY_CONTROLS", "EntropyControl", "GEPOCandidate", "group_entropy", "make_entropy_control",
           "register_entropy_control"]

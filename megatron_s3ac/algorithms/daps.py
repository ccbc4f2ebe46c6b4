"""Difficulty-Aware Prompt Sampling (DAPS), S3AC §3.4, Eqs. (4)-(5).

Loop (once per rollout batch, before generation):
  1. draw candidate prompts uniformly from the data stream (a shuffled epoch iterator);
  2. score them with the latest critic: V(s_0) = the critic value at the last prompt token;
  3. ``select``: p_c = clip((V(s_0) + 1) / 2, 0, 1) and p_hat = (S + n_c p_c) / (N + n_c) (Eq. 4),
     then accept each candidate independently with probability
     a = a_min + (1 - a_min) * 4 p_hat (1 - p_hat) (Eq. 5);
  4. repeat 1-3 until the batch holds ``batch_size`` accepted prompts (``fill`` does this);
  5. generate K >= 1 responses per accepted prompt, then ``update`` with their rewards.
Rejected prompts are only skipped for this batch: nothing about them is recorded (no outcome was
observed) and they come back whenever the data stream yields them again (e.g. next epoch).

Schedule (the paper's App. D values are not available to us; the rule below is our choice and
the defaults are placeholders): for ``step < warmup_steps`` every candidate is accepted (uniform
sampling); afterwards the rule is phased in linearly over ``rampup_steps``:
a_eff = (1 - w) + w * a with w = clip((step - warmup_steps) / rampup_steps, 0, 1).

Decay (the paper: "both counts decay with training progress"; our rule): S and N decay
exponentially with the number of training steps since they were last updated,
S, N <- S, N * 0.5 ** (dt / half_life_steps); half_life_steps=None disables decay. Decay is applied
lazily (on read and before each update), which is identical to decaying every count every step.

``step`` is the caller's training-progress counter (we suggest the rollout step, one per
select/update cycle); warm-up, ramp-up and half-life are in the same unit.
Rewards count as successes when ``reward > success_threshold`` (0 for R in {-1, +1}).
Deterministic given ``seed``; ``state_dict`` holds only tensors and python scalars (safe for
``torch.load(weights_only=True)``) and includes the RNG state, so a restored sampler makes the
same future decisions.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

Tensor = torch.Tensor


class Selection(NamedTuple):
    """Result of :meth:`DAPSSampler.select` / :meth:`DAPSSampler.fill`."""

    ids: Tensor  # [n_accepted] long, accepted prompt ids in candidate order
    index: Tensor  # [n_accepted] long, their positions in the candidate list
    stats: dict  # python floats/ints for logging


class DAPSSampler:
    """Per-prompt success counts + critic prior -> acceptance probabilities (S3AC Eqs. 4-5).

    Prompt ids are non-negative ints (dataset indices); storage grows on demand.
    """

    STATE_VERSION = 1

    def __init__(
        self,
        num_prompts: int = 0,
        *,
        n_c: float = 4.0,
        a_min: float = 0.1,
        warmup_steps: int = 10,
        rampup_steps: int = 20,
        half_life_steps: float | None = 100.0,
        success_threshold: float = 0.0,
        seed: int = 0,
    ):
        if n_c <= 0:
            raise ValueError("n_c must be > 0 (it is the critic's pseudo-count)")
        if not 0.0 <= a_min <= 1.0:
            raise ValueError("a_min must be in [0, 1]")
        if warmup_steps < 0 or rampup_steps < 0:
            raise ValueError("warmup_steps and rampup_steps must be >= 0")
        if half_life_steps is not None and half_life_steps <= 0:
            raise ValueError("half_life_steps must be > 0 or None")
        self.n_c = float(n_c)
        self.a_min = float(a_min)
        self.warmup_steps = int(warmup_steps)
        self.rampup_steps = int(rampup_steps)
        self.half_life_steps = None if half_life_steps is None else float(half_life_steps)
        self.success_threshold = float(success_threshold)
        self.seed = int(seed)
        self.S = torch.zeros(num_prompts, dtype=torch.float64)
        self.N = torch.zeros(num_prompts, dtype=torch.float64)
        self.last_step = torch.zeros(num_prompts, dtype=torch.float64)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.total_candidates = 0
        self.total_accepted = 0
        self.total_updates = 0

    # ---------------------------------------------------------------- math
    def schedule_weight(self, step: float) -> float:
        """Phase-in weight w in [0, 1]: 0 during warm-up (uniform), 1 once the rule is fully on."""
        if step < self.warmup_steps:
            return 0.0
        if self.rampup_steps == 0:
            return 1.0
        return float(min(1.0, max(0.0, (step - self.warmup_steps) / self.rampup_steps)))

    @staticmethod
    def critic_success_prob(values_s0: Tensor) -> Tensor:
        """p_c = clip((V(s_0) + 1) / 2, 0, 1): the success rate implied by an expected return in [-1, 1]."""
        return ((values_s0.detach().to(torch.float64).cpu() + 1.0) / 2.0).clamp(0.0, 1.0)

    def acceptance_prob(self, p_hat: Tensor) -> Tensor:
        """Eq. (5): a = a_min + (1 - a_min) * 4 p_hat (1 - p_hat); peaks at p_hat = 0.5, >= a_min."""
        return self.a_min + (1.0 - self.a_min) * 4.0 * p_hat * (1.0 - p_hat)

    def counts(self, prompt_ids: Tensor, step: float) -> tuple[Tensor, Tensor]:
        """Decayed (S, N) of the given prompts at ``step`` ([n] float64 each; 0 for unseen ids)."""
        ids = self._ids(prompt_ids)
        S = torch.zeros(ids.numel(), dtype=torch.float64)
        N = torch.zeros(ids.numel(), dtype=torch.float64)
        known = ids < self.S.numel()
        if known.any():
            k = ids[known]
            f = self._decay_factor(self.last_step[k], step)
            S[known] = self.S[k] * f
            N[known] = self.N[k] * f
        return S, N

    def estimate(self, prompt_ids: Tensor, values_s0: Tensor, step: float) -> tuple[Tensor, Tensor]:
        """Eq. (4): returns (p_hat, p_c), [n] float64; p_hat = p_c for a never-seen prompt."""
        p_c = self.critic_success_prob(values_s0).reshape(-1)
        S, N = self.counts(prompt_ids, step)
        if p_c.numel() != S.numel():
            raise ValueError("values_s0 must have one value per prompt id")
        return (S + self.n_c * p_c) / (N + self.n_c), p_c

    # ---------------------------------------------------------------- sampling
    def select(
        self, prompt_ids: Tensor, values_s0: Tensor | None, step: float, max_accept: int | None = None
    ) -> Selection:
        """Accept/reject candidate prompts (Eq. 5 under the warm-up/phase-in schedule).

        prompt_ids: [n] candidate ids; values_s0: [n] critic V(s_0) (may be None while the schedule
        weight is 0, i.e. during warm-up). max_accept keeps only the first accepted candidates.
        Draws exactly n uniforms from the sampler's generator per call.
        """
        ids = self._ids(prompt_ids)
        n = ids.numel()
        w = self.schedule_weight(step)
        if values_s0 is None:
            if w > 0:
                raise ValueError("values_s0 is required once the DAPS rule is active (after warm-up)")
            p_hat = p_c = torch.full((n,), float("nan"), dtype=torch.float64)
            a = torch.ones(n, dtype=torch.float64)
        else:
            p_hat, p_c = self.estimate(ids, values_s0, step)
            a = (1.0 - w) + w * self.acceptance_prob(p_hat)
        u = torch.rand(n, generator=self.generator, dtype=torch.float64)
        accept = u < a
        index = accept.nonzero(as_tuple=True)[0]
        if max_accept is not None:
            index = index[: max(0, int(max_accept))]
        self.total_candidates += n
        self.total_accepted += index.numel()
        _, N = self.counts(ids, step)
        stats = {
            "daps/candidates": n,
            "daps/accepted": int(index.numel()),
            "daps/acceptance_rate": index.numel() / n if n else float("nan"),
            "daps/mean_accept_prob": float(a.mean()) if n else float("nan"),
            "daps/schedule_weight": w,
            "daps/new_prompt_frac": float((N == 0).double().mean()) if n else float("nan"),
            "daps/mean_p_hat": float(p_hat.mean()) if n else float("nan"),
            "daps/mean_p_c": float(p_c.mean()) if n else float("nan"),
            "daps/accepted_mid_frac": float(((p_hat[index] >= 0.2) & (p_hat[index] <= 0.8)).double().mean())
            if index.numel() and values_s0 is not None
            else float("nan"),
            "daps/cum_acceptance_rate": self.total_accepted / max(1, self.total_candidates),
        }
        return Selection(ids[index], index, stats)

    def fill(
        self,
        draw: Callable[[int], Tensor],
        score: Callable[[Tensor], Tensor],
        batch_size: int,
        step: float,
        chunk_size: int | None = None,
        max_candidates: int | None = None,
    ) -> Selection:
        """Draw/score/select chunks of candidates until ``batch_size`` prompts are accepted.

        draw(n) -> [n] candidate ids from the data stream; score(ids) -> [n] critic V(s_0) (not
        called during warm-up). chunk_size defaults to 2 * batch_size; max_candidates
        (default 20 * batch_size) bounds the work: if reached, the batch is topped up with the
        earliest rejected candidates (uniform, as without DAPS) and stats['daps/topped_up'] says
        how many. Returns Selection(ids, index into all drawn candidates, stats).
        """
        chunk = chunk_size or 2 * batch_size
        limit = max_candidates or 20 * batch_size
        w = self.schedule_weight(step)
        drawn: list[Tensor] = []
        acc: list[Tensor] = []
        n_drawn = n_acc = 0
        while n_acc < batch_size and n_drawn < limit:
            ids = self._ids(draw(min(chunk, limit - n_drawn)))
            if ids.numel() == 0:
                break
            vals = score(ids) if w > 0 else None
            sel = self.select(ids, vals, step, max_accept=batch_size - n_acc)
            acc.append(sel.index + n_drawn)
            drawn.append(ids)
            n_drawn += ids.numel()
            n_acc += sel.index.numel()
        all_ids = torch.cat(drawn) if drawn else torch.zeros(0, dtype=torch.long)
        index = torch.cat(acc) if acc else torch.zeros(0, dtype=torch.long)
        topped = 0
        if index.numel() < batch_size:
            rejected = torch.ones(all_ids.numel(), dtype=torch.bool)
            rejected[index] = False
            extra = rejected.nonzero(as_tuple=True)[0][: batch_size - index.numel()]
            topped = int(extra.numel())
            index = torch.cat([index, extra])
        stats = {
            "daps/candidates": int(n_drawn),
            "daps/accepted": int(index.numel() - topped),
            "daps/acceptance_rate": (index.numel() - topped) / n_drawn if n_drawn else float("nan"),
            "daps/topped_up": topped,
            "daps/schedule_weight": w,
            "daps/cum_acceptance_rate": self.total_accepted / max(1, self.total_candidates),
        }
        return Selection(all_ids[index], index, stats)

    # ---------------------------------------------------------------- outcomes
    def update(self, prompt_ids: Tensor, rewards: Tensor, step: float) -> dict:
        """Record outcomes: one entry per response (repeat an id K times for K responses).

        prompt_ids: [n] ids (or [P] with rewards [P, K]); rewards: [n] (or [P, K]).
        Existing counts are decayed to ``step`` first, then S += #successes, N += #responses.
        """
        r = rewards.detach().to(torch.float64).cpu()
        ids = self._ids(prompt_ids)
        if r.ndim == 2 and ids.numel() == r.shape[0]:
            ids = ids.repeat_interleave(r.shape[1])
        r = r.reshape(-1)
        if r.numel() != ids.numel():
            raise ValueError("need one reward per prompt id (or rewards [P, K] for ids [P])")
        if ids.numel() == 0:
            return {"daps/updated_prompts": 0}
        self._grow(int(ids.max()) + 1)
        uniq = ids.unique()
        f = self._decay_factor(self.last_step[uniq], step)
        self.S[uniq] *= f
        self.N[uniq] *= f
        self.last_step[uniq] = float(step)
        self.S.index_add_(0, ids, (r > self.success_threshold).to(torch.float64))
        self.N.index_add_(0, ids, torch.ones_like(r))
        self.total_updates += int(ids.numel())
        return {"daps/updated_prompts": int(uniq.numel()), "daps/success_rate": float((r > self.success_threshold).double().mean())}

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        return {
            "version": self.STATE_VERSION,
            "S": self.S.clone(),
            "N": self.N.clone(),
            "last_step": self.last_step.clone(),
            "rng_state": self.generator.get_state(),
            "total_candidates": self.total_candidates,
            "total_accepted": self.total_accepted,
            "total_updates": self.total_updates,
            "config": {
                "n_c": self.n_c,
                "a_min": self.a_min,
                "warmup_steps": self.warmup_steps,
                "rampup_steps": self.rampup_steps,
                "half_life_steps": self.half_life_steps,
                "success_threshold": self.success_threshold,
                "seed": self.seed,
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore counts, RNG and totals. The constructor's hyper-parameters are kept (a resumed run
        may change them on purpose); ``state['config']`` records what the saving run used."""
        if state.get("version") != self.STATE_VERSION:
            raise ValueError(f"unsupported DAPS state version {state.get('version')}")
        self.S = state["S"].to(torch.float64).clone()
        self.N = state["N"].to(torch.float64).clone()
        self.last_step = state["last_step"].to(torch.float64).clone()
        self.generator.set_state(state["rng_state"].clone())
        self.total_candidates = int(state["total_candidates"])
        self.total_accepted = int(state["total_accepted"])
        self.total_updates = int(state["total_updates"])

    # ---------------------------------------------------------------- internals
    @staticmethod
    def _ids(prompt_ids) -> Tensor:
        ids = torch.as_tensor(prompt_ids).detach().cpu().reshape(-1).long()
        if ids.numel() and int(ids.min()) < 0:
            raise ValueError("prompt ids must be non-negative integers")
        return ids

    def _grow(self, n: int) -> None:
        if n > self.S.numel():
            pad = n - self.S.numel()
            self.S = torch.cat([self.S, torch.zeros(pad, dtype=torch.float64)])
            self.N = torch.cat([self.N, torch.zeros(pad, dtype=torch.float64)])
            self.last_step = torch.cat([self.last_step, torch.zeros(pad, dtype=torch.float64)])

    def _decay_factor(self, last: Tensor, step: float) -> Tensor:
        if self.half_life_steps is None:
            return torch.ones_like(last)
        dt = (float(step) - last).clamp(min=0.0)  # a step earlier than the last update never grows counts
        return torch.pow(0.5, dt / self.half_life_steps)


__all__ = ["DAPSSampler", "Selection"]

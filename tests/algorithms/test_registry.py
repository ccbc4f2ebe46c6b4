"""Algorithm registries: each registered estimator / policy loss equals the hand call of the function it
wraps (the trainer's former string branches), unknown names list the registered ones, and a new
estimator and loss can be registered and looked up."""
import types

import pytest
import torch

from megatron_s3ac import algorithms as A
from megatron_s3ac.algorithms import registry as R
from megatron_s3ac.config import AlgoCfg

torch.manual_seed(0)
N, T, K = 8, 5, 4
MASK = (torch.arange(T)[None] < torch.tensor([5, 3, 1, 4, 5, 2, 5, 3])[:, None]).float()
SCORES = torch.tensor([1.0, -1, -1, 1, 1, 1, -1, -1])
VALUES = torch.randn(N, T) * 0.8
CFG = AlgoCfg(dual_clip_c=3.0, tv_delta_low=0.1, tv_delta_high=0.3)


def test_builtin_specs():
    assert R.registered("algo") == ["flash_reinforce", "grpo_x", "reinforce_pp", "s3ac"]
    s3ac, grpo = R.get_algo("s3ac"), R.get_algo("grpo_x")
    assert s3ac.uses_critic and s3ac.uses_is_corrections and not s3ac.needs_groups
    assert grpo.needs_groups and not grpo.uses_critic and grpo.policy_loss == "cispo"
    assert R.get_algo("flash_reinforce").policy_loss == "flash_reinforce"
    assert R.get_policy_loss("flash_reinforce")[1] == "seqs" and R.get_policy_loss("cispo")[1] == "tokens"


def test_s3ac_gae_matches_hand_computation():
    out = R.get_adv_est("s3ac_gae")(R.AdvInputs(SCORES, MASK, VALUES, K), CFG)
    v = VALUES.clamp(-1, 1)
    rew = A.terminal_rewards(SCORES, MASK)
    adv, _ = A.compute_gae(rew, v, MASK, lam=A.length_adaptive_lambda(MASK.sum(1), alpha=CFG.actor_alpha))
    _, ret = A.compute_gae(rew, v, MASK, lam=CFG.critic_lambda)
    assert torch.equal(out.adv, adv) and torch.equal(out.returns, ret)
    assert out.metrics["critic/v0_mean"] == float(VALUES[:, 0].mean())
    # the last-token sign check: A_T = R - V(s_T-1) with lambda-independent last step
    last = MASK.sum(1).long() - 1
    a_last = out.adv[torch.arange(N), last]
    assert out.metrics["adv/last_token_correct"] == pytest.approx(float(a_last[SCORES > 0].mean()))
    assert (a_last[SCORES > 0] > 0).all() and (a_last[SCORES <= 0] <= 0).all()  # V clamped to [-1, 1]


@pytest.mark.parametrize("name, ref", [
    ("grpo", lambda: A.grpo_advantages(SCORES, K, normalize_std=True, mask=MASK)),
    ("reinforce_pp", lambda: A.reinforce_pp_advantages(SCORES, MASK)),
    ("flash_reinforce", lambda: A.flash_reinforce_advantages(SCORES)),
])
def test_critic_free_estimators(name, ref):
    out = R.get_adv_est(name)(R.AdvInputs(SCORES, MASK, None, K), CFG)
    assert torch.equal(out.adv, ref()) and out.returns is None


def _loss_inputs():
    logp = (torch.randn(N, T) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(N, T) * 0.2
    beh = logp.detach() + torch.randn(N, T) * 0.2
    adv = torch.randn(N, T) * MASK
    isw = torch.rand(N, T) + 0.5
    keep = (torch.rand(N, T) > 0.2).float()
    return R.PolicyLossInputs(logp, old, beh, adv, MASK, isw, keep)


@pytest.mark.parametrize("name, ref", [
    ("cispo", lambda i: A.cispo_loss(i.logp, i.old_logp, i.adv, i.mask, 0.2, 0.28, is_weights=i.is_weights,
                                     keep_mask=i.keep_mask, num_global_tokens=1)),
    ("ppo_clip", lambda i: A.ppo_clip_loss(i.logp, i.old_logp, i.adv, i.mask, 0.2, 0.28, 3.0,
                                           is_weights=i.is_weights, keep_mask=i.keep_mask, num_global_tokens=1)),
    ("dppo_tv", lambda i: A.dppo_tv_loss(i.logp, i.old_logp, i.adv, i.mask, 0.1, 0.3, is_weights=i.is_weights,
                                         keep_mask=i.keep_mask, num_global_tokens=1)),
    ("flash_reinforce", lambda i: A.flash_reinforce_loss(i.logp, i.rollout_logp, i.adv, i.mask, 3e-3,
                                                         num_global_seqs=1)),
])
def test_policy_losses_match_direct_calls(name, ref):
    inp = _loss_inputs()
    if name == "flash_reinforce":
        inp.adv = inp.adv[:, 0]
    fn, _ = R.get_policy_loss(name)
    loss, met = fn(inp, CFG)
    want, want_met = ref(inp)
    assert torch.equal(loss, want) and loss.requires_grad
    assert set(met) == set(want_met)
    # the losses differ from one another on the same inputs (the choice matters)
    fresh = _loss_inputs()
    others = {n: R.get_policy_loss(n)[0](fresh, CFG)[0] for n in ("cispo", "ppo_clip", "dppo_tv")}
    assert len({float(v) for v in others.values()}) == 3


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(KeyError, match=r"unknown policy loss 'ppo'; registered: \['cispo', 'dppo_tv'"):
        R.get_policy_loss("ppo")
    with pytest.raises(KeyError, match=r"unknown advantage estimator 'gae'; registered: \["):
        R.get_adv_est("gae")
    with pytest.raises(KeyError, match="unknown algorithm 'ppo'"):
        R.get_algo("ppo")
    with pytest.raises(KeyError, match="unknown policy loss"):
        R.register_algo(R.AlgoSpec("x", "grpo", "nope", False, False, False))


def test_register_new_estimator_and_loss():
    @R.register_adv_est("test_zero")
    def zero(inp, cfg):
        return R.AdvOutput(torch.zeros_like(inp.mask))

    @R.register_policy_loss("test_nll", normalizer="tokens")
    def nll(inp, cfg):
        return -(inp.logp * inp.mask).sum(), {}

    spec = R.register_algo(R.AlgoSpec("test_algo", "test_zero", "test_nll", False, False, False))
    assert R.get_algo("test_algo") is spec
    assert torch.equal(R.get_adv_est(spec.adv_estimator)(R.AdvInputs(SCORES, MASK), CFG).adv, torch.zeros(N, T))
    with pytest.raises(ValueError, match="already registered"):
        R.register_adv_est("test_zero")(lambda inp, cfg: None)
    with pytest.raises(ValueError, match="normalizer"):
        R.register_policy_loss("bad", normalizer="rows")
    assert isinstance(R.get_policy_loss("test_nll")[0], types.FunctionType)

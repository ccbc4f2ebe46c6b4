"""Policy/value losses: hand values, autograd against sg(.)-coefficients, micro-batch aggregation."""
import math

import pytest
import torch

from megatron_s3ac.algorithms import (
    agg_loss,
    cispo_loss,
    dppo_tv_loss,
    flash_reinforce_advantages,
    flash_reinforce_loss,
    ppo_clip_loss,
    value_loss,
)

from _algo_reference import bernoulli_kl

F64 = torch.float64


def _leaf(x):
    return torch.tensor(x, dtype=F64).requires_grad_(True)


def test_cispo_hand_value_and_clip_fractions():
    logp = _leaf([[math.log(0.5), math.log(0.2), math.log(0.9), 0.0]])
    old = torch.tensor([[math.log(0.4), math.log(0.1), math.log(0.9), -5.0]], dtype=F64)
    adv = torch.tensor([[1.0, -2.0, 0.5, 3.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=F64)
    # r = [1.25, 2.0, 1.0]; eps_high = 0.28 clips 2.0 -> 1.28; eps_low = 1 means no lower bound
    loss, met = cispo_loss(logp, old, adv, mask, eps_low=1.0, eps_high=0.28)
    expected = -(1.25 * 1 * math.log(0.5) + 1.28 * -2 * math.log(0.2) + 1.0 * 0.5 * math.log(0.9)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert met["clip_frac"].item() == pytest.approx(1 / 3)
    assert met["clip_frac_high"].item() == pytest.approx(1 / 3)
    assert met["clip_frac_low"].item() == 0.0
    assert met["num_tokens"].item() == 3
    loss.backward()
    # gradient is -sg(clip(r) A) / N on valid tokens: the ratio itself is not differentiated
    assert torch.allclose(logp.grad, torch.tensor([[-1.25, 2 * 1.28, -0.5, 0.0]], dtype=F64) / 3)


def test_cispo_lower_clip_counts():
    logp = _leaf([[math.log(0.1), math.log(0.5)]])
    old = torch.tensor([[math.log(0.5), math.log(0.5)]], dtype=F64)  # r = [0.2, 1]
    loss, met = cispo_loss(logp, old, torch.ones(1, 2, dtype=F64), torch.ones(1, 2), eps_low=0.2, eps_high=0.2)
    assert met["clip_frac_low"].item() == 0.5 and met["clip_frac_high"].item() == 0.0
    loss.backward()
    assert torch.allclose(logp.grad, -torch.tensor([[0.8, 1.0]], dtype=F64) / 2)


def test_cispo_gradient_autograd_check_with_weights_and_masks():
    B, T = 4, 9
    logp = (-torch.rand(B, T, dtype=F64) * 3).requires_grad_(True)
    old = logp.detach() + torch.randn(B, T, dtype=F64) * 0.5
    adv = torch.randn(B, T, dtype=F64)
    mask = (torch.rand(B, T) < 0.8).to(F64)
    w = torch.rand(B, T, dtype=F64) * 2
    keep = (torch.rand(B, T) < 0.7).to(F64)
    loss, met = cispo_loss(logp, old, adv, mask, 0.3, 0.4, is_weights=w, keep_mask=keep)
    (g,) = torch.autograd.grad(loss, logp)
    r = (logp.detach() - old).exp()
    expected = -(r.clamp(0.7, 1.4) * adv * w * keep * mask) / mask.sum()
    assert torch.allclose(g, expected, atol=1e-12)
    assert met["keep_frac"].item() == pytest.approx(((keep * mask).sum() / mask.sum()).item())
    clipped = ((r < 0.7) | (r > 1.4)).to(F64)
    assert met["clip_frac"].item() == pytest.approx(((clipped * mask).sum() / mask.sum()).item())


def _loss_fns():
    return {
        "cispo": lambda lp, old, a, m, **kw: cispo_loss(lp, old, a, m, 1.0, 0.28, **kw),
        "ppo": lambda lp, old, a, m, **kw: ppo_clip_loss(lp, old, a, m, 0.2, 0.28, dual_clip_c=3.0, **kw),
        "dppo": lambda lp, old, a, m, **kw: dppo_tv_loss(lp, old, a, m, 0.1, 0.1, **kw),
        "value": lambda v, old, ret, m, **kw: value_loss(v, old, ret, m, clip_eps=0.2, **kw),
    }


@pytest.mark.parametrize("name", ["cispo", "ppo", "dppo", "value"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batches_with_global_count_equal_one_big_batch(name, mode):
    fn = _loss_fns()[name]
    B, T = 6, 11
    x = (-torch.rand(B, T, dtype=F64) * 2).requires_grad_(True)
    old = x.detach() + torch.randn(B, T, dtype=F64) * 0.3
    a = torch.randn(B, T, dtype=F64)
    lengths = torch.tensor([11, 2, 7, 1, 9, 4])
    mask = (torch.arange(T) < lengths[:, None]).to(F64)
    kw = {"agg_mode": mode, "max_len": T}
    big, _ = fn(x, old, a, mask, **kw)
    (g_big,) = torch.autograd.grad(big, x)

    n_tok, n_seq = mask.sum(), torch.tensor(float(B))
    total = 0.0
    naive = 0.0
    for sl in (slice(0, 2), slice(2, 3), slice(3, 6)):  # uneven micro-batches
        part, _ = fn(x[sl], old[sl], a[sl], mask[sl], num_global_tokens=n_tok, num_global_seqs=n_seq, **kw)
        total = total + part
        naive = naive + fn(x[sl], old[sl], a[sl], mask[sl], **kw)[0].detach() / 3
    (g_acc,) = torch.autograd.grad(total, x)
    assert total.item() == pytest.approx(big.item(), rel=1e-12, abs=1e-14)
    assert torch.allclose(g_acc, g_big, atol=1e-14)
    if mode == "token-mean":  # the test can fail: a mean of micro-batch means is different
        assert abs(naive.item() - big.item()) > 1e-6


def test_agg_modes_hand_values():
    lm = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert agg_loss(lm, m, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(lm, m, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(lm, m, "seq-mean-token-sum").item() == pytest.approx(10 / 2)
    assert agg_loss(lm, m, "seq-mean-token-sum-norm", max_len=5).item() == pytest.approx(10 / 10)
    assert agg_loss(lm, m, "token-mean", num_global_tokens=8).item() == pytest.approx(10 / 8)
    # masked entries may hold inf/nan (e.g. -inf log-probs of padding) without poisoning the loss
    lm_bad = lm.clone()
    lm_bad[1, 1:] = float("nan")
    assert agg_loss(lm_bad, m).item() == pytest.approx(10 / 4)
    with pytest.raises(ValueError):
        agg_loss(lm, m, "nope")


def test_ppo_clip_higher_and_dual_clip_hand_cases():
    # tokens: (A>0, r=1.5) -> clipped at 1.28; (A<0, r=0.5) -> clipped at 0.8; (A<0, r=5) -> dual 3
    old = torch.zeros(1, 4, dtype=F64)
    logp = _leaf([[math.log(1.5), math.log(0.5), math.log(5.0), math.log(1.1)]])
    adv = torch.tensor([[2.0, -1.0, -1.0, 1.0]], dtype=F64)
    mask = torch.ones(1, 4)
    loss, met = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.28, dual_clip_c=3.0)
    expected = (-2.0 * 1.28 + 0.8 + 3.0 - 1.1) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    # only the unclipped token (r = 1.1) carries gradient -A r / N
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.0, 0.0, -1.1 / 4]], dtype=F64))
    # standard clip active for r=1.5 (A>0) and r=0.5 (A<0); for r=5, A<0 the unclipped branch is the
    # max (5 > 1.28), so only the dual clip applies there
    assert met["clip_frac"].item() == pytest.approx(2 / 4)
    assert met["clip_frac_dual"].item() == pytest.approx(1 / 4)
    with pytest.raises(ValueError):
        ppo_clip_loss(logp, old, adv, mask, dual_clip_c=0.5)


def test_dppo_tv_masks_outside_probability_trust_region():
    p_old = torch.tensor([[0.5, 0.5, 0.5, 0.5]], dtype=F64)
    p_new = torch.tensor([[0.65, 0.55, 0.35, 0.45]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=F64)
    logp = p_new.log().requires_grad_(True)
    loss, met = dppo_tv_loss(logp, p_old.log(), adv, torch.ones(1, 4), 0.1, 0.1)
    # dp = [+0.15 (A>0: out), +0.05 (in), -0.15 (A<0: out), -0.05 (in)]
    r = p_new / p_old
    assert loss.item() == pytest.approx((-(1.0 * r[0, 1]) + r[0, 3]).item() / 4, rel=1e-12)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -1.1 / 4, 0.0, 0.9 / 4]], dtype=F64))
    assert met["tv_mask_frac"].item() == pytest.approx(0.5)


def test_value_loss_hand_case_and_gradient():
    v = _leaf([[0.5, 0.1, -0.3, 9.0]])
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=F64)
    ret = torch.tensor([[1.0, 1.0, -1.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, met = value_loss(v, old, ret, mask, clip_eps=0.2)
    # token 0: max((0.5-1)^2, (0.2-1)^2) = 0.64 (clipped branch, no grad)
    # token 1: inside the clip range: 0.81, grad (V - R) = -0.9
    # token 2: V=-0.3 clipped to -0.2: max(0.49, 0.64) = 0.64 (clipped branch, no grad)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 0.64) / 3, rel=1e-12)
    assert met["vf_clip_frac"].item() == pytest.approx(2 / 3)
    loss.backward()
    assert torch.allclose(v.grad, torch.tensor([[0.0, -0.9 / 3, 0.0, 0.0]], dtype=F64))
    plain, _ = value_loss(v.detach(), old, ret, mask, clip_eps=None)
    assert plain.item() == pytest.approx(0.5 * (0.25 + 0.81 + 0.49) / 3)


def test_value_loss_clip_keeps_the_larger_error():
    # V moved past old + eps but in the direction that reduces error: the unclipped term is larger
    v = _leaf([[0.9]])
    loss, met = value_loss(v, torch.tensor([[0.0]], dtype=F64), torch.tensor([[-1.0]], dtype=F64), torch.ones(1, 1), 0.2)
    assert loss.item() == pytest.approx(0.5 * 1.9**2)
    assert met["vf_clip_frac"].item() == 0.0


def test_flash_reinforce_loss_matches_per_row_reference():
    B, T = 5, 7
    beh = -torch.rand(B, T, dtype=F64) * 2
    logp = (beh + torch.randn(B, T, dtype=F64) * 0.05).requires_grad_(True)
    logp.data[0] = beh[0] + 2.0  # far from the behaviour policy: rejected by the trust region
    lengths = [7, 3, 5, 1, 6]
    mask = (torch.arange(T) < torch.tensor(lengths)[:, None]).to(F64)
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0], dtype=F64)
    adv = flash_reinforce_advantages(rewards)
    delta = 3e-3
    loss, met = flash_reinforce_loss(logp, beh, adv, mask, delta)
    (g,) = torch.autograd.grad(loss, logp)
    ref_loss, ref_g, admitted = 0.0, torch.zeros(B, T, dtype=F64), []
    for b in range(B):
        L = lengths[b]
        kl = sum(bernoulli_kl(math.exp(beh[b, t]), math.exp(logp[b, t].item())) for t in range(L)) / L
        ok = kl <= delta
        admitted.append(ok)
        for t in range(L):
            ratio = math.exp(logp[b, t].item() - beh[b, t].item())
            c = ok * ratio * adv[b].item() / L / B
            ref_loss -= c * logp[b, t].item()
            ref_g[b, t] = -c
    assert admitted[0] is False and any(admitted[1:])
    assert loss.item() == pytest.approx(ref_loss, rel=1e-10)
    assert torch.allclose(g, ref_g, atol=1e-12)
    assert met["admitted_frac"].item() == pytest.approx(sum(admitted) / B)

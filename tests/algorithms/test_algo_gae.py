"""compute_gae / length_adaptive_lambda: hand cases, loop references, properties, stability."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron_s3ac.algorithms import (
    compute_gae,
    discounted_reverse_cumsum,
    length_adaptive_lambda,
    terminal_rewards,
)

from _algo_reference import gae_direct, gae_loop

F64 = torch.float64


def _t(rows):
    return torch.tensor(rows, dtype=F64)


def test_hand_case_right_padded():
    # V = [0.5, 0.2, -0.1], R = +1 on the last token, gamma = 1, lam = 0.5:
    # delta = [-0.3, -0.3, 1.1]; A2 = 1.1, A1 = -0.3 + 0.55 = 0.25, A0 = -0.3 + 0.125 = -0.175
    v = _t([[0.5, 0.2, -0.1, 7.0]])
    r = _t([[0.0, 0.0, 1.0, 0.0]])
    m = _t([[1, 1, 1, 0]])
    adv, ret = compute_gae(r, v, m, gamma=1.0, lam=0.5)
    assert torch.allclose(adv, _t([[-0.175, 0.25, 1.1, 0.0]]), atol=1e-12)
    assert torch.allclose(ret, _t([[0.325, 0.45, 1.0, 0.0]]), atol=1e-12)


@pytest.mark.parametrize(
    "mask,values",
    [
        ([1, 0, 1, 1], [0.5, 99.0, 0.2, -0.1]),  # a hole: its value must be skipped, not used
        ([0, 0, 1, 1, 1], [42.0, -42.0, 0.5, 0.2, -0.1]),  # left padding
        ([1, 1, 0, 0, 1, 0], [0.5, 0.2, 3.0, 3.0, -0.1, 5.0]),
    ],
)
def test_hand_case_with_holes_matches_contiguous(mask, values):
    m = _t([mask])
    v = _t([values])
    r = terminal_rewards(_t([1.0]), m)
    adv, ret = compute_gae(r, v, m, gamma=1.0, lam=0.5)
    valid = m[0].bool()
    assert torch.allclose(adv[0, valid], _t([-0.175, 0.25, 1.1]), atol=1e-12)
    assert torch.allclose(ret[0, valid], _t([0.325, 0.45, 1.0]), atol=1e-12)
    assert (adv[0, ~valid] == 0).all() and (ret[0, ~valid] == 0).all()


def test_terminal_rewards_places_on_last_valid_token():
    m = _t([[1, 1, 0, 0], [0, 1, 0, 1], [0, 0, 0, 0]])
    out = terminal_rewards(_t([1.0, -1.0, 1.0]), m)
    assert torch.equal(out, _t([[0, 1, 0, 0], [0, 0, 0, -1], [0, 0, 0, 0]]))


masks = st.integers(1, 4).flatmap(
    lambda B: st.integers(1, 24).flatmap(
        lambda T: st.tuples(
            st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=B, max_size=B),
            st.lists(st.lists(st.floats(-2, 2), min_size=T, max_size=T), min_size=B, max_size=B),
            st.lists(st.lists(st.floats(-2, 2), min_size=T, max_size=T), min_size=B, max_size=B),
            st.lists(st.floats(0, 1), min_size=B, max_size=B),
        )
    )
)


@given(masks, st.floats(0.5, 1.0))
def test_property_vectorised_equals_reference(data, gamma):
    mask, rew, val, lam = data
    m, r, v, lam_t = _t(mask), _t(rew), _t(val), _t(lam)
    adv, ret = compute_gae(r, v, m, gamma=gamma, lam=lam_t)
    for b in range(len(mask)):
        ref = gae_direct(rew[b], val[b], mask[b], gamma, lam[b])
        assert torch.allclose(adv[b], _t(ref), atol=1e-9), (b, adv[b], ref)
        assert torch.allclose(ret[b], (_t(ref) + v[b]) * m[b], atol=1e-9)


@given(masks)
def test_property_lam1_gives_monte_carlo(data):
    mask, _, val, _ = data
    m, v = _t(mask), _t(val)
    R = torch.where(torch.arange(m.shape[0]) % 2 == 0, 1.0, -1.0).to(F64)
    r = terminal_rewards(R, m)
    adv, ret = compute_gae(r, v, m, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, (R[:, None] - v) * m, atol=1e-9)  # A_t = R - V_t
    assert torch.allclose(ret, R[:, None] * m, atol=1e-9)  # returns = MC return


@given(masks, st.floats(0.5, 1.0))
def test_property_lam0_gives_td_error(data, gamma):
    mask, rew, val, _ = data
    m, r, v = _t(mask), _t(rew), _t(val)
    adv, _ = compute_gae(r, v, m, gamma=gamma, lam=0.0)
    for b in range(len(mask)):
        idx = [t for t in range(len(mask[b])) if mask[b][t]]
        for k, t in enumerate(idx):
            v_next = val[b][idx[k + 1]] if k + 1 < len(idx) else 0.0
            assert adv[b, t].item() == pytest.approx(rew[b][t] + gamma * v_next - val[b][t], abs=1e-12)


def test_per_sequence_lambda_equals_separate_calls():
    m = (torch.rand(3, 50) < 0.8).to(F64)
    v, r = torch.randn(3, 50, dtype=F64), torch.randn(3, 50, dtype=F64)
    lam = _t([0.0, 0.7, 1.0])
    adv, _ = compute_gae(r, v, m, lam=lam, gamma=0.9)
    for b in range(3):
        adv_b, _ = compute_gae(r[b : b + 1], v[b : b + 1], m[b : b + 1], lam=float(lam[b]), gamma=0.9)
        assert torch.allclose(adv[b], adv_b[0], atol=1e-12)


def test_dtype_and_shape_errors():
    m = torch.ones(2, 5)
    adv, ret = compute_gae(torch.zeros(2, 5), torch.zeros(2, 5), m)
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    with pytest.raises(ValueError):
        compute_gae(torch.zeros(2, 5), torch.zeros(2, 5), m, lam=torch.ones(3))
    with pytest.raises(ValueError):
        compute_gae(torch.zeros(2, 5), torch.zeros(2, 4), m)


def test_empty_rows_and_inputs_unchanged():
    m = _t([[0, 0, 0], [1, 1, 0]])
    v = torch.randn(2, 3, dtype=F64)
    r = terminal_rewards(_t([1.0, 1.0]), m)
    v0, r0 = v.clone(), r.clone()
    adv, ret = compute_gae(r, v, m, lam=0.9)
    assert (adv[0] == 0).all() and (ret[0] == 0).all()
    assert torch.equal(v, v0) and torch.equal(r, r0)  # no in-place writes into the caller's tensors


@pytest.mark.parametrize("lam", [0.9, 0.99, 0.999, 0.9999, 1.0])
def test_long_sequence_stability(lam):
    # T = 65536 with lambda in [0.9, 1]: no nan/inf and agreement with the float64 recursion
    T = 65536
    g = torch.Generator().manual_seed(0)
    v = (torch.rand(1, T, generator=g, dtype=F64) * 2 - 1) * 0.9
    m = torch.ones(1, T, dtype=F64)
    m[0, -100:] = 0
    r = terminal_rewards(_t([1.0]), m)
    adv, ret = compute_gae(r, v.float(), m, lam=lam)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    ref = _t(gae_loop(r[0].tolist(), v.float()[0].double().tolist(), m[0].tolist(), 1.0, lam))
    assert (adv[0].double() - ref).abs().max() < 1e-5


def test_underflowing_terminal_weight_is_exact_zero_not_nan():
    # V = 0, R = 1: A_t = lam^(L-1-t) exactly; 0.9^65535 underflows to 0 and must stay finite
    T = 65536
    m = torch.ones(1, T, dtype=F64)
    adv, _ = compute_gae(terminal_rewards(_t([1.0]), m), torch.zeros(1, T, dtype=F64), m, lam=0.9)
    for t in (0, 30000, T - 200, T - 2, T - 1):
        assert adv[0, t].item() == pytest.approx(0.9 ** (T - 1 - t), rel=1e-9, abs=1e-300)
    assert torch.isfinite(adv).all()


@given(st.integers(1, 300), st.floats(0, 1), st.sampled_from([2, 3, 8, 64]))
def test_discounted_reverse_cumsum_matches_loop(n, rho, block):
    x = torch.randn(2, n, dtype=F64)
    y = discounted_reverse_cumsum(x, _t([rho, 1.0]), block=block)
    for b, rb in enumerate((rho, 1.0)):
        acc, ref = 0.0, [0.0] * n
        for k in reversed(range(n)):
            acc = x[b, k].item() + rb * acc
            ref[k] = acc
        assert torch.allclose(y[b], _t(ref), atol=1e-9)


def test_length_adaptive_lambda_values():
    lam = length_adaptive_lambda(torch.tensor([1, 2, 100, 0]), alpha=1.5)
    assert lam.tolist() == pytest.approx([1 - 1 / 1.5, 1 - 1 / 3.0, 1 - 1 / 150.0, 1.0])
    # alpha * T < 1 would give a negative lambda: clamped to 0
    assert length_adaptive_lambda(torch.tensor([1]), alpha=0.4).item() == 0.0
    with pytest.raises(ValueError):
        length_adaptive_lambda(torch.tensor([1]), alpha=0.0)


def test_length_adaptive_terminal_weight_table():
    # BPCO notes' table, alpha = 0.4. Exact values: (1 - 1/(0.4 L))^L = 0.07952 (L=100),
    # 0.08183 (L=1000), 0.08206 (L=10000) -> exp(-2.5) = 0.08208. The notes print 0.0788 and 0.0821
    # for L=100 and L=1000: arithmetic slips there (0.975^100 = 0.0795, 0.9975^1000 = 0.0818).
    L = torch.tensor([100, 1000, 10000])
    w = length_adaptive_lambda(L, alpha=0.4) ** L
    expected = [math.exp(l * math.log1p(-1 / (0.4 * l))) for l in (100, 1000, 10000)]
    assert w.tolist() == pytest.approx(expected, rel=1e-12)
    assert [round(x, 4) for x in w.tolist()] == [0.0795, 0.0818, 0.0821]
    assert abs(w[-1].item() - math.exp(-1 / 0.4)) < 3e-5
    # the same weight seen through GAE: V = 0, R = 1 -> A_0 = lam^(L-1), so lam * A_0 = lam^L
    for l, target in zip(L.tolist(), expected):
        m = torch.ones(1, l, dtype=F64)
        lam = length_adaptive_lambda(m.sum(1), alpha=0.4)
        adv, _ = compute_gae(terminal_rewards(_t([1.0]), m), torch.zeros(1, l, dtype=F64), m, lam=lam)
        assert (lam * adv[0, 0]).item() == pytest.approx(target, rel=1e-9)

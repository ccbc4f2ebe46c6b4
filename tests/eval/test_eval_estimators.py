"""avg@k, unbiased pass@k and bootstrap intervals against hand-computed values."""
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_s3ac.eval.estimators import avg_at_k, bootstrap_ci, pass_at_k, per_prompt_pass_at_k, summarize


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 2 / 5),
    (5, 2, 2, 1 - 3 / 10),            # 1 - C(3,2)/C(5,2)
    (10, 3, 3, 1 - 35 / 120),         # 1 - C(7,3)/C(10,3)
    (5, 2, 4, 1.0),                   # n - c < k: every 4-subset holds a correct sample
    (4, 0, 2, 0.0),
    (4, 4, 4, 1.0),
    (16, 1, 16, 1.0),                 # avg@16 run with one hit: pass@16 is certain
    (16, 1, 8, 1 - 15 * 14 * 13 * 12 * 11 * 10 * 9 * 8 / (16 * 15 * 14 * 13 * 12 * 11 * 10 * 9)),  # = 0.5
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_large_n_is_stable():
    # C(1000, 100) overflows float64; the product form does not.
    n, c, k = 1000, 10, 100
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_matches_exact_combinatorics(nck):
    n, c, k = nck
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)  # pass@1 is the plain accuracy


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


GRID = np.array([[1, 0, 1, 1],
                 [0, 0, 0, 0],
                 [1, 1, 1, 1]], dtype=bool)


def test_avg_at_k_hand_computed():
    assert avg_at_k(GRID) == pytest.approx((0.75 + 0 + 1) / 3)
    assert avg_at_k(GRID[:, :1]) == pytest.approx(2 / 3)  # avg@1


def test_per_prompt_pass_at_k_hand_computed():
    np.testing.assert_allclose(per_prompt_pass_at_k(GRID, 4), [1, 0, 1])
    np.testing.assert_allclose(per_prompt_pass_at_k(GRID, 2), [1 - 0 / 6, 0, 1])  # 3 of 4 right: C(1,2)=0
    np.testing.assert_allclose(per_prompt_pass_at_k(GRID, 1), [0.75, 0, 1])


def test_summarize_keys_and_values():
    s = summarize(GRID, seed=0)
    assert s["avg_at_k"] == pytest.approx(7 / 12)
    assert s["pass_at_k"] == pytest.approx(2 / 3)
    for key in ("avg_at_k", "pass_at_k"):
        lo, hi = s[f"{key}_ci95"]
        assert 0 <= lo <= s[key] <= hi <= 1


def test_grid_validation():
    with pytest.raises(ValueError):
        avg_at_k(np.array([0.5, 1.0]))
    with pytest.raises(ValueError):
        avg_at_k(np.array([[0.5, 1.0]]))


def test_bootstrap_ci_properties():
    x = np.r_[np.ones(200), np.zeros(200)]
    state = np.random.get_state()
    lo, hi = bootstrap_ci(x, seed=3)
    assert np.array_equal(np.random.get_state()[1], state[1])  # own Generator: global stream untouched
    assert (lo, hi) == bootstrap_ci(x, seed=3)  # fixed seed: reproducible
    # Bernoulli(0.5) mean over 400 prompts: normal half-width 1.96 * 0.025 = 0.049.
    assert lo < 0.5 < hi and 0.04 < (hi - lo) / 2 < 0.06
    assert bootstrap_ci(np.full(10, 0.3)) == pytest.approx((0.3, 0.3))
    assert all(math.isnan(v) for v in bootstrap_ci(np.zeros(0)))

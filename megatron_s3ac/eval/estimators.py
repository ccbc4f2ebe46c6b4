"""Accuracy estimators over a [P prompts, n samples] grid of 0/1 correctness, and their 95% intervals.

- avg@k: mean correctness of the k samples of each prompt, averaged over prompts (the paper's
  metric: avg@16 on AIME, avg@4 on GPQA-D, avg@1 elsewhere). It is also the unbiased pass@1.
- pass@k: probability that at least one of k samples is correct, with the unbiased estimator of
  Chen et al. 2021 from n >= k samples per prompt, 1 - C(n-c, k) / C(n, k), computed as a product
  of ratios so it never forms a large binomial coefficient.
- 95% interval: percentile bootstrap over prompts (prompts are resampled with replacement, each
  keeping its own samples) with a fixed seed, so a report is reproducible. It captures the
  variability that matters for a benchmark score, the choice of prompts, and is valid for bounded
  per-prompt scores without a normality assumption, which fails for small benchmarks like AIME (30).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

CI_LEVEL = 0.95
BOOTSTRAP_RESAMPLES = 2000


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with c correct out of n samples (requires 0 <= c <= n, 1 <= k <= n)."""
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every size-k subset holds a correct sample
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def per_prompt_pass_at_k(correct: np.ndarray, k: int) -> np.ndarray:
    """correct [P, n] bool/0-1 -> pass@k per prompt [P] float64."""
    correct = _as_grid(correct)
    n = correct.shape[1]
    return np.array([pass_at_k(n, int(c), k) for c in correct.sum(axis=1)], dtype=np.float64)


def avg_at_k(correct: np.ndarray) -> float:
    """correct [P, k] -> mean over prompts of the per-prompt accuracy (NaN when P == 0)."""
    correct = _as_grid(correct)
    return float(correct.mean(axis=1).mean()) if correct.shape[0] else float("nan")


def bootstrap_ci(per_prompt: np.ndarray, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES,
                 level: float = CI_LEVEL) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-prompt scores [P] (NaNs when P == 0).

    Uses its own numpy Generator: the global numpy RNG is not touched.
    """
    x = np.asarray(per_prompt, dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples, dtype=np.float64)
    chunk = max(1, 2_000_000 // x.size)  # bound the [chunk, P] index matrix to ~16 MB
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        means[start:stop] = x[rng.integers(0, x.size, size=(stop - start, x.size))].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def summarize(correct: np.ndarray, k: Optional[int] = None, seed: int = 0) -> dict:
    """avg@n, pass@k (k defaults to n) and their bootstrap 95% intervals for correct [P, n]."""
    correct = _as_grid(correct)
    n = correct.shape[1]
    k = n if k is None else k
    acc = correct.mean(axis=1) if correct.shape[0] else np.zeros(0)
    passk = per_prompt_pass_at_k(correct, k) if correct.shape[0] else np.zeros(0)
    return {
        "avg_at_k": float(acc.mean()) if acc.size else float("nan"),
        "avg_at_k_ci95": list(bootstrap_ci(acc, seed=seed)),
        "pass_at_k": float(passk.mean()) if passk.size else float("nan"),
        "pass_at_k_ci95": list(bootstrap_ci(passk, seed=seed)),
    }


def _as_grid(correct) -> np.ndarray:
    arr = np.asarray(correct, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"correct must be [prompts, samples], got shape {arr.shape}")
    if arr.size and not np.isin(arr, (0.0, 1.0)).all():
        raise ValueError("correct must hold only 0/1 values")
    return arr

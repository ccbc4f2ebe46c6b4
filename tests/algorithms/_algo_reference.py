"""Independent per-token Python references used by the tests (plain floats, no torch math)."""
from __future__ import annotations

import math


def gae_direct(r, v, m, gamma, lam):
    """Eq. (1) summed literally over the valid-token trajectory: A_k = sum_l (gamma lam)^l delta_{k+l}."""
    idx = [t for t in range(len(m)) if m[t]]
    vals = [float(v[t]) for t in idx] + [0.0]
    rews = [float(r[t]) for t in idx]
    deltas = [rews[k] + gamma * vals[k + 1] - vals[k] for k in range(len(idx))]
    adv = [0.0] * len(m)
    for k, t in enumerate(idx):
        adv[t] = sum((gamma * lam) ** l * deltas[k + l] for l in range(len(idx) - k))
    return adv


def gae_loop(r, v, m, gamma, lam):
    """Reverse recursion over valid tokens only (O(T) per row), python floats."""
    adv = [0.0] * len(m)
    nxt_v, nxt_a = 0.0, 0.0
    for t in reversed(range(len(m))):
        if not m[t]:
            continue
        delta = float(r[t]) + gamma * nxt_v - float(v[t])
        nxt_a = delta + gamma * lam * nxt_a
        nxt_v = float(v[t])
        adv[t] = nxt_a
    return adv


def bernoulli_kl(p, q, eps=1e-6):
    p = min(max(p, eps), 1 - eps)
    q = min(max(q, eps), 1 - eps)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))

"""Statistics and verdicts of tools/reproduce_claims.py (pure python: no numpy/scipy needed).

Per arm: the metric's value for every seed, their mean and a 95% Student-t interval
(mean +- t_{0.975, n-1} * s / sqrt(n), s the sample standard deviation; undefined for n < 2).

Verdict of a comparison "arm A is better than arm B" (better = higher or lower, per metric): the
seeds are paired (every arm runs the same seeds, which fix the warm-up and the sampling), so the
paired differences d_s = A_s - B_s (or B_s - A_s when lower is better; d > 0 favours the claim)
over the seeds where both runs produced the metric give a 95% t-interval for the mean difference:
  reproduced      the interval lies entirely above 0 (with n >= 2 pairs);
  not reproduced  it lies entirely below 0 (the data favour the opposite);
  inconclusive    it contains 0, or fewer than 2 pairs exist.
A one-arm claim "metric > threshold" uses the arm's own interval against the threshold the same way.
A claim made of several comparisons is reproduced iff all are; not reproduced iff any is; else
inconclusive. Nothing is tuned per seed: every arm runs with the same settings for every seed.

claims.json is a list of {"name", "metric", "arms": {ARM: {"values", "mean", "ci95"}}, "verdict",
"rule"}: values one per seed (null when that run did not produce the metric), ci95 [lo, hi] or
[null, null], rule the sentence above instantiated with this claim's numbers.
"""
from __future__ import annotations

import json
import math
from typing import Iterable, Optional, Sequence

VERDICTS = ("reproduced", "not reproduced", "inconclusive")
CLAIM_KEYS = ("name", "metric", "arms", "verdict", "rule")
ARM_KEYS = ("values", "mean", "ci95")


# ----------------------------------------------------------------------------------------------
# Student-t quantile (regularized incomplete beta by continued fraction, then bisection)
# ----------------------------------------------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (bisection on t_cdf to 1e-12)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"need 0 < p < 1 and df > 0, got {p}, {df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


# ----------------------------------------------------------------------------------------------
# Intervals and verdicts
# ----------------------------------------------------------------------------------------------
def _finite(values: Iterable[Optional[float]]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def mean_ci95(values: Sequence[Optional[float]]) -> tuple[Optional[float], list[Optional[float]]]:
    """(mean, [lo, hi]) of the finite values; mean None without any, interval [None, None] for n < 2."""
    xs = _finite(values)
    if not xs:
        return None, [None, None]
    n, mean = len(xs), sum(xs) / len(xs)
    if n < 2:
        return mean, [None, None]
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return mean, [mean - half, mean + half]


def arm_summary(values: Sequence[Optional[float]]) -> dict:
    """{"values", "mean", "ci95"} of one arm (values kept one per seed, None where missing)."""
    mean, ci = mean_ci95(values)
    return {"values": [None if v is None or not math.isfinite(float(v)) else float(v) for v in values],
            "mean": mean, "ci95": ci}


def _verdict_of_interval(lo: Optional[float], hi: Optional[float]) -> str:
    if lo is None or hi is None:
        return "inconclusive"
    if lo > 0:
        return "reproduced"
    if hi < 0:
        return "not reproduced"
    return "inconclusive"


def _fmt(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def compare(better: Sequence[Optional[float]], worse: Sequence[Optional[float]], higher_is_better: bool,
            names: tuple[str, str] = ("A", "B")) -> tuple[str, str]:
    """(verdict, sentence) for "arm `better` beats arm `worse`" on paired per-seed values."""
    pairs = [(a, b) for a, b in zip(better, worse) if a is not None and b is not None
             and math.isfinite(a) and math.isfinite(b)]
    d = [(a - b) if higher_is_better else (b - a) for a, b in pairs]
    mean, (lo, hi) = mean_ci95(d)
    verdict = _verdict_of_interval(lo, hi)
    sign = "-" if higher_is_better else "- (lower is better, so negated)"
    sent = (f"{names[0]} {sign} {names[1]} over {len(d)} paired seeds: mean {_fmt(mean)}, 95% t-interval "
            f"[{_fmt(lo)}, {_fmt(hi)}] -> {verdict}")
    return verdict, sent


def threshold(values: Sequence[Optional[float]], thresh: float, above: bool, name: str = "A") -> tuple[str, str]:
    """(verdict, sentence) for "the arm's metric is above (or below) `thresh`"."""
    mean, (lo, hi) = mean_ci95(values)
    if lo is None:
        verdict = "inconclusive"
    else:
        verdict = _verdict_of_interval(lo - thresh, hi - thresh) if above else \
            _verdict_of_interval(thresh - hi, thresh - lo)
    rel = ">" if above else "<"
    return verdict, (f"{name} {rel} {thresh:g}: mean {_fmt(mean)}, 95% t-interval [{_fmt(lo)}, {_fmt(hi)}] "
                     f"over {len(_finite(values))} seeds -> {verdict}")


def combine(verdicts: Sequence[str]) -> str:
    """All reproduced -> reproduced; any not reproduced -> not reproduced; else inconclusive."""
    if verdicts and all(v == "reproduced" for v in verdicts):
        return "reproduced"
    if any(v == "not reproduced" for v in verdicts):
        return "not reproduced"
    return "inconclusive"


RULE_PREFIX = ("95% paired Student-t interval of the per-seed difference (claimed direction positive); "
               "reproduced iff every comparison's interval is above 0, not reproduced iff any is below 0, "
               "else inconclusive (also with < 2 seeds). ")


# ----------------------------------------------------------------------------------------------
# Schema
# ----------------------------------------------------------------------------------------------
def validate_claims(claims) -> None:
    """Raise ValueError unless `claims` follows the claims.json schema exactly (see module doc)."""
    if not isinstance(claims, list):
        raise ValueError("claims.json must hold a list")
    for i, c in enumerate(claims):
        if not isinstance(c, dict) or tuple(sorted(c)) != tuple(sorted(CLAIM_KEYS)):
            raise ValueError(f"claim {i}: keys must be exactly {CLAIM_KEYS}, got {sorted(c) if isinstance(c, dict) else c}")
        if not isinstance(c["name"], str) or not isinstance(c["metric"], str) or not isinstance(c["rule"], str):
            raise ValueError(f"claim {i}: name, metric and rule must be strings")
        if c["verdict"] not in VERDICTS:
            raise ValueError(f"claim {i}: verdict {c['verdict']!r} not in {VERDICTS}")
        if not isinstance(c["arms"], dict) or not c["arms"]:
            raise ValueError(f"claim {i}: arms must be a non-empty object")
        for arm, a in c["arms"].items():
            if not isinstance(a, dict) or tuple(sorted(a)) != tuple(sorted(ARM_KEYS)):
                raise ValueError(f"claim {i} arm {arm}: keys must be exactly {ARM_KEYS}")
            if not isinstance(a["values"], list) or not all(v is None or isinstance(v, (int, float)) for v in a["values"]):
                raise ValueError(f"claim {i} arm {arm}: values must be a list of numbers or null")
            if not (isinstance(a["ci95"], list) and len(a["ci95"]) == 2):
                raise ValueError(f"claim {i} arm {arm}: ci95 must be [lo, hi]")
            mean, ci = mean_ci95(a["values"])
            if (mean is None) != (a["mean"] is None) or (mean is not None and abs(mean - a["mean"]) > 1e-9 * max(1, abs(mean))):
                raise ValueError(f"claim {i} arm {arm}: mean does not follow from the values")


def write_claims(claims: list, path: str) -> None:
    validate_claims(claims)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(claims, f, indent=1, allow_nan=False)
    import os

    os.replace(tmp, path)

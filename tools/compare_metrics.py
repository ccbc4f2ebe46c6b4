"""Compare two runs' metrics.jsonl for exact equality, every key at every step (timings excluded).

    python tools/compare_metrics.py RUN_A RUN_B [--ignore time/ --ignore eval/...] [--also warmup.jsonl ...]
                                    [--rel 1e-5 [--logprob-diffs] [--abs 1e-7]]

RUN_A / RUN_B: run directories (their metrics.jsonl, plus any ``--also`` files) or jsonl files.
Keys starting with an ``--ignore`` prefix (default: ``time/``, ``warmup/time``) are left out. Exit status
0 when every row has the same keys and values (NaN equals NaN), 1 otherwise; the first differences
are printed, and a summary line says how many rows and values were compared. ``--rel`` / ``--abs``:
floats count as equal within that tolerance (|a - b| <= max(rel * |b|, abs), as pytest.approx); the
largest relative difference is reported.

``--logprob-diffs``: the metrics that are (functions of) differences between two fp32 computations of
the same tokens' log-probs (``LOGPROB_DIFFS``: the policy-change KLs of the actor update, the
train-vs-rollout mismatch and the R3 replay gaps) get an absolute floor of fp32's epsilon (2^-23) x
the row's log-prob magnitude (``rollout/entropy``, the mean |log p| of the sampled tokens, floored at
1). Why: such a metric is a mean of per-token differences d = lp_a - lp_b whose true value is at or
near the rounding of lp itself (~1e-7 here), so two runs that differ only in reduction order (a
parallel layout) can differ by ~1 ulp of |lp| in it, however small the metric; a relative tolerance
on it measures rounding, not the run. The k3 KLs (exp(d) - 1 - d) and |d| have |derivative| <= 1 in d
near 0, so they inherit the same floor. Every other metric keeps the relative rule alone.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys


FP32_EPS = 2.0 ** -23
# metrics = functions of per-token differences of two fp32 log-prob computations (--logprob-diffs)
LOGPROB_DIFFS = ("actor/approx_kl*", "mismatch/kl_k3", "mismatch/logprob_abs_diff", "mismatch/train_rollout_kl",
                 "r3/*kl_k3", "r3/*logprob_abs_diff")
LOGPROB_SCALE_KEY = "rollout/entropy"


def logprob_floor(row: dict) -> float:
    """The absolute floor of a ``LOGPROB_DIFFS`` metric in ``row``: FP32_EPS x max(1, |rollout/entropy|)."""
    scale = row.get(LOGPROB_SCALE_KEY)
    scale = abs(scale) if isinstance(scale, (int, float)) and math.isfinite(scale) else 1.0
    return FP32_EPS * max(1.0, scale)


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _same(a, b, rel: float = 0.0, abs_: float = 0.0) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if (rel or abs_) and isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isfinite(b):
        return abs(a - b) <= max(rel * abs(b), abs_)
    return a == b and type(a) is type(b)


def max_rel_diff(a: list[dict], b: list[dict], ignore: tuple[str, ...]) -> tuple[float, str]:
    """(largest |a - b| / |b| over finite numeric values, where), 0 when all are equal."""
    worst, where = 0.0, ""
    for i, (ra, rb) in enumerate(zip(a, b)):
        for k in ra.keys() & rb.keys():
            x, y = ra[k], rb[k]
            if k.startswith(ignore) or not all(isinstance(v, (int, float)) for v in (x, y)):
                continue
            if math.isfinite(x) and math.isfinite(y) and x != y:
                d = abs(x - y) / max(abs(y), 1e-300)
                if d > worst:
                    worst, where = d, f"row {i} {k}"
    return worst, where


def compare(a: list[dict], b: list[dict], ignore: tuple[str, ...], rel: float = 0.0,
            abs_: float = 0.0, logprob_diffs: bool = False, floored: list | None = None) -> tuple[int, list[str]]:
    """(values compared, differences) of two lists of metric rows. ``logprob_diffs``: the
    ``LOGPROB_DIFFS`` keys also pass within ``logprob_floor`` of row B; ``floored`` collects the
    (row, key) that passed only through that floor."""
    from fnmatch import fnmatchcase

    diffs, n = [], 0
    if len(a) != len(b):
        diffs.append(f"row count {len(a)} != {len(b)}")
    for i, (ra, rb) in enumerate(zip(a, b)):
        ka = {k for k in ra if not k.startswith(ignore)}
        kb = {k for k in rb if not k.startswith(ignore)}
        if ka != kb:
            diffs.append(f"row {i}: keys only in A {sorted(ka - kb)}, only in B {sorted(kb - ka)}")
        for k in sorted(ka & kb):
            n += 1
            if _same(ra[k], rb[k], rel, abs_):
                continue
            if logprob_diffs and any(fnmatchcase(k, p) for p in LOGPROB_DIFFS) and \
                    _same(ra[k], rb[k], rel, max(abs_, logprob_floor(rb))):
                if floored is not None:
                    floored.append((i, k, abs(ra[k] - rb[k]), logprob_floor(rb)))
                continue
            diffs.append(f"row {i} (step {ra.get('step')}): {k}: {ra[k]!r} != {rb[k]!r}")
    return n, diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--ignore", action="append", default=None, help="key prefix to skip (repeatable)")
    ap.add_argument("--also", action="append", default=[], help="another jsonl file name in both run dirs")
    ap.add_argument("--rel", type=float, default=0.0, help="relative tolerance for numbers (default exact)")
    ap.add_argument("--abs", type=float, default=0.0, dest="abs_", help="absolute tolerance for numbers")
    ap.add_argument("--logprob-diffs", action="store_true",
                    help="log-prob difference metrics (LOGPROB_DIFFS) also pass within 2^-23 x the row's "
                         "rollout/entropy (see the module doc)")
    args = ap.parse_args(argv)
    ignore = tuple(args.ignore or ["time/", "warmup/time"])
    files = ["metrics.jsonl"] + args.also
    ok = True
    for name in files:
        pa = os.path.join(args.a, name) if os.path.isdir(args.a) else args.a
        pb = os.path.join(args.b, name) if os.path.isdir(args.b) else args.b
        for p in (pa, pb):
            if not os.path.exists(p):
                print(f"compare_metrics: {p} does not exist", file=sys.stderr)
                return 2
        ra, rb = _rows(pa), _rows(pb)
        floored = []
        n, diffs = compare(ra, rb, ignore, args.rel, args.abs_, args.logprob_diffs, floored)
        keys = sorted({k for r in ra for k in r if not k.startswith(ignore)})
        worst, where = max_rel_diff(ra, rb, ignore)
        tol = f", tolerance rel {args.rel:g} abs {args.abs_:g}" if args.rel or args.abs_ else ""
        if args.logprob_diffs:
            tol += ", log-prob differences: abs 2^-23 x rollout/entropy"
        print(f"{name}: {len(ra)} rows, {len(keys)} keys, {n} values compared, {len(diffs)} differences "
              f"(ignored prefixes {list(ignore)}{tol}); largest relative difference {worst:.3g} {where}".rstrip())
        for d in diffs[:20]:
            print("  " + d)
        if floored:
            print(f"  {len(floored)} log-prob difference values within the fp32 floor (largest |a - b| / floor "
                  f"{max(d / f for _, _, d, f in floored):.3g}): "
                  + ", ".join(sorted({k for _, k, _, _ in floored})))
        ok &= not diffs
        if not os.path.isdir(args.a):
            break
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

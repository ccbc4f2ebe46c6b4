"""Paired comparison of two ``s3ac-eval`` reports of the same benchmark, each written with ``--save-samples``
(e.g. a demo's checkpoint before and after RL): per prompt, the difference of its accuracy over its k samples
(B - A); the mean difference and its 95% percentile-bootstrap interval over prompts
(``eval.estimators.bootstrap_ci``: prompts resampled with replacement, each keeping its own pair). Pairing removes
the spread of prompt difficulty that two separate intervals both carry, so a change can show where the two
reports' own intervals overlap. Verdict: "B higher" / "A higher" when the interval excludes 0, else "no
difference shown".

    python tools/compare_evals.py before.json after.json [--bench NAME] [--json OUT]

The reports must hold the same prompts in the same order (the same benchmark file); anything else is refused
with the first prompt that differs, exit 2, nothing written.
"""
import argparse
import json
import sys

import numpy as np


def load_samples(path: str, bench) -> tuple[str, list]:
    with open(path) as f:
        report = json.load(f)
    benches = report.get("benchmarks") or {}
    if bench is None:
        if len(benches) != 1:
            raise ValueError(f"{path}: holds benchmarks {sorted(benches)}: name one with --bench")
        bench = next(iter(benches))
    if bench not in benches:
        raise ValueError(f"{path}: no benchmark {bench!r} (it has {sorted(benches)})")
    samples = benches[bench].get("samples")
    if not samples:
        raise ValueError(f"{path}: benchmark {bench!r} has no per-prompt samples: write it with s3ac-eval --save-samples")
    return bench, samples


def compare(a: list, b: list, seed: int = 0) -> dict:
    """a, b: the reports' ``samples`` lists ({"prompt", "reference", "correct": [k]}) -> the paired summary."""
    from megatron_s3ac.eval.estimators import bootstrap_ci

    if len(a) != len(b):
        raise ValueError(f"the reports hold {len(a)} and {len(b)} prompts")
    for i, (x, y) in enumerate(zip(a, b)):
        if (x["prompt"], x["reference"]) != (y["prompt"], y["reference"]):
            raise ValueError(f"prompt {i} differs: {x['prompt']!r} -> {x['reference']!r} vs "
                             f"{y['prompt']!r} -> {y['reference']!r}")
    acc_a = np.array([np.mean(x["correct"]) for x in a], dtype=np.float64)
    acc_b = np.array([np.mean(y["correct"]) for y in b], dtype=np.float64)
    d = acc_b - acc_a
    lo, hi = bootstrap_ci(d, seed=seed)
    verdict = "B higher" if lo > 0 else "A higher" if hi < 0 else "no difference shown"
    return {"prompts": len(d), "k_a": len(a[0]["correct"]) if a else 0, "k_b": len(b[0]["correct"]) if b else 0,
            "a": float(acc_a.mean()), "b": float(acc_b.mean()), "diff": float(d.mean()), "diff_ci95": [lo, hi],
            "prompts_b_better": int((d > 0).sum()), "prompts_a_better": int((d < 0).sum()), "verdict": verdict}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="s3ac-eval report (--save-samples), e.g. before RL")
    ap.add_argument("b", help="s3ac-eval report of the same benchmark, e.g. after RL")
    ap.add_argument("--bench", help="benchmark name (default: the reports' only one)")
    ap.add_argument("--json", help="also write the summary here")
    args = ap.parse_args(argv)
    try:
        name, a = load_samples(args.a, args.bench)
        _, b = load_samples(args.b, name)
        res = {"bench": name, **compare(a, b)}
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"compare_evals: {e}", file=sys.stderr)
        return 2
    lo, hi = res["diff_ci95"]
    print(f"{name}: {res['prompts']} prompts, avg@{res['k_a']} A {100 * res['a']:.1f}% -> avg@{res['k_b']} B "
          f"{100 * res['b']:.1f}%; paired difference {100 * res['diff']:+.1f} points, 95% bootstrap interval "
          f"[{100 * lo:+.1f}, {100 * hi:+.1f}]; prompts better in B {res['prompts_b_better']}, in A "
          f"{res['prompts_a_better']}: {res['verdict']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

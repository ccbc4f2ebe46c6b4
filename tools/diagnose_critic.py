"""Why a critic does or does not learn: the figures of one pipeline run dir (train.out_dir).

    python tools/diagnose_critic.py runs/cpu_demo_chain [--windows 10]

Prints JSON: the coverage data's pass rate per policy (stages/coverage/coverage_log.jsonl), value
pretraining's loss and explained variance over its first / last 10 steps (stages/value_pretrain/
value_pretrain.jsonl), the online critic's explained variance and value loss per window of RL steps
(metrics.jsonl), and V(s0) against each prompt's empirical pass rate (credit.jsonl, train.credit_every;
megatron_s3ac.eval.credit.v0_calibration), first and last window. Reads files only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_s3ac.eval.credit import read_credit, v0_calibration  # noqa: E402


def _jsonl(path: str) -> list[dict]:
    return read_credit(path) if os.path.exists(path) else []  # tolerant JSON-lines reader


def _mean(rows: list[dict], key: str):
    v = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
    return round(sum(v) / len(v), 4) if v else None


def diagnose(run: str, window: int = 10) -> dict:
    st = os.path.join(run, "stages")
    cov = _jsonl(os.path.join(st, "coverage", "coverage_log.jsonl"))
    n = sum(c["trajectories"] for c in cov)
    out = {"coverage": {"policies": [{"source": os.path.basename(c["source"]), "pass_rate": round(c["pass_rate"], 4),
                                      "trajectories": c["trajectories"]} for c in cov],
                        "pass_rate": round(sum(c["pass_rate"] * c["trajectories"] for c in cov) / n, 4) if n else None}}
    vpt = _jsonl(os.path.join(st, "value_pretrain", "value_pretrain.jsonl"))
    out["value_pretrain"] = {"steps": len(vpt), **{f"{k}_{w}": _mean(part, f"vpt/{k}")
                                                   for k in ("value_loss", "explained_variance")
                                                   for w, part in (("first10", vpt[:10]), ("last10", vpt[-10:]))}}
    m = [r for r in _jsonl(os.path.join(run, "metrics.jsonl")) if "critic/explained_variance" in r]
    out["rl"] = [{"steps": f"{m[i]['step']}-{m[min(i + window, len(m)) - 1]['step']}",
                  "ev": _mean(m[i:i + window], "critic/explained_variance"),
                  "value_loss_tok": _mean(m[i:i + window], "critic/value_loss_tok"),
                  "pass_rate": _mean(m[i:i + window], "rollout/pass_rate")} for i in range(0, len(m), window)]
    credit = _jsonl(os.path.join(run, "credit.jsonl"))
    if credit:
        last = max(r["step"] for r in credit) + 1
        out["v0_vs_pass_rate"] = {name: {k: (round(v, 4) if isinstance(v, float) else v)
                                         for k, v in v0_calibration(credit, rng).items()}
                                  for name, rng in (("first", (0, window)), ("last", (last - window, last)))}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", help="a pipeline run dir (train.out_dir)")
    p.add_argument("--window", type=int, default=10, help="RL steps per window")
    a = p.parse_args(argv)
    if not os.path.isdir(a.run):
        print(f"diagnose_critic: {a.run} is not a directory", file=sys.stderr)
        return 2
    print(json.dumps(diagnose(a.run, a.window), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

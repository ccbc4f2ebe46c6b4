"""Presenting an evaluate() report: a text table, flat metrics for loggers, and a JSON file."""
from __future__ import annotations

import json
import math
import os
from typing import Any


def _finite(x: Any) -> Any:
    """NaN / inf -> None, recursively: strict JSON has no NaN (an empty benchmark has no score)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_report(report: dict, path: str) -> None:
    """Write the report as strict JSON (NaN written as null), atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_finite(report), f, indent=2, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def flat_metrics(report: dict, prefix: str = "eval") -> dict[str, float]:
    """{"eval/<name>/avg@<k>": ..., "eval/<name>/pass@<k>": ..., "eval/average": ...} for loggers."""
    out = {}
    for name, b in report["benchmarks"].items():
        k = b["k"]
        out[f"{prefix}/{name}/avg@{k}"] = b["avg_at_k"]
        out[f"{prefix}/{name}/pass@{k}"] = b["pass_at_k"]
        out[f"{prefix}/{name}/verifier_timeouts"] = float(b["verifier_timeouts"])
        if b.get("judge_calls"):  # LLM judge: replies that carried no verdict (scored incorrect)
            out[f"{prefix}/{name}/judge_unparsable"] = float(b["judge_unparsable"])
    out[f"{prefix}/average"] = report["average_avg_at_k"]
    return out


def format_table(report: dict) -> str:
    """A fixed-width table: one row per benchmark, percentages with their 95% intervals."""
    def pct(x):
        return "  n/a" if x is None or not math.isfinite(x) else f"{100 * x:5.1f}"

    def ci(pair):
        return f"[{pct(pair[0])}, {pct(pair[1])}]"

    header = f"{'benchmark':<20} {'k':>3} {'avg@k':>6} {'95% CI':>16} {'pass@k':>7} {'95% CI':>16} {'prompts':>8} {'skipped':>8} {'timeouts':>9}"
    lines = [header, "-" * len(header)]
    for name, b in report["benchmarks"].items():
        lines.append(f"{name[:20]:<20} {b['k']:>3} {pct(b['avg_at_k']):>6} {ci(b['avg_at_k_ci95']):>16} "
                     f"{pct(b['pass_at_k']):>7} {ci(b['pass_at_k_ci95']):>16} {b['num_prompts']:>8} "
                     f"{b['num_skipped']:>8} {b['verifier_timeouts']:>9}")
    lines.append("-" * len(header))
    lines.append(f"{'average avg@k':<24} {pct(report['average_avg_at_k']):>6}")
    return "\n".join(lines)

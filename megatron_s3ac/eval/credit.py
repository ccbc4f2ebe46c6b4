"""Credit assignment by response position (paper Figure 2b) from a run's ``credit.jsonl``
(trainer/step/credit_record.py: per RL step, every trajectory's per-token advantages, reward and V(s0)).

Each step's prompts are split at the step's median difficulty estimate into easy (above) and hard
(at or below): the critic's V(s0) where the run has a critic (S3AC), else (or with ``by="group"``) the
prompt group's mean reward (GRPO-X's own baseline, the Monte Carlo estimate of V(s0) at K > 1; note that
it is computed from the very rewards it splits, so at K = 8 a correct response on a "hard" prompt is one
of few correct ones and gets a large GRPO advantage by construction). Each response's tokens are binned by
progress t / T into ``bins`` equal bins; a cell's value is the mean advantage over the tokens in it
(each response weighted by its tokens in the bin), split by correct (reward > 0) / incorrect.
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Iterable, Optional

GROUPS = (("easy", True), ("easy", False), ("hard", True), ("hard", False))  # (difficulty, correct)


def read_credit(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for ln in f:
            ln = ln.strip()
            if ln:
                try:
                    rows.append(json.loads(ln))
                except json.JSONDecodeError:
                    pass  # a line cut by a kill
    return rows


def _difficulty(row: dict, by: str) -> tuple[list[float], str]:
    """Per trajectory: the prompt's difficulty estimate (higher = easier) and what it is."""
    if by == "v0" and row.get("v0") is not None:
        return row["v0"], "V(s0)"
    sums, counts = defaultdict(float), defaultdict(int)
    for p, r in zip(row["pid"], row["reward"]):
        sums[p] += r
        counts[p] += 1
    return [sums[p] / counts[p] for p in row["pid"]], "group mean reward"


def _median(v: list[float]) -> float:
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def credit_curves(rows: Iterable[dict], bins: int = 10, steps: Optional[tuple[int, int]] = None,
                  by: str = "v0") -> dict:
    """by: "v0" (V(s0) where recorded, else the group mean reward) or "group" (the group mean reward).
    {"estimate": what split easy / hard, "curves": {"easy/correct": [bins] or None per bin, ...},
    "tokens": {group: token count}, "responses": {group: count}, "mean": {group: mean advantage over all
    its tokens}} over the rows whose step is in [steps[0], steps[1]) (all without ``steps``)."""
    sums = {g: [0.0] * bins for g in GROUPS}
    cnt = {g: [0] * bins for g in GROUPS}
    nresp = {g: 0 for g in GROUPS}
    what = None
    for row in rows:
        if steps is not None and not steps[0] <= row["step"] < steps[1]:
            continue
        diff, what = _difficulty(row, by)
        # the median over prompts (one value per prompt), so easy and hard hold as many prompts
        per_prompt = {p: d for p, d in zip(row["pid"], diff)}
        med = _median(list(per_prompt.values()))
        for i, adv in enumerate(row["adv"]):
            g = ("easy" if diff[i] > med else "hard", row["reward"][i] > 0)
            nresp[g] += 1
            n = len(adv)
            for t, a in enumerate(adv):
                b = min(bins - 1, t * bins // n)
                sums[g][b] += a
                cnt[g][b] += 1
    key = {g: f"{g[0]}/{'correct' if g[1] else 'incorrect'}" for g in GROUPS}
    return {"estimate": what,
            "curves": {key[g]: [s / c if c else None for s, c in zip(sums[g], cnt[g])] for g in GROUPS},
            "tokens": {key[g]: sum(cnt[g]) for g in GROUPS},
            "responses": {key[g]: nresp[g] for g in GROUPS},
            "mean": {key[g]: (sum(sums[g]) / sum(cnt[g]) if sum(cnt[g]) else None) for g in GROUPS}}


def plot_credit(panels: dict[str, dict], path: str, title: str = "") -> None:
    """One panel per run label (e.g. S3AC, GRPO-X) of credit_curves outputs, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False, sharey=True)
    style = {"easy/correct": ("C0", "-"), "easy/incorrect": ("C0", "--"), "hard/correct": ("C3", "-"),
             "hard/incorrect": ("C3", "--")}
    for ax, (label, c) in zip(axes[0], panels.items()):
        for g, curve in c["curves"].items():
            xs = [(b + 0.5) / len(curve) for b, v in enumerate(curve) if v is not None]
            ys = [v for v in curve if v is not None]
            if ys:
                col, ls = style[g]
                ax.plot(xs, ys, color=col, ls=ls, marker="o", ms=3,
                        label=f"{g} (n={c['responses'][g]})")
        ax.axhline(0.0, color="gray", lw=0.6)
        ax.set_title(f"{label}: easy / hard by {c['estimate']}", fontsize=9)
        ax.set_xlabel("response progress t / T", fontsize=8)
        ax.legend(fontsize=7)
    axes[0, 0].set_ylabel("mean advantage", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _pearson(x: list[float], y: list[float]) -> Optional[float]:
    n = len(x)
    if n < 2:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else None


def v0_calibration(rows: Iterable[dict], steps: Optional[tuple[int, int]] = None) -> dict:
    """How well the critic's V(s0) tracks each prompt's empirical pass rate (its group of K responses):
    per prompt p_c = (V(s0) + 1) / 2 (paper eq. 4) vs the group's fraction of correct responses.
    {"prompts": n, "corr": Pearson r pooled over (step, prompt) pairs (None if undefined),
    "corr_per_step_mean": mean of the per-step r, "v0_std": std of V(s0) over prompts,
    "pass_pred_mean" / "pass_emp_mean": mean predicted / empirical pass rate}; rows without V(s0) skipped."""
    pred, emp, per_step = [], [], []
    for row in rows:
        if row.get("v0") is None or (steps is not None and not steps[0] <= row["step"] < steps[1]):
            continue
        v0, ok = {}, defaultdict(list)
        for p, v, r in zip(row["pid"], row["v0"], row["reward"]):
            v0[p] = v
            ok[p].append(1.0 if r > 0 else 0.0)
        ps = sorted(v0)
        x = [(v0[p] + 1) / 2 for p in ps]
        y = [sum(ok[p]) / len(ok[p]) for p in ps]
        pred += x
        emp += y
        r = _pearson(x, y)
        if r is not None:
            per_step.append(r)
    n = len(pred)
    mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
    std = (sum((2 * a - 1 - (2 * mean(pred) - 1)) ** 2 for a in pred) / n) ** 0.5 if n else None
    return {"prompts": n, "corr": _pearson(pred, emp), "corr_per_step_mean": mean(per_step), "v0_std": std,
            "pass_pred_mean": mean(pred), "pass_emp_mean": mean(emp)}

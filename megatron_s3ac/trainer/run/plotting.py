"""Paper-style training curves (PNG) from a run directory's metrics.jsonl / value_pretrain.jsonl."""
from __future__ import annotations

import json
import math
import os
import re

EVAL_KEY = re.compile(r"^eval/(.+)/(avg@\d+|greedy)$")

PANELS = [  # (title, metric keys, file); an entry of None = the per-benchmark keys found in the run
    ("reward / accuracy", ["rollout/pass_rate"], "reward.png"),
    ("held-out evaluation (per benchmark)", None, "eval.png"),
    ("rollout entropy (nats/token)", ["rollout/entropy"], "entropy.png"),
    ("response length (tokens)", ["rollout/response_len"], "response_length.png"),
    ("value loss", ["critic/value_loss_tok"], "value_loss.png"),
    ("explained variance", ["critic/explained_variance"], "explained_variance.png"),
    ("trajectories discarded by the group filter", ["filter/discarded_trajectories"], "discarded.png"),
    # training-inference mismatch (nonzero with rollout.weights_dtype=fp8; docs/fp8.md)
    ("train/rollout mismatch", ["mismatch/train_rollout_kl", "mismatch/kl_k3", "mismatch/logprob_abs_diff",
                                "r3/native_logprob_abs_diff"], "mismatch.png"),
    ("masked by corrections (IcePoP: tokens, MIS: responses)", ["mismatch/icepop_masked_frac",
                                                                "mismatch/mis_masked_frac"], "masked.png"),
    ("R3 routing agreement (native vs replayed)", ["r3/agreement"], "routing_agreement.png"),
    # asynchronous rollout (train.max_staleness; trainer.step.async_loop)
    ("async: staleness of trained tokens (weight versions)", ["async/staleness_mean", "async/staleness_max"],
     "async_staleness.png"),
    ("async: engine busy fraction / trainer wait (s)", ["time/engine_busy_frac", "time/trainer_wait"],
     "async_engine.png"),
    ("async: end-to-end trained tokens / s", ["time/tokens_per_s"], "async_throughput.png"),
    # partial rollout (rollout.partial_rollout; trainer.step.async_partial): per sync, and versions per trained response
    ("partial rollout: responses resumed / regenerated at the sync; versions per response",
     ["async/partial_resumes", "async/partial_regenerated", "async/versions_per_response_max"],
     "async_partial.png"),
]


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def eval_keys(rows: list[dict]) -> list[str]:
    """Per-benchmark evaluation curves of a run: eval/<set>/avg@k and eval/<set>/greedy, then eval/average."""
    keys = sorted({k for r in rows for k in r if EVAL_KEY.match(k)})
    return keys + (["eval/average"] if len({EVAL_KEY.match(k)[1] for k in keys}) > 1 else [])


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Write one PNG per panel (and a combined curves.png); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _read(os.path.join(run_dir, "metrics.jsonl"))
    vpt = _read(os.path.join(run_dir, "value_pretrain.jsonl"))
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    fig_all, axes = plt.subplots(4, 4, figsize=(21, 13))  # one cell per panel (zip would drop extras)
    panels = PANELS + [("value pretraining loss", ["vpt/value_loss"], "vpt_loss.png"),
                       ("value pretraining explained variance", ["vpt/explained_variance"], "vpt_ev.png")]
    for ax_all, (title, keys, fname) in zip(axes.ravel(), panels):
        src = vpt if fname.startswith("vpt") else rows
        keys = eval_keys(rows) if keys is None else keys
        fig, ax = plt.subplots(figsize=(5, 3.5))
        any_data = False
        for a in (ax, ax_all):
            for k in keys:
                pts = [(r["step"], r[k]) for r in src if k in r and r[k] is not None and math.isfinite(r[k])]
                if pts:
                    any_data = True
                    a.plot(*zip(*pts), label=k, marker="." if len(pts) < 50 else None,
                           linestyle="--" if k.endswith("/greedy") else "-")
            a.set_title(title)
            a.set_xlabel("value-pretraining step" if fname.startswith("vpt") else "rollout step")
            if any_data:
                a.legend(fontsize=7)
        fig.tight_layout()
        if any_data:
            path = os.path.join(out_dir, fname)
            fig.savefig(path, dpi=90)
            written.append(path)
        plt.close(fig)
    fig_all.tight_layout()
    path = os.path.join(out_dir, "curves.png")
    fig_all.savefig(path, dpi=80)
    plt.close(fig_all)
    return [path] + written

"""Reproduce the S3AC paper's claims in miniature, with several seeds per arm and honest statistics.

    python tools/reproduce_claims.py --seeds 1 2 3 --out runs/claims            # the full report
    python tools/reproduce_claims.py --quick --out runs/claims_quick              # CI-sized smoke
    python tools/reproduce_claims.py --task multistep --max-operands 5 --out ...  # a variant task

Every arm of every claim is one CPU-demo run per seed (``torchrun -m megatron_s3ac.trainer.cli demo
CONFIG overrides``: supervised warm-up -> coverage data -> value pretraining -> RL), run as a
subprocess; runs shared by several claims (e.g. the default S3AC arm) run once. A run directory
holding demo_result.json is complete and reused (the driver resumes). The metric of each claim is
read from the run's metrics.jsonl / value_pretrain.jsonl / demo_result.json; statistics, verdict
rule and the claims.json schema are in megatron_s3ac/eval/claims.py. An arm whose settings the
trainer does not have yet (a config key it rejects) is not run: its claim is "inconclusive" and the
rule says why. Writes OUT/claims.json, OUT/report.md and OUT/plots/*.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_s3ac.eval.claims import RULE_PREFIX, arm_summary, combine, compare, threshold, write_claims  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO, "examples", "cpu_demo.yaml")


# ----------------------------------------------------------------------------------------------
# Reading a run
# ----------------------------------------------------------------------------------------------
def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut by a kill: ignored
    return rows


def series(run_dir: str, key: str, file: str = "metrics.jsonl") -> list[float]:
    """The finite values of `key` in step order from a run's jsonl file."""
    rows = sorted((r for r in read_jsonl(os.path.join(run_dir, file)) if key in r), key=lambda r: r.get("step", 0))
    return [float(r[key]) for r in rows if r[key] is not None and math.isfinite(float(r[key]))]


def first_mean(key: str, n: int, file: str = "metrics.jsonl") -> Callable[[str], Optional[float]]:
    def f(run_dir):
        v = series(run_dir, key, file)[:n]
        return sum(v) / len(v) if v else None
    return f


def mean_over_run(key: str) -> Callable[[str], Optional[float]]:
    def f(run_dir):
        v = series(run_dir, key)
        return sum(v) / len(v) if v else None
    return f


def drop_from_peak(key: str) -> Callable[[str], Optional[float]]:
    """max over the run minus the last value (0: the run ends at its best)."""
    def f(run_dir):
        v = series(run_dir, key)
        return max(v) - v[-1] if v else None
    return f


def result(*path: str) -> Callable[[str], Optional[float]]:
    """A number from demo_result.json, e.g. result("after", "sampled")."""
    def f(run_dir):
        p = os.path.join(run_dir, "demo_result.json")
        if not os.path.exists(p):
            return None
        x = json.load(open(p))
        for k in path:
            if not isinstance(x, dict) or k not in x:
                return None
            x = x[k]
        return float(x) if isinstance(x, (int, float)) and math.isfinite(float(x)) else None
    return f


# ----------------------------------------------------------------------------------------------
# Arms and claims
# ----------------------------------------------------------------------------------------------
def arms(quick: bool) -> dict[str, list[str]]:
    """Arm name -> overrides on top of the base config (the same for every seed)."""
    k1 = ["rollout.k=1", f"rollout.prompts_per_step={256 if quick else 1024}"]  # same trajectories per step
    longer = [f"train.steps={16 if quick else 200}"]  # stability needs a longer run (paper Fig. 4)
    return {
        "s3ac": [],
        "no_value_pretraining": ["value_pretrain.enabled=false"],
        "on_policy_value_pretraining": ["demo.coverage_checkpoints=1"],  # only the RL start policy's samples
        "head_init_0.01": ["model.value_head_init_std=0.01"],
        "value_pretrain_clip_1": ["value_pretrain.clip_grad=1.0"],
        "grpo_x": ["algo.name=grpo_x"],
        "k1_s3ac": k1 + longer,
        "k1_reinforce_pp": k1 + longer + ["algo.name=reinforce_pp"],
        "k1_flash_reinforce": k1 + longer + ["algo.name=flash_reinforce"],
        "uniform_sampling": ["daps.enabled=false"],
        "fixed_lambda_0.95": ["algo.actor_lambda=0.95"],
    }


@dataclasses.dataclass
class Claim:
    name: str
    metric: str  # what is measured, in words
    fn: Callable[[str], Optional[float]]
    arms: dict[str, str]  # arm -> label in the report
    higher_is_better: bool
    comparisons: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (claimed better, worse)
    above: Optional[tuple[str, float]] = None  # one-arm claim: (arm, threshold the metric exceeds)
    curve: Optional[tuple[str, str]] = None  # (file, key) plotted over steps
    paper: str = ""


def claims(n_first: int) -> list[Claim]:
    ev, vl = "critic/explained_variance", "critic/value_loss_tok"
    return [
        Claim("value_pretraining_explained_variance",
              f"critic explained variance, mean over the first {n_first} RL steps",
              first_mean(ev, n_first), {"s3ac": "coverage data", "no_value_pretraining": "none",
                                        "on_policy_value_pretraining": "on-policy data"}, True,
              [("s3ac", "no_value_pretraining"), ("s3ac", "on_policy_value_pretraining")],
              curve=("metrics.jsonl", ev), paper="Fig. 5: coverage critic has higher EV early in RL"),
        Claim("value_pretraining_value_loss", f"critic value loss per token, mean over the first {n_first} RL steps",
              first_mean(vl, n_first), {"s3ac": "coverage data", "no_value_pretraining": "none",
                                        "on_policy_value_pretraining": "on-policy data"}, False,
              [("s3ac", "no_value_pretraining"), ("s3ac", "on_policy_value_pretraining")],
              curve=("metrics.jsonl", vl), paper="Fig. 5: coverage critic has lower value loss early in RL"),
        Claim("value_head_init", "value-pretraining loss, mean over the first 20 critic steps",
              result("vpt/loss_first"), {"s3ac": "std 1/(H+1)", "head_init_0.01": "std 0.01"}, False,
              [("s3ac", "head_init_0.01")], curve=("value_pretrain.jsonl", "vpt/value_loss"),
              paper="Table 4: 1/(H+1) lowers early value loss (0.72 -> 0.45)"),
        Claim("critic_grad_clip", "fraction of value-pretraining steps whose grad norm exceeds the clip",
              result("vpt/clip_frac"), {"s3ac": "clip 10", "value_pretrain_clip_1": "clip 1"}, False,
              [("s3ac", "value_pretrain_clip_1")], curve=("value_pretrain.jsonl", "vpt/grad_norm"),
              paper="Table 4: clip 10 vs 1 cuts clipped steps (99.7% -> 12.5%)"),
        Claim("value_head_gradient_share", "value head's share of the squared critic gradient norm, first 10 "
              "value-pretraining steps", first_mean("vpt/head_sq_share", 10, "value_pretrain.jsonl"),
              {"s3ac": "recipe"}, True, above=("s3ac", 0.5), curve=("value_pretrain.jsonl", "vpt/head_sq_share"),
              paper="§4.3: the head holds > 99% of the squared gradient norm in the first 10 updates"),
        Claim("s3ac_vs_grpo_x", "held-out sampled pass rate after RL (avg@k)", result("after", "sampled"),
              {"s3ac": "S3AC", "grpo_x": "GRPO-X"}, True, [("s3ac", "grpo_x")],
              curve=("metrics.jsonl", "eval/average"), paper="Tables 2-3: S3AC > GRPO-X at K > 1"),
        Claim("single_rollout_stability", "drop of the held-out score from its peak to the end of a longer K=1 run",
              drop_from_peak("eval/average"), {"k1_s3ac": "S3AC", "k1_reinforce_pp": "REINFORCE++",
                                               "k1_flash_reinforce": "FlashREINFORCE"}, False,
              [("k1_s3ac", "k1_reinforce_pp"), ("k1_s3ac", "k1_flash_reinforce")],
              curve=("metrics.jsonl", "eval/average"), paper="Fig. 4: critic-free K=1 baselines decline, S3AC holds"),
        Claim("daps_discarded_trajectories", "trajectories discarded by the group filter per step (mean)",
              mean_over_run("filter/discarded_trajectories"), {"s3ac": "DAPS", "uniform_sampling": "uniform"},
              False, [("s3ac", "uniform_sampling")], curve=("metrics.jsonl", "filter/discarded_trajectories"),
              paper="Fig. 6a: DAPS discards fewer trajectories"),
        Claim("daps_final_score", "held-out sampled pass rate after RL (avg@k)", result("after", "sampled"),
              {"s3ac": "DAPS", "uniform_sampling": "uniform"}, True, [("s3ac", "uniform_sampling")],
              curve=("metrics.jsonl", "eval/average"), paper="Table 5: DAPS improves the best score"),
        Claim("length_adaptive_lambda", "held-out sampled pass rate after RL (avg@k)", result("after", "sampled"),
              {"s3ac": "lambda = 1 - 1/(alpha T)", "fixed_lambda_0.95": "lambda = 0.95"}, True,
              [("s3ac", "fixed_lambda_0.95")], curve=("metrics.jsonl", "eval/average"),
              paper="§3.1 / VAPO: length-adaptive actor lambda"),
    ]


QUICK_CLAIMS = ("value_pretraining_explained_variance", "critic_grad_clip", "value_head_gradient_share",
                "s3ac_vs_grpo_x")


def base_overrides(args) -> list[str]:
    """Settings shared by every arm: size (quick / --steps) and the task variant."""
    o = []
    if args.quick:
        o += ["train.steps=8", "train.eval_every=2", "rollout.prompts_per_step=32", "data.eval_prompts=100",
              "demo.warmup_eval_every=50", "demo.warmup_max_steps=400", "demo.coverage_prompts=128", "eval.k=2"]
    if args.steps is not None:
        o.append(f"train.steps={args.steps}")
    if args.max_operand is not None:
        o.append(f"data.max_operand={args.max_operand}")
    if args.task == "multistep":
        from megatron_s3ac.trainer.tasks_multistep import MultistepSpec

        spec = MultistepSpec(min_operands=args.min_operands, max_operands=args.max_operands,
                             max_operand=args.max_operand or 99, ops=args.ops)
        o += ["data.task=multistep", "rollout.reward=multistep", f"data.min_operands={spec.min_operands}",
              f"data.max_operands={spec.max_operands}", f"data.ops={spec.ops}",
              f"rollout.max_new_tokens={spec.max_response_tokens()}"]
    return o + list(args.override)


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------
def check_arm(config: str, overrides: list[str]) -> Optional[str]:
    """None when the trainer accepts the overrides, else its error (e.g. a knob it does not have)."""
    from megatron_s3ac.trainer.config import ConfigError, load_config

    try:
        load_config(config, overrides)
    except ConfigError as e:
        return str(e).replace("\n", " ")
    return None


def run_arm(config: str, overrides: list[str], run_dir: str, nproc: int, timeout_s: float) -> tuple[bool, float]:
    """One demo run (skipped when run_dir holds demo_result.json); (ok, seconds)."""
    if os.path.exists(os.path.join(run_dir, "demo_result.json")):
        return True, 0.0
    os.makedirs(run_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megatron_s3ac.trainer.cli", "demo", config, *overrides, f"train.out_dir={run_dir}",
           "train.progress=false", "train.tensorboard=false"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    t0 = time.time()
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = -1
            log.write(f"\nreproduce_claims: killed after {timeout_s:.0f} s\n")
    return rc == 0 and os.path.exists(os.path.join(run_dir, "demo_result.json")), time.time() - t0


def evaluate_claim(c: Claim, values: dict[str, list[Optional[float]]], missing: dict[str, str]) -> dict:
    """The claims.json entry of one claim from its arms' per-seed values."""
    entry = {"name": c.name, "metric": c.metric, "arms": {a: arm_summary(values[a]) for a in c.arms}}
    not_run = {a: missing[a] for a in c.arms if a in missing}
    if not_run:
        entry["verdict"] = "inconclusive"
        entry["rule"] = "not run: the trainer lacks settings for " + "; ".join(
            f"arm {a} ({e})" for a, e in not_run.items())
        return entry
    verdicts, sentences = [], []
    for better, worse in c.comparisons:
        v, s = compare(values[better], values[worse], c.higher_is_better, (better, worse))
        verdicts.append(v)
        sentences.append(s)
    if c.above is not None:
        arm, thr = c.above
        v, s = threshold(values[arm], thr, above=True, name=arm)
        verdicts.append(v)
        sentences.append(s)
    entry["verdict"] = combine(verdicts)
    entry["rule"] = RULE_PREFIX + ("higher" if c.higher_is_better else "lower") + " is better. " + "; ".join(sentences)
    return entry


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------
def plot_claim(c: Claim, entry: dict, run_dirs: dict[str, list[str]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if c.curve else 1, figsize=(11 if c.curve else 5.5, 3.6), squeeze=False)
    ax = axes[0, 0]
    for i, (arm, label) in enumerate(c.arms.items()):
        a = entry["arms"][arm]
        vals = [v for v in a["values"] if v is not None]
        ax.scatter([i] * len(vals), vals, color="gray", s=14, zorder=3)
        if a["mean"] is not None:
            lo, hi = a["ci95"]
            err = None if lo is None else [[a["mean"] - lo], [hi - a["mean"]]]
            ax.errorbar([i], [a["mean"]], yerr=err, fmt="o", color=f"C{i}", capsize=5, zorder=4)
    ax.set_xticks(range(len(c.arms)), list(c.arms.values()), fontsize=8)
    ax.set_xlim(-0.5, len(c.arms) - 0.5)
    ax.set_title(f"{c.name}: {entry['verdict']}", fontsize=9)
    ax.set_ylabel(c.metric[:60], fontsize=7)
    if c.curve:
        file, key = c.curve
        ax = axes[0, 1]
        for i, (arm, label) in enumerate(c.arms.items()):
            curves = [series(d, key, file) for d in run_dirs.get(arm, [])]
            curves = [cv for cv in curves if cv]
            if not curves:
                continue
            n = min(len(cv) for cv in curves)
            mean = [sum(cv[j] for cv in curves) / len(curves) for j in range(n)]
            for cv in curves:
                ax.plot(range(len(cv)), cv, color=f"C{i}", alpha=0.25, lw=0.8)
            ax.plot(range(n), mean, color=f"C{i}", label=label)
        ax.set_xlabel("logged step (per-seed thin, mean thick)", fontsize=8)
        ax.set_title(key, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: str, entries: list[dict], claims_by_name: dict[str, Claim], cmdline: str, seeds: list[int],
                 run_dirs: dict, failures: list[str], wall_s: float) -> str:
    def fmt(a):
        if a["mean"] is None:
            return "n/a"
        lo, hi = a["ci95"]
        ci = "" if lo is None else f" [{lo:.3g}, {hi:.3g}]"
        return f"{a['mean']:.3g}{ci} (n={sum(v is not None for v in a['values'])})"

    lines = ["# S3AC claims in miniature", "", f"Command: `{cmdline}`", "",
             f"Seeds: {seeds}; wall time {wall_s / 60:.1f} min. Intervals: 95% Student-t over seeds. "
             "Verdict rule: megatron_s3ac/eval/claims.py (paired differences; the rule column of claims.json "
             "gives each claim's numbers).", "",
             "| claim | paper | metric | arms: mean [95% CI] (n) | verdict |", "|---|---|---|---|---|"]
    for e in entries:
        c = claims_by_name[e["name"]]
        arms_s = "<br>".join(f"{c.arms[a]}: {fmt(s)}" for a, s in e["arms"].items())
        lines.append(f"| {e['name']} | {c.paper} | {e['metric']} | {arms_s} | **{e['verdict']}** |")
    lines += ["", "## Rules with numbers", ""] + [f"- **{e['name']}**: {e['rule']}" for e in entries]
    if failures:
        lines += ["", "## Runs that failed (their values are null)", ""] + [f"- {f}" for f in failures]
    lines += ["", "## Plots", ""] + [f"![{e['name']}](plots/{e['name']}.png)" for e in entries]
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="train.seed of each run (default 1 2 3; quick 1 2)")
    p.add_argument("--out", required=True, help="output directory (runs/, claims.json, report.md, plots/)")
    p.add_argument("--quick", action="store_true", help="CI-sized smoke: short runs, claims " + ", ".join(QUICK_CLAIMS))
    p.add_argument("--claims", nargs="+", default=None, help="only these claims (names in claims.json)")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (train.steps)")
    p.add_argument("--task", choices=("arithmetic", "multistep"), default="arithmetic")
    p.add_argument("--max-operand", type=int, default=None)
    p.add_argument("--min-operands", type=int, default=3, help="multistep: fewest operands per prompt")
    p.add_argument("--max-operands", type=int, default=5, help="multistep: most operands per prompt")
    p.add_argument("--ops", default="+", help="multistep: operators drawn ('+' or '+-')")
    p.add_argument("--override", nargs="*", default=[], help="extra key=value for every run")
    p.add_argument("--nproc", type=int, default=2, help="torchrun ranks per run")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds before a run is killed")
    p.add_argument("--dry-run", action="store_true", help="print the runs and exit")
    args = p.parse_args(argv)
    if args.seeds is None:
        args.seeds = [1, 2] if args.quick else [1, 2, 3]
    if len(set(args.seeds)) != len(args.seeds):
        p.error("--seeds must be distinct")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    out = os.path.abspath(args.out)
    os.makedirs(os.path.join(out, "plots"), exist_ok=True)
    all_claims = claims(n_first=4 if args.quick else 10)
    names = args.claims or (list(QUICK_CLAIMS) if args.quick else [c.name for c in all_claims])
    unknown = set(names) - {c.name for c in all_claims}
    if unknown:
        print(f"reproduce_claims: unknown claims {sorted(unknown)}", file=sys.stderr)
        return 2
    chosen = [c for c in all_claims if c.name in names]
    arm_over = arms(args.quick)
    base = base_overrides(args)
    needed = list(dict.fromkeys(a for c in chosen for a in c.arms))
    missing = {}
    for a in needed:
        err = check_arm(args.config, base + arm_over[a])
        if err is not None:
            missing[a] = err
            print(f"arm {a}: not run ({err})", file=sys.stderr)
    runs = [(a, s) for a in needed if a not in missing for s in args.seeds]
    if args.dry_run:
        for a, s in runs:
            print(a, s, " ".join(base + arm_over[a] + [f"train.seed={s}"]))
        return 0
    values = {a: [None] * len(args.seeds) for a in needed}
    run_dirs, failures = {a: [] for a in needed}, []
    by_name = {c.name: c for c in all_claims}
    for i, (a, s) in enumerate(runs):
        d = os.path.join(out, "runs", a, f"seed{s}")
        ok, secs = run_arm(args.config, base + arm_over[a] + [f"train.seed={s}"], d, args.nproc, args.run_timeout)
        print(f"[{i + 1}/{len(runs)}] {a} seed {s}: {'ok' if ok else 'FAILED'} ({secs:.0f} s)", flush=True)
        run_dirs[a].append(d)
        if not ok:
            failures.append(f"{a} seed {s}: see {os.path.join(d, 'log.txt')}")
    entries = []
    for c in chosen:
        vals = {a: [c.fn(os.path.join(out, "runs", a, f"seed{s}")) if a not in missing else None for s in args.seeds]
                for a in c.arms}
        entries.append(evaluate_claim(c, vals, missing))
    write_claims(entries, os.path.join(out, "claims.json"))
    for e in entries:
        plot_claim(by_name[e["name"]], e, run_dirs, os.path.join(out, "plots", f"{e['name']}.png"))
    cmdline = "python tools/reproduce_claims.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rep = write_report(out, entries, by_name, cmdline, args.seeds, run_dirs, failures, time.time() - t0)
    for e in entries:
        print(f"{e['name']:40s} {e['verdict']}")
    print(f"claims: {os.path.join(out, 'claims.json')}  report: {rep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The CPU demo under the asynchronous loop: does it still learn, and what do the corrections remove?

    python tools/async_demo.py --out runs/async_demo [--steps 100] [--s2-steps 100] [--jobs 1] [--arms ...]
    python tools/async_demo.py --out runs/async_demo --table-only      # the table of finished arms

Every arm is one ``s3ac-train demo examples/cpu_demo.yaml`` job (torchrun, 2 gloo ranks) with
``rollout.placement=separate`` (the engine in its own Ray actor process: the asynchronous loop needs it) and
``train.eval_every=0``; the arms share one warm-up, coverage data and value pretraining through the pipeline's
stage directories (``pipeline.<stage>_dir=OUT/stages/<stage>``; none of those stages depends on the RL keys the arms
change), so every arm starts RL from the same actor and critic:

  sync        train.max_staleness=0                                  (the synchronous loop, separate engine)
  async1      train.max_staleness=1                                  (one-step off-policy)
  s2_corr_on  train.max_staleness=2 algo.mismatch_corrections=true   (token IS with algo.tis_cap, IcePoP, MIS)
  s2_corr_off train.max_staleness=2 algo.mismatch_corrections=false  (the same ratios measured, not applied)

The first arm runs alone (it produces the shared stages), the others ``--jobs`` at a time. The table: held-out
pass rate before -> after (greedy T=0 on 200 prompts, sampled T=1 avg@4), each "after" with its 95% Wilson interval
(greedy: 200 binomial draws; sampled: 800 draws, correlated by prompt, so the interval is a lower bound on the
noise), and the mean over the RL steps of the staleness and mismatch metrics (log pi_prox / mu: what IS, IcePoP and
MIS act on) and the actor's approx KL.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "examples", "cpu_demo.yaml")
ARMS = {
    "sync": ["train.max_staleness=0"],
    "async1": ["train.max_staleness=1"],
    "s2_corr_on": ["train.max_staleness=2", "algo.mismatch_corrections=true"],
    "s2_corr_off": ["train.max_staleness=2", "algo.mismatch_corrections=false"],
}
MEANS = ("async/staleness_mean", "async/staleness_max", "mismatch/train_rollout_kl", "mismatch/logprob_abs_diff",
         "mismatch/is_weight_mean", "mismatch/keep_frac", "mismatch/icepop_masked_frac", "mismatch/mis_masked_frac",
         "actor/approx_kl", "actor/clip_frac")


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion p over n draws."""
    if n <= 0:
        return (float("nan"), float("nan"))
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)


def command(arm: str, out: str, steps: int, extra: list[str]) -> list[str]:
    stages = [f"pipeline.{s}_dir={os.path.join(out, 'stages', s)}" for s in ("warmup", "coverage", "value_pretrain")]
    return ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
             str(29600 + list(ARMS).index(arm)), "-m", "megatron_s3ac.trainer.cli", "demo", CONFIG,
             "rollout.placement=separate", "train.eval_every=0", "train.progress=false", f"train.steps={steps}",
             f"train.out_dir={os.path.join(out, arm)}"] + stages + ARMS[arm] + extra)


def launch(arm: str, out: str, steps: int, extra: list[str]) -> subprocess.Popen:
    os.makedirs(os.path.join(out, arm), exist_ok=True)
    log = open(os.path.join(out, f"{arm}.log"), "w")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = command(arm, out, steps, extra)
    log.write(" ".join(cmd) + "\n")
    log.flush()
    print(f"async_demo: {arm}: {' '.join(cmd[3:])}", flush=True)
    return subprocess.Popen(["nice", "-n", "10"] + cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def arm_row(out: str, arm: str) -> dict | None:
    """The arm's pass rates (demo_result.json) and the means of its RL metrics (metrics.jsonl); None if unfinished."""
    res_p, met_p = os.path.join(out, arm, "demo_result.json"), os.path.join(out, arm, "metrics.jsonl")
    if not os.path.exists(res_p):
        return None
    with open(res_p) as f:
        res = json.load(f)
    with open(met_p) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    means = {}
    for k in MEANS:
        v = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
        if v:
            means[k] = sum(v) / len(v)
    return {"arm": arm, "before": res["before"], "after": res["after"], "rl_s": res.get("rl_s"),
            "steps": len(rows), "means": means}


def table(out: str, arms: list[str]) -> str:
    lines = ["| arm | RL steps | greedy before -> after [95% CI] | sampled avg@4 before -> after [95% CI] | "
             "staleness mean / max | train-rollout KL | abs log-ratio | IS weight mean | keep frac | actor approx KL "
             "| RL s |", "|" + "---|" * 11]
    for arm in arms:
        r = arm_row(out, arm)
        if r is None:
            lines.append(f"| {arm} | (not finished) |" + " |" * 9)
            continue
        b, a, m = r["before"], r["after"], r["means"]
        g, s = wilson(a["greedy"], 200), wilson(a["sampled"], 800)
        f = lambda k, fmt="{:.4f}": fmt.format(m[k]) if k in m else "-"  # noqa: E731
        lines.append(
            f"| {arm} | {r['steps']} | {100 * b['greedy']:.1f}% -> {100 * a['greedy']:.1f}% [{100 * g[0]:.1f}, "
            f"{100 * g[1]:.1f}] | {100 * b['sampled']:.1f}% -> {100 * a['sampled']:.1f}% [{100 * s[0]:.1f}, "
            f"{100 * s[1]:.1f}] | {f('async/staleness_mean', '{:.2f}')} / {f('async/staleness_max', '{:.0f}')} | "
            f"{f('mismatch/train_rollout_kl')} | {f('mismatch/logprob_abs_diff')} | {f('mismatch/is_weight_mean')} | "
            f"{f('mismatch/keep_frac')} | {f('actor/approx_kl', '{:.5f}')} | {r['rl_s'] or 0:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "runs", "async_demo"))
    p.add_argument("--steps", type=int, default=100, help="RL steps of sync / async1 (the demo's budget)")
    p.add_argument("--s2-steps", type=int, default=100, help="RL steps of the staleness-2 arms")
    p.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--jobs", type=int, default=1, help="arms at a time after the first")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides for every arm")
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    if not args.table_only:
        todo = [a for a in args.arms if arm_row(out, a) is None]
        steps = lambda a: args.s2_steps if a.startswith("s2") else args.steps  # noqa: E731
        failed = []
        first = todo[:1]
        rest = todo[1:]
        t0 = time.time()
        for batch in ([first] + [rest[i:i + args.jobs] for i in range(0, len(rest), max(1, args.jobs))]):
            procs = {a: launch(a, out, steps(a), args.set) for a in batch}
            for a, pr in procs.items():
                rc = pr.wait()
                print(f"async_demo: {a} exit {rc} after {time.time() - t0:.0f} s", flush=True)
                if rc:
                    failed.append(a)
        if failed:
            print(f"async_demo: failed arms {failed}: see {out}/<arm>.log", file=sys.stderr)
    print(table(out, args.arms))
    return 0 if all(arm_row(out, a) is not None for a in args.arms) else 1


if __name__ == "__main__":
    sys.exit(main())

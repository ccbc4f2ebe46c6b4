"""BPCO's sanity test (critic notes sec. 4): RL on prompts the warm-up policy already solves at least sometimes.

    python tools/sanity_test.py CONFIG [--out DIR] [--steps N] [--arms s3ac s3ac_answer ...] [--override k=v ...]

On such prompts every arm should drive the training reward near its maximum; an arm that does not fails the test
(in the notes: a critic whose errors steer the actor wrong). Steps:

1. ``s3ac-train pipeline CONFIG pipeline.stop_after=coverage``: the warm-up and its coverage pass (OUT/base).
2. The prompts with at least ``--min-successes`` correct samples of the RL start policy in the coverage data (the
   warm-up's snapshot at its stopping step; every policy's samples when the data has none of it) -> OUT/solvable.json
   (``data.prompt_subset``: the RL stage draws only these).
3. One pipeline job per arm, sharing the warm-up and coverage stages (value pretraining per critic arm), RL on the
   solvable prompts for ``--steps`` steps:
     s3ac             the recipe
     s3ac_answer      the critic sees the reference answer (model.critic_privileged=answer; its value
                      pretraining trains attention, the privileged critic's default)
     critic_baseline  advantage normalization on, unbounded (linear) value head
     grpo_x           critic-free
4. Per arm the training pass rate (``rollout/pass_rate``, before the group filter) and the critic's explained
   variance by step, printed and plotted (OUT/sanity.png), and OUT/sanity.json. An arm passes when its mean pass
   rate over the last quarter of the run reaches ``--target`` (default 0.9).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {
    "s3ac": [],
    "s3ac_answer": ["model.critic_privileged=answer"],
    "critic_baseline": ["algo.normalize_advantages=true", "model.critic_head=linear"],
    "grpo_x": ["algo.name=grpo_x"],
}
REWARD, EV = "rollout/pass_rate", "critic/explained_variance"


def vpt_of(arm: str) -> str:
    """The value-pretraining stage an arm uses: arms whose critic sees the same input share one."""
    return "value_pretrain_answer" if "model.critic_privileged=answer" in ARMS[arm] else "value_pretrain"


def pipeline_cmd(config: str, overrides: list[str], nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "megatron_s3ac.trainer.cli", "pipeline", config, *overrides,
            "train.progress=false", "train.tensorboard=false"]


def run(cmd: list[str], out: str, dry: bool) -> None:
    """One job, its output in OUT/log.txt; a failure exits naming the log."""
    print(" ".join(cmd), flush=True)
    if dry:
        return
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    t0 = time.time()
    with open(os.path.join(out, "log.txt"), "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if rc != 0:
        sys.exit(f"sanity_test: job failed (exit {rc}); see {os.path.join(out, 'log.txt')}")
    print(f"  done in {time.time() - t0:.0f} s", flush=True)


def rl_start_source(warmup_dir: str) -> str | None:
    """The coverage ``source`` suffix of the RL start policy: the warm-up's snapshot at the step it stopped
    (``policies/step_<steps>``; the coverage snapshots past it are stronger than the policy RL starts from)."""
    try:
        steps = json.load(open(os.path.join(warmup_dir, "DONE.json")))["result"]["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return os.path.join("policies", f"step_{int(steps)}")


def solvable_prompts(coverage: str, min_successes: int, source: str | None = None) -> tuple[list, int, str]:
    """(prompt id lists with >= ``min_successes`` correct samples in the coverage file, prompts seen, which
    samples counted): the samples of the policy whose ``source`` ends with ``source`` when it has any, else all."""
    from megatron_s3ac.data.prompts import read_coverage

    rows, _ = read_coverage(coverage)
    mine = [r for r in rows if source and str(r.get("source", "")).rstrip("/").endswith(source)]
    used = f"the RL start policy's samples ({source})" if mine else "every coverage policy's samples"
    rows = mine or rows
    wins: dict[tuple, int] = {}
    for r in rows:
        key = tuple(r["prompt_ids"])
        wins[key] = wins.get(key, 0) + int(r["reward"] > 0)
    return [list(k) for k, n in wins.items() if n >= min_successes], len(wins), used


def curves(run_dir: str) -> dict:
    """{key: [(step, value)]} of the pass rate and EV in a run's metrics.jsonl."""
    out = {REWARD: [], EV: []}
    path = os.path.join(run_dir, "metrics.jsonl")
    for line in open(path) if os.path.exists(path) else []:
        row = json.loads(line)
        for k in out:
            if isinstance(row.get(k), (int, float)):
                out[k].append((row.get("step", len(out[k])), float(row[k])))
    return out


def verdict(c: dict, target: float) -> dict:
    r = [v for _, v in c[REWARD]]
    tail = r[-max(1, len(r) // 4):] if r else []
    ev = [v for _, v in c[EV]]
    final = sum(tail) / len(tail) if tail else None
    return {"final_pass_rate": final, "mean_ev": sum(ev) / len(ev) if ev else None,
            "passes": final is not None and final >= target}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for arm, res in results.items():
        for ax, key in zip(axes, (REWARD, EV)):
            if res["curves"][key]:
                xs, ys = zip(*res["curves"][key])
                ax.plot(xs, ys, label=arm)
    for ax, title in zip(axes, ("training pass rate (before the group filter)", "critic explained variance")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("RL step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config")
    p.add_argument("--out", default="runs/sanity")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--min-successes", type=int, default=1)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--override", nargs="*", default=[], help="key=value for every job")
    p.add_argument("--dry-run", action="store_true", help="print the jobs and exit")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    base_dir = os.path.join(out, "base")
    stages = [f"pipeline.warmup_dir={base_dir}/stages/warmup", f"pipeline.coverage_dir={base_dir}/stages/coverage"]
    layout = ["actor_layout.tp=1", "actor_layout.pp=1", "actor_layout.ep=1"] if args.nproc == 1 else []
    common = layout + list(args.override)
    run(pipeline_cmd(args.config, common + stages + ["pipeline.stop_after=coverage", f"train.out_dir={base_dir}"],
                     args.nproc), base_dir, args.dry_run)
    subset = os.path.join(out, "solvable.json")
    if not args.dry_run:
        keep, seen, used = solvable_prompts(os.path.join(base_dir, "stages", "coverage", "coverage.jsonl"),
                                            args.min_successes, rl_start_source(os.path.join(base_dir, "stages",
                                                                                             "warmup")))
        if not keep:
            sys.exit(f"sanity_test: no prompt of the {seen} in the coverage data has {args.min_successes} correct "
                     f"sample(s): the warm-up policy solves none; the test needs a stronger start")
        with open(subset, "w") as f:
            json.dump({"prompt_ids": keep}, f)
        print(f"solvable prompts: {len(keep)} of {seen} (>= {args.min_successes} correct among {used})")
    results = {}
    for arm in args.arms:
        d = os.path.join(out, "arms", arm)
        run(pipeline_cmd(args.config, common + stages + ARMS[arm] + [
            f"pipeline.value_pretrain_dir={out}/stages/{vpt_of(arm)}", f"data.prompt_subset={subset}",
            f"train.steps={args.steps}", f"train.out_dir={d}"], args.nproc), d, args.dry_run)
        if not args.dry_run:
            results[arm] = {"curves": curves(d), **verdict(curves(d), args.target)}
    if args.dry_run:
        return 0
    print(f"\n{'arm':18s} {'pass rate (last 1/4)':>22s} {'mean EV':>9s}  verdict (target {args.target:g})")
    for arm, r in results.items():
        fr = "n/a" if r["final_pass_rate"] is None else f"{r['final_pass_rate']:.3f}"
        ev = "n/a" if r["mean_ev"] is None else f"{r['mean_ev']:.3f}"
        print(f"{arm:18s} {fr:>22s} {ev:>9s}  {'pass' if r['passes'] else 'FAILS the sanity test'}")
        pr = r["curves"][REWARD]
        print("    pass rate by step: " + " ".join(f"{v:.2f}" for _, v in pr[::max(1, len(pr) // 10)]))
        evs = r["curves"][EV]
        if evs:
            print("    EV by step:        " + " ".join(f"{v:.2f}" for _, v in evs[::max(1, len(evs) // 10)]))
    with open(os.path.join(out, "sanity.json"), "w") as f:
        json.dump({"config": args.config, "target": args.target, "arms": results}, f, indent=1)
    plot(results, os.path.join(out, "sanity.png"))
    print(f"\nwrote {out}/sanity.json, {out}/sanity.png")
    return 0 if all(r["passes"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

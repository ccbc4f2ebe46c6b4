"""Measure the tiny demo model's supervised warm-up on a task (the pipeline's warm-up stage alone).

    python tools/measure_warmup.py --out runs/warmup/cumsum12 -- data.task=chain rollout.reward=chain \
        data.chain=cumsum data.min_len=12 data.max_len=16 rollout.max_new_tokens=17

Runs ``s3ac-train pipeline CONFIG <overrides> pipeline.stop_after=warmup`` on one rank (tp = pp = ep = 1),
killed after ``--timeout`` seconds, and prints the warm-up curve (greedy held-out pass rate per evaluation
point, with wall seconds), the band reached (below / in / above 10-60%), the wall time and the load
average, as one JSON line (also OUT/summary.json).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAND = (0.1, 0.6)


def band(rate) -> str:
    if rate is None:
        return "none"
    return "below" if rate < BAND[0] else ("above" if rate > BAND[1] else "in")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--config", default=os.path.join(REPO, "examples", "cpu_demo.yaml"))
    p.add_argument("--timeout", type=float, default=None, help="kill the warm-up after this many seconds")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m",
           "megatron_s3ac.trainer.cli", "pipeline", args.config, "actor_layout.tp=1", "actor_layout.pp=1",
           "actor_layout.ep=1", *args.overrides, "pipeline.stop_after=warmup", f"train.out_dir={out}",
           f"pipeline.warmup_dir={os.path.join(out, 'warmup')}", "train.progress=false", "train.tensorboard=false"]
    t0 = time.time()
    with open(os.path.join(out, "log.txt"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:  # the curve so far is the measurement: "timeout" in the summary
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    wall = time.time() - t0
    rows = []
    path = os.path.join(out, "warmup", "warmup.jsonl")
    if os.path.exists(path):
        rows = [json.loads(ln) for ln in open(path) if ln.strip()]
    curve = [(r["step"], round(r["warmup/greedy_pass_rate"], 4), round(r["warmup/time"], 1))
             for r in rows if "warmup/greedy_pass_rate" in r]
    last = curve[-1][1] if curve else None
    summary = {"overrides": args.overrides, "rc": rc, "wall_s": round(wall, 1), "curve": curve,
               "final_pass_rate": last, "band": band(last), "load": os.getloadavg()}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0 if rc in (0, "timeout") else int(rc)


if __name__ == "__main__":
    sys.exit(main())

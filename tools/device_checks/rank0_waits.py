"""Device check (issue 24, finding 4): the other ranks survive rank 0's slow engine start, rollout and evaluation
under a short NCCL timeout. <= 3 min.

    torchrun --nproc-per-node 2 tools/device_checks/rank0_waits.py [--pg-timeout 30] [--slow 45]
        # 2 GPUs: the default process group is NCCL with --pg-timeout s (NCCL's watchdog aborts a rank that waits
        # longer inside one collective); the trainer on the demo's tiny model, rollout.engine=hf on rank 0's GPU
    torchrun --nproc-per-node 2 tools/device_checks/rank0_waits.py --stand-in
        # CPU dry run of the same script: gloo (which honours the same timeout), the CPU engine

Rank 0's real engine is made --slow s late to start and --slow s slower per ``generate``
(``megatron_s3ac.audit.pg_timeout.slow_rank0_engine``), then ``train_loop`` runs one RL step with a periodic
evaluation: three rank-0-only phases, each longer than the process group's timeout. With the fix the other ranks
wait them out on the trainer's gloo group (``trainer.step.rank0``, deadline ``train.dist_timeout_s``); before it they
waited inside NCCL collectives and the watchdog aborted them (the CPU test: tests/gpu_readiness/
test_finding_4_rank0_phase_timeout.py). One JSON line per rank (survived, steps, seconds); exit 0 when every
rank finished.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pg-timeout", type=float, default=None, help="default group timeout, s (30; stand-in: 4)")
    ap.add_argument("--slow", type=float, default=None, help="each rank-0 phase's extra seconds (45; stand-in: 6.5)")
    ap.add_argument("--stand-in", action="store_true", help="CPU dry run: gloo and the CPU engine")
    a = ap.parse_args(argv)

    from megatron_s3ac.console import silence_known_warnings

    silence_known_warnings()
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not a.stand_in
    pg_timeout = a.pg_timeout if a.pg_timeout is not None else (30.0 if cuda else 4.0)
    slow = a.slow if a.slow is not None else (45.0 if cuda else 6.5)
    if slow <= pg_timeout:
        ap.error(f"--slow {slow:g} must exceed --pg-timeout {pg_timeout:g} (else nothing is shown)")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        os.environ["S3AC_FORCE_CPU"] = "1"
    from megatron_s3ac.models import cpu_compat

    cpu_compat.enable()
    # created here, before the Trainer (whose init_distributed keeps an existing group): the short timeout stands
    # for a long phase against the default 10 min
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=pg_timeout))
    rank = dist.get_rank()
    from megatron_s3ac.audit.pg_timeout import slow_rank0_engine
    from megatron_s3ac.trainer.step import build
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer
    from megatron_s3ac.trainer.run.train_loop import train_loop

    out = tempfile.mkdtemp(prefix=f"rank0_waits_{rank}_")
    cfg = load_config(None, [
        "model.tiny=arithmetic_moe", f"rollout.engine={'hf' if cuda else 'cpu'}", "rollout.prompts_per_step=4",
        "rollout.k=2", "rollout.max_new_tokens=3", "data.num_prompts=64", "data.eval_prompts=8",
        "algo.actor_minibatches=2", "algo.critic_minibatches=2", "algo.critic_epochs=1", "algo.dynamic_sampling=false",
        "daps.warmup_steps=0", "daps.rampup_steps=1", "eval.greedy=false", "train.steps=1", "train.eval_every=1",
        "train.save_every=0", "train.progress=false", "train.tensorboard=false", f"train.out_dir={out}"])
    t0 = time.monotonic()
    row = {"check": "rank0_waits", "rank": rank, "backend": str(dist.get_backend()), "pg_timeout_s": pg_timeout,
           "slow_s": slow}
    try:
        with slow_rank0_engine(build, slow, slow) as events:
            tr = Trainer(cfg)
            row["built_s"] = round(time.monotonic() - t0, 1)
            train_loop(tr)
            tr.close()
        row.update(survived=True, steps=tr.step_idx, seconds=round(time.monotonic() - t0, 1),
                   slowed=[(k, round(s, 1)) for k, s in events])
    except Exception as e:  # noqa: BLE001 - reported as the check's result
        row.update(survived=False, error=f"{type(e).__name__}: {e}"[:2000], seconds=round(time.monotonic() - t0, 1))
    row["pass"] = bool(row["survived"]) and row.get("steps") == 1
    print(json.dumps(row), flush=True)
    return 0 if row["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

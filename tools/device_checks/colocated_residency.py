"""Device check (issue 24, findings 6 and 9): what a colocated step keeps on the GPU, phase by phase, whether the
memory an offload frees reaches the driver before the engine wakes, and what the offload pins on the host. <= 3 min.

    python tools/device_checks/colocated_residency.py [--steps 2] [--out DIR]
        # 1 GPU: the tiny demo trainer (model.tiny, the colocated hf engine in this process, train.offload_idle)
    python tools/device_checks/colocated_residency.py --stand-in
        # CPU dry run of the same script (gloo, the CPU engine): the residency figures; the CUDA checks are skipped

The trainer runs ``--steps`` steps under the residency audit (megatron_s3ac.audit.residency.ResidencyAudit).
Checks, one JSON line each (the last step's phases):

1. residency: at every phase the bytes each model keeps (params, grads, optimizer) equal the planner's
   (plan.memory.residency; the optimizer at most its padded share).
2. driver (CUDA): at the engine's wake, torch's caching allocator holds at most 64 MiB it does not use
   (memory_reserved - memory_allocated): the offloaded memory went back to the driver (torch.cuda.empty_cache).
3. pinned (CUDA): the host memory torch pinned (host_memory_stats()["allocated_bytes.current"]) is at most the
   offloaders' arenas (one per model, a power of two each: plan.memory.pinned_bytes) plus 64 MiB.
Figures per phase: resident GiB per model, allocated / reserved GiB, driver free GiB. Exit 0 when every check passes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

CFG = ["model.tiny=arithmetic_moe", "rollout.prompts_per_step=4", "rollout.k=2", "rollout.max_new_tokens=8",
       "data.num_prompts=40", "data.eval_prompts=4", "algo.actor_minibatches=1", "algo.critic_minibatches=1",
       "algo.critic_epochs=1", "train.progress=false", "train.tensorboard=false", "train.eval_every=0",
       "algo.dynamic_sampling=false", "daps.enabled=false", "train.offload_idle=true"]
MIB = 1 << 20


def planned(tr) -> dict:
    from megatron_s3ac.plan.memory import Cluster, Workload, estimate
    from megatron_s3ac.plan.preflight import trainer_knobs
    from megatron_s3ac.config import layout_of

    knobs = trainer_knobs(tr.cfg)
    knobs.critic = tr.critic_ddp is not None
    lay = layout_of(tr.cfg.actor_layout)
    w = Workload(prompt_len=64, response_len=tr.cfg.rollout.max_new_tokens,
                 prompts_per_step=tr.cfg.rollout.prompts_per_step, k=tr.cfg.rollout.k)
    return estimate(tr.info, lay, Cluster(gpus=1), w, knobs, lay).stages[0].resident


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--stand-in", action="store_true", help="CPU dry run (gloo, the CPU engine)")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.stand_in
    if not cuda and not a.stand_in:
        print(json.dumps({"check": "device", "ok": False, "error": "no CUDA GPU (use --stand-in for a CPU dry run)"}))
        return 1
    from megatron_s3ac.models.gloo_ranks import free_port, init_single_process
    from megatron_s3ac.audit.residency import ResidencyAudit
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer

    init_single_process("nccl" if cuda else "gloo", free_port())
    out = a.out or tempfile.mkdtemp(prefix="colocated_residency_")
    tr = Trainer(load_config(None, CFG + [f"rollout.engine={'hf' if cuda else 'cpu'}", f"train.out_dir={out}"]))
    audit = ResidencyAudit(tr)
    mem = []  # (phase, allocated, reserved, driver free) at each audited phase

    class MemLog(list):
        def append(self, entry):  # the CUDA allocator's and the driver's figures beside each snapshot
            if cuda:
                free, _ = torch.cuda.mem_get_info()
                mem.append((entry[0], torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), free))
            super().append(entry)

    audit.log = MemLog()
    n = 0
    for _ in range(a.steps):
        n = len(audit.log)
        tr.step()
    last = audit.log[n:]
    plan = planned(tr)
    ok_all, bad = True, []
    for phase, snap in last:
        if phase not in plan:
            continue
        for model in ("actor", "critic"):
            g, p = snap[model], plan[phase][model]
            if (g["params"], g["grads"]) != (p["params"], p["grads"]) or g["optimizer"] > p["optimizer"]:
                bad.append({"phase": phase, "model": model, "measured": g, "planned": p})
    print(json.dumps({"check": "residency", "ok": not bad, "mismatches": bad,
                      "phases": {ph: {m: round(sum(k.values()) / 2**30, 6) for m, k in s.items()} for ph, s in last}}))
    ok_all &= not bad
    if cuda:
        wake = [m for m in mem[-len(last):] if m[0] == "engine_wake"]
        slack = [r - al for _, al, r, _ in wake]
        ok = bool(wake) and max(slack) <= 64 * MIB
        print(json.dumps({"check": "driver", "ok": ok, "cached_unused_mib_at_wake": [s / MIB for s in slack],
                          "phases": [{"phase": p, "allocated_gib": al / 2**30, "reserved_gib": r / 2**30,
                                      "driver_free_gib": f / 2**30} for p, al, r, f in mem[-len(last):]]}))
        ok_all &= ok
        stats = torch.cuda.host_memory_stats()
        key = next((k for k in ("allocated_bytes.all.current", "allocated_bytes.current") if k in stats), None)
        pinned = stats.get(key, 0)
        arenas = sum(h.host_bytes for h in getattr(tr, "_offloaders", {}).values())
        ok = key is not None and pinned <= arenas + 64 * MIB and all(
            h.host_bytes & (h.host_bytes - 1) == 0 for h in tr._offloaders.values())
        print(json.dumps({"check": "pinned", "ok": ok, "pinned_bytes": pinned, "arena_bytes": arenas,
                          "stat": key or sorted(stats)[:20]}))
        ok_all &= ok
    tr.close()
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())

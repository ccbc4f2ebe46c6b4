"""Atomic checkpoints: actor, critic, optimizers (megatron dist_checkpointing), DAPS state, data
order, RNG, step.

Layout: ``<out>/checkpoints/step_000010/{actor,critic}/`` (torch_dist), ``{actor,critic}_optim/rank{r}.pt`` +
``trainer_state.pt`` (rank 0) + ``rng_rank{r}.pt`` + ``COMPLETE``. Written into ``step_000010.tmp``
and renamed only after every rank finished, so a kill during the save leaves the previous checkpoint
as the latest one; stale ``.tmp`` dirs are removed on the next save. The last ``keep_last`` are kept,
plus the best one by periodic evaluation (``checkpoints/BEST`` names it).
"""
from __future__ import annotations

import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

_STEP_RE = re.compile(r"^step_(\d+)$")


def _ckpt_root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def latest_checkpoint(out_dir: str) -> str | None:
    root = _ckpt_root(out_dir)
    if not os.path.isdir(root):
        return None
    done = [(int(m[1]), d) for d in os.listdir(root) if (m := _STEP_RE.match(d))
            and os.path.exists(os.path.join(root, d, "COMPLETE"))]
    return os.path.join(root, max(done)[1]) if done else None


def _models(tr):
    out = [("actor", tr.actor, tr.actor_opt)]
    if tr.critic is not None:
        out.append(("critic", tr.critic, tr.critic_opt))
    return out


def _inner(opt) -> list:
    """The torch optimizers under megatron's (chained, distributed) optimizer: their state is this
    rank's shard of Adam's moments. Saved per rank because megatron 0.16's
    DistributedOptimizer.sharded_state_dict asserts one common Adam 'step' across params on the
    TE/Apex-free path, which does not hold here (see docs/trainer.md): the optimizer state resumes at
    the same world size and layout only; model weights are layout-free (torch_dist)."""
    return [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]


def best_step(tr) -> int | None:
    """Step of the best periodic evaluation so far (rank 0's evaluator), or None."""
    ev = getattr(tr, "evaluator", None)
    return None if ev is None else ev.best_step


def _write_best_marker(root: str, step: int) -> None:
    """``checkpoints/BEST`` names the best evaluated checkpoint (written atomically)."""
    tmp = os.path.join(root, "BEST.tmp")
    with open(tmp, "w") as f:
        f.write(f"step_{step:06d}\n")
    os.replace(tmp, os.path.join(root, "BEST"))


def save_checkpoint(tr, keep_last: int) -> str:
    from megatron.core import dist_checkpointing

    root = _ckpt_root(tr.cfg.train.out_dir)
    name = f"step_{tr.step_idx:06d}"
    tmp, final = os.path.join(root, name + ".tmp"), os.path.join(root, name)
    if tr.rank == 0:
        os.makedirs(root, exist_ok=True)
        for d in os.listdir(root):
            if d.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)
        for sub in ("actor", "critic", "actor_optim", "critic_optim"):
            os.makedirs(os.path.join(tmp, sub), exist_ok=True)
    dist.barrier()
    for name_, model, opt in _models(tr):
        msd = model.sharded_state_dict()
        dist_checkpointing.save(msd, os.path.join(tmp, name_))
        torch.save([o.state_dict() for o in _inner(opt)], os.path.join(tmp, f"{name_}_optim", f"rank{tr.rank}.pt"))
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
               os.path.join(tmp, f"rng_rank{tr.rank}.pt"))
    if tr.rank == 0:
        torch.save({"step": tr.step_idx, "skipped_steps": tr.skipped_steps, "stream": tr.stream.state_dict(),
                    "daps": tr.daps.state_dict() if tr.daps is not None else None,
                    "evaluator": tr.evaluator.state_dict() if getattr(tr, "evaluator", None) is not None else None},
                   os.path.join(tmp, "trainer_state.pt"))
    dist.barrier()
    if tr.rank == 0:
        open(os.path.join(tmp, "COMPLETE"), "w").close()
        os.replace(tmp, final)  # atomic on one filesystem
        done = sorted(int(m[1]) for d in os.listdir(root) if (m := _STEP_RE.match(d)))
        best = best_step(tr)
        for s in done[:-keep_last]:
            if s != best:  # the best evaluated checkpoint survives the rotation
                shutil.rmtree(os.path.join(root, f"step_{s:06d}"), ignore_errors=True)
        if best is not None:
            _write_best_marker(root, best)
    dist.barrier()
    return final


def load_checkpoint(tr, path: str) -> None:
    from megatron.core import dist_checkpointing

    for name_, model, opt in _models(tr):
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), os.path.join(path, name_)))
        states = torch.load(os.path.join(path, f"{name_}_optim", f"rank{tr.rank}.pt"), weights_only=False)
        for o, sd in zip(_inner(opt), states):
            o.load_state_dict(sd)
    st = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    tr.step_idx, tr.skipped_steps = int(st["step"]), int(st["skipped_steps"])
    tr.stream.load_state_dict(st["stream"])
    if tr.daps is not None and st["daps"] is not None:
        tr.daps.load_state_dict(st["daps"])
    if getattr(tr, "evaluator", None) is not None and st.get("evaluator") is not None:
        tr.evaluator.load_state_dict(st["evaluator"])
    rng = torch.load(os.path.join(path, f"rng_rank{tr.rank}.pt"), weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    tr.sync_weights()

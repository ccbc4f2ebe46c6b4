"""Atomic checkpoints: actor, critic, optimizers (megatron dist_checkpointing), DAPS state, data
order, RNG, step.

Layout: ``<out>/checkpoints/step_000010/{actor,critic}/`` (torch_dist), ``{actor,critic}_optim/rank{r}.pt`` +
``trainer_state.pt`` (rank 0) + ``rng_rank{r}.pt`` + ``COMPLETE``. Written into ``step_000010.tmp``
(created fresh and empty), every rank fsyncs the files it wrote, then rank 0 fsyncs the directories,
writes ``COMPLETE`` and renames the dir to ``step_000010`` (then fsyncs ``checkpoints/``): a kill at any
point of the save leaves the previous checkpoint as the latest one, and a ``step_N`` dir is always
complete. Stale ``*.tmp`` entries (a killed save, an interrupted deletion) are moved aside and removed
at the start of the next save, before the barrier that lets any rank write. The last ``keep_last`` are
kept, plus the best one by periodic evaluation (``checkpoints/BEST`` names it; it is updated before the
rotation, and a rotated dir is first renamed out of the ``step_N`` namespace, then deleted).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from megatron_s3ac.testing import faults

_STEP_RE = re.compile(r"^step_(\d+)$")
# the rank that wrote a file: ``rank{r}.pt``, ``rng_rank{r}.pt``, torch_dist's ``__{r}_{i}.distcp``;
# anything else (common.pt, metadata.json, .metadata, trainer_state.pt, COMPLETE) is rank 0's
_OWNER_RE = re.compile(r"(?:^__|rank)(\d+)[_.]")
_TRASH = ".trash-"
_trash_ids = itertools.count()


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


def _scope(tr, name: str):
    """The model's parallel state (``Trainer.model_scope``: actor and critic may use different layouts)."""
    scope = getattr(tr, "model_scope", None)
    return scope(name) if scope is not None else contextlib.nullcontext()


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


# ---- durability helpers ----------------------------------------------------------------------------
def _fsync_path(path: str, directory: bool = False) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    except OSError:  # e.g. a filesystem that cannot fsync directories: best effort
        pass
    finally:
        os.close(fd)


def _fsync_own_files(tmp: str, rank: int) -> None:
    """fsync every file under ``tmp`` that this rank wrote (see ``_OWNER_RE``) so that ``COMPLETE``
    never lands on disk before the data (torch.save does not fsync; a second fsync is cheap)."""
    for dirpath, _, files in os.walk(tmp):
        for f in files:
            m = _OWNER_RE.search(f)
            if (int(m[1]) if m else 0) == rank:
                _fsync_path(os.path.join(dirpath, f))


def _fsync_dirs(tmp: str) -> None:
    for dirpath, _, _ in os.walk(tmp, topdown=False):
        _fsync_path(dirpath, directory=True)


def _discard(path: str) -> None:
    """Delete a dir or file atomically from the namespace's point of view: rename it to
    ``<name>.trash-<pid>-<n>.tmp`` first (never ``step_N``, so never "latest", and nothing that still
    writes into the old path can reach a new dir of the same name), then delete; a kill in between
    leaves a ``.tmp`` entry that the next save removes."""
    base = os.path.basename(path)
    trash = path
    if _TRASH not in base:
        stem = base[:-4] if base.endswith(".tmp") else base
        trash = os.path.join(os.path.dirname(path), f"{stem}{_TRASH}{os.getpid()}-{next(_trash_ids)}.tmp")
        try:
            os.replace(path, trash)
        except OSError:
            trash = path  # could not rename: delete in place
    if os.path.isdir(trash) and not os.path.islink(trash):
        shutil.rmtree(trash, ignore_errors=True)
    else:
        try:
            os.remove(trash)
        except OSError:
            pass


def _write_best_marker(root: str, step: int) -> None:
    """``checkpoints/BEST`` names the best evaluated checkpoint (written atomically and durably)."""
    tmp = os.path.join(root, "BEST.tmp")
    with open(tmp, "w") as f:
        f.write(f"step_{step:06d}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, "BEST"))


def save_checkpoint(tr, keep_last: int) -> str:
    from megatron.core import dist_checkpointing

    root = _ckpt_root(tr.cfg.train.out_dir)
    name = f"step_{tr.step_idx:06d}"
    tmp, final = os.path.join(root, name + ".tmp"), os.path.join(root, name)
    if tr.rank == 0:
        os.makedirs(root, exist_ok=True)
        # leftovers of a killed save / deletion; no rank writes now (the previous save ended with a
        # barrier and the others wait at the next one), and renaming them away first means a writer
        # that outlived a killed run cannot reach the fresh tmp dir below
        for d in os.listdir(root):
            if d.endswith(".tmp"):
                _discard(os.path.join(root, d))
        os.makedirs(tmp)  # fresh and empty: fails loudly rather than publish stale files
        for sub in ("actor", "critic", "actor_optim", "critic_optim"):
            os.makedirs(os.path.join(tmp, sub))
    dist.barrier()  # the tmp dir exists, empty, before any rank writes into it
    for name_, model, opt in _models(tr):
        with _scope(tr, name_):
            dist_checkpointing.save(model.sharded_state_dict(), os.path.join(tmp, name_))
        torch.save([o.state_dict() for o in _inner(opt)], os.path.join(tmp, f"{name_}_optim", f"rank{tr.rank}.pt"))
        if name_ == "actor":
            faults.mid_save(tmp, tr.step_idx, tr.rank)  # testing seam (no-op unless its env var is set)
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
               os.path.join(tmp, f"rng_rank{tr.rank}.pt"))
    if tr.rank == 0:
        torch.save({"step": tr.step_idx, "skipped_steps": tr.skipped_steps, "stream": tr.stream.state_dict(),
                    "daps": tr.daps.state_dict() if tr.daps is not None else None,
                    "evaluator": tr.evaluator.state_dict() if getattr(tr, "evaluator", None) is not None else None},
                   os.path.join(tmp, "trainer_state.pt"))
    _fsync_own_files(tmp, tr.rank)
    dist.barrier()  # every rank's files are written and on disk
    if tr.rank == 0:
        _fsync_dirs(tmp)
        with open(os.path.join(tmp, "COMPLETE"), "w") as f:
            os.fsync(f.fileno())
        _fsync_path(tmp, directory=True)
        if os.path.lexists(final):  # e.g. a train.resume=false rerun in the same out_dir
            _discard(final)
        os.replace(tmp, final)  # atomic on one filesystem: step_N appears complete or not at all
        _fsync_path(root, directory=True)
        best = best_step(tr)
        if best is not None:  # before the rotation: BEST never names a dir being deleted
            _write_best_marker(root, best)
        done = sorted(int(m[1]) for d in os.listdir(root) if (m := _STEP_RE.match(d)))
        for s in done[:-keep_last]:
            if s != best:  # the best evaluated checkpoint survives the rotation
                _discard(os.path.join(root, f"step_{s:06d}"))
        _fsync_path(root, directory=True)
    dist.barrier()
    return final


def load_checkpoint(tr, path: str) -> None:
    from megatron.core import dist_checkpointing

    for name_, model, opt in _models(tr):
        with _scope(tr, name_):
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

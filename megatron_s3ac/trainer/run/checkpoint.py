"""Atomic checkpoints: actor, critic, optimizers (megatron dist_checkpointing), DAPS state, data
order, RNG, step.

Layout: ``<out>/checkpoints/step_000010/{actor,critic}/`` (torch_dist), ``{actor,critic}_optim/`` (torch_dist
in megatron's ``fully_reshardable`` / ``dp_reshardable`` distributed-optimizer format, or ``rank{r}.pt`` per
rank where megatron refuses: see ``optimizer_refusal``) + ``checkpoint_meta.json`` (each model's optimizer
format, the reason for a per-rank one, the layout it was saved at) + ``trainer_state.pt`` (rank 0) +
``rng_rank{r}.pt`` + ``COMPLETE``. Written into ``step_000010.tmp``
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
import json
import os
import pickle
import random
import re
import shutil
import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron_s3ac import faults

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
    rank's shard of Adam's moments (what the per-rank format saves)."""
    return [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]


# ---- optimizer checkpoint formats ----------------------------------------------------------------
# megatron's DistributedOptimizer.sharded_state_dict formats (megatron-core 0.19.2, distrib_optimizer.py:1460-1580
# `sharded_state_dict`): "fully_reshardable" gathers each DP group's buffers on its DP rank 0 and
# saves one canonical tensor per parameter, so it loads at any TP / PP / EP / DP; "dp_reshardable"
# saves each rank's flat buffer shard in parallel (no gather) and reshards in DP only. The third
# format, "fully_sharded_model_space", raises "ShardedTensor.flattened_range is not supported" (measured on
# 0.16.1; still so in 0.19.2: its tensors are built with ``flattened_range=item_slice``, distrib_optimizer.py:2037,
# which ShardedTensor refuses, dist_checkpointing/mapping.py:133-134), so it is not offered.
DIST_FORMATS = ("fully_reshardable", "dp_reshardable")
OPTIM_FORMATS = DIST_FORMATS + ("per_rank",)
META_FILE = "checkpoint_meta.json"
_LAYOUT_KEYS = ("tp", "pp", "ep", "etp", "first_stage_layers", "last_stage_layers")
_announced: set = set()  # (model, reason) already logged by this process


class CheckpointFileError(RuntimeError):
    """A checkpoint file that would need to unpickle arbitrary Python objects to load (or is not a torch file)."""


# numpy's array reconstruction: what ``rng_rank*.pt`` of checkpoints written before the plain RNG format held
# (numpy's legacy state tuple). Its items go through the same restricted unpickler, so it runs no code.
_NUMPY_GLOBALS = ("numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct")


def _numpy_safe_globals() -> list:
    import importlib

    out = [np.ndarray, np.dtype] + [type(np.dtype(t)) for t in (np.uint32, np.float64, np.int64)]
    for name in _NUMPY_GLOBALS:
        mod, _, attr = name.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(mod), attr))
        except (ImportError, AttributeError):
            pass
    return out


def safe_load(path: str):
    """``torch.load`` of a checkpoint file that never unpickles arbitrary objects: torch's ``weights_only``
    unpickler (tensors, containers, numbers, strings; numpy arrays for old RNG files). Checkpoints are files
    users share: anything else (a pickled class, a ``__reduce__`` payload) is refused naming the file."""
    import zipfile

    if not zipfile.is_zipfile(path):  # torch.save's format is a zip archive; anything else is a raw pickle or junk
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        raise CheckpointFileError(f"{path}: not a readable torch checkpoint file (torch.save writes a zip archive; "
                                  f"a raw pickle or another format is refused)")
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        why = next((ln.strip() for ln in str(e).splitlines() if "WeightsUnpickler error" in ln), type(e).__name__)
        raise CheckpointFileError(
            f"{path}: refused to load: it holds Python objects that only a full unpickle could rebuild (which can "
            f"run arbitrary code); checkpoint files must contain only tensors, numbers, strings and containers "
            f"({why[:300]})") from None
    except (RuntimeError, EOFError) as e:
        raise CheckpointFileError(f"{path}: not a readable torch checkpoint file ({type(e).__name__}: {e})") from None


def _plain_rng() -> dict:
    """Every RNG this process draws from, as tensors and plain numbers (loadable by ``safe_load``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}}


def _restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    n = rng["numpy"]
    if isinstance(n, dict):
        n = (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    np.random.set_state(n)


class CheckpointLayoutError(RuntimeError):
    """A checkpoint's optimizer state cannot be loaded at this run's layout (per-rank format saved at
    another world size / layout, or dp_reshardable across a TP/PP/EP change)."""


def optimizer_refusal(opt) -> str | None:
    """Why megatron-core 0.19.2 cannot save ``opt`` through ``DistributedOptimizer.sharded_state_dict`` on this
    rank, else None. Mirrors the asserts on megatron's paths so no rank enters a collective save that
    another rank would abort: without TE / Apex, ``DistributedOptimizer.state_dict`` (distrib_optimizer.py:836-840,
    "Extract 'step', for non-Apex/TE support") asserts that every param of the inner torch Adam holds the
    same ``step`` (so there must be at least one optimizer step, and no param may have skipped one)."""
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    for o in getattr(opt, "chained_optimizers", [opt]):
        if not isinstance(o, DistributedOptimizer):
            return f"{type(o).__name__} is not megatron's DistributedOptimizer"
        if getattr(o.ddp_config, "use_megatron_fsdp", False):
            return "megatron FSDP optimizers save only as fsdp_dtensor"
        inner = o.optimizer
        if type(inner).__name__ == "HybridDeviceOptimizer":
            return "optimizer CPU offload (HybridDeviceOptimizer)"
        if not HAVE_APEX_OR_TE:
            steps = {float(st["step"]) for st in inner.state.values() if "step" in st}
            if not inner.state or not steps:
                return "no optimizer step has been taken yet (megatron without TE/Apex asserts one common Adam 'step')"
            if len(steps) > 1 or any("step" not in st for st in inner.state.values()):
                return (f"Adam 'step' differs across parameters ({sorted(steps)[:4]}); megatron without TE/Apex "
                        f"asserts one common step")
    return None


def _agreed_refusal(opt) -> str | None:
    """``optimizer_refusal`` agreed by every rank (the save is collective): the first rank's reason, if any."""
    mine = optimizer_refusal(opt)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    reasons = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, mine)
    return next(((f"rank {r}: {why}") for r, why in enumerate(reasons) if why is not None), None)


def _layout(tr, name: str) -> dict:
    """The layout a model's optimizer state is sharded by: world size, dtype, its parallel sizes."""
    cfg = tr.cfg
    lay = cfg.actor_layout if name == "actor" else (cfg.critic_layout or cfg.actor_layout)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {"world_size": world, "dtype": str(getattr(cfg.model, "dtype", "fp32")).split(".")[-1],
            **{k: getattr(lay, k, None) for k in _LAYOUT_KEYS}}


def _wanted_format(tr) -> str:
    fmt = getattr(tr.cfg.train, "optimizer_checkpoint", "fully_reshardable")
    if fmt not in OPTIM_FORMATS:
        raise ValueError(f"train.optimizer_checkpoint={fmt!r} must be one of {OPTIM_FORMATS}")
    return fmt


def _announce(tr, name: str, reason: str) -> None:
    """One line on rank 0 the first time a model's optimizer falls back to the per-rank format."""
    if tr.rank == 0 and (name, reason) not in _announced:
        _announced.add((name, reason))
        print(f"s3ac: checkpoint: the {name} optimizer state is saved per rank, not in megatron's layout-free "
              f"format, because {reason}; it resumes only at the same world size and layout "
              f"({', '.join(f'{k}={v}' for k, v in _layout(tr, name).items() if v is not None)}); "
              f"at another layout resume with train.resume_optimizer=false (fresh optimizer state, weights loaded)",
              file=sys.stderr, flush=True)


def _prime_state(opt) -> None:
    """Give every param of a fresh inner torch Adam a placeholder state (step 0, zero moments), as
    megatron's own loader does (``_init_optimizer_states_with_dummy_values``) but without an optimizer
    step that weight decay would apply: ``sharded_state_dict(is_loading=True)`` reads ``state_dict()``,
    which asserts one common step; the placeholders are overwritten by the load."""
    for inner in _inner(opt):
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if "step" not in st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st.setdefault("exp_avg", torch.zeros_like(p, memory_format=torch.preserve_format))
                    st.setdefault("exp_avg_sq", torch.zeros_like(p, memory_format=torch.preserve_format))
                    if group.get("amsgrad"):
                        st.setdefault("max_exp_avg_sq", torch.zeros_like(p, memory_format=torch.preserve_format))


def _save_optimizer(tr, name: str, model, opt, directory: str) -> dict:
    """Save one model's optimizer into ``directory``; returns its metadata entry."""
    from megatron.core import dist_checkpointing

    from megatron_s3ac.convert.carried import optimizer_model_state_dict

    fmt = _wanted_format(tr)
    reason = "train.optimizer_checkpoint=per_rank" if fmt == "per_rank" else _agreed_refusal(opt)
    entry = {"layout": _layout(tr, name)}
    if reason is None:
        with _scope(tr, name):
            sd = opt.sharded_state_dict(optimizer_model_state_dict(model), metadata=_dist_metadata(fmt))
            dist_checkpointing.save(sd, directory)
        return {**entry, "optimizer_format": fmt}
    if fmt != "per_rank":
        _announce(tr, name, reason)
    torch.save([o.state_dict() for o in _inner(opt)], os.path.join(directory, f"rank{tr.rank}.pt"))
    return {**entry, "optimizer_format": "per_rank", "reason": reason}


def _dist_metadata(fmt: str) -> dict:
    # chained_optim_avoid_prefix: the keys megatron gives a fully reshardable format without the
    # per-sub-optimizer prefix (ChainedOptimizer.sharded_state_dict), so dense and expert states match by name
    return {"distrib_optim_sharding_type": fmt, "chained_optim_avoid_prefix": True}


def read_meta(path: str) -> dict:
    """A checkpoint's ``checkpoint_meta.json``; checkpoints written before it existed were per rank."""
    f = os.path.join(path, META_FILE)
    if not os.path.isfile(f):
        return {"models": {}}
    with open(f) as fh:
        return json.load(fh)


def _load_optimizer(tr, name: str, model, opt, path: str, entry: dict) -> None:
    from megatron.core import dist_checkpointing

    from megatron_s3ac.convert.carried import optimizer_model_state_dict

    directory = os.path.join(path, f"{name}_optim")
    if not getattr(tr.cfg.train, "resume_optimizer", True):
        if tr.rank == 0:
            print(f"s3ac: checkpoint: train.resume_optimizer=false: the {name} optimizer starts fresh "
                  f"(weights, data order and RNG resume from {path})", file=sys.stderr, flush=True)
        return
    fmt = entry.get("optimizer_format", "per_rank")
    saved, now = entry.get("layout"), _layout(tr, name)
    if fmt == "per_rank":
        files = sorted(f for f in os.listdir(directory) if _OWNER_RE.search(f))
        same = saved == now if saved is not None else len(files) == now["world_size"]
        if not same or not os.path.isfile(os.path.join(directory, f"rank{tr.rank}.pt")):
            was = saved if saved is not None else {"world_size": len(files)}
            raise CheckpointLayoutError(
                f"{path}: the {name} optimizer state was saved per rank ({entry.get('reason', 'an older checkpoint')}) "
                f"at {_fmt_layout(was)}, and this run uses {_fmt_layout(now)}: per-rank optimizer state resumes "
                f"only at the same layout. Resume at that layout, or set train.resume_optimizer=false to load the "
                f"weights with fresh optimizer state")
        states = safe_load(os.path.join(directory, f"rank{tr.rank}.pt"))
        for o, sd in zip(_inner(opt), states):
            o.load_state_dict(sd)
        return
    if fmt == "dp_reshardable" and saved is not None and any(saved.get(k) != now.get(k) for k in _LAYOUT_KEYS):
        raise CheckpointLayoutError(
            f"{path}: the {name} optimizer state was saved in megatron's dp_reshardable format at {_fmt_layout(saved)}; "
            f"it reshards across data parallel only, and this run uses {_fmt_layout(now)}. Resume with the same "
            f"tp/pp/ep, or set train.resume_optimizer=false")
    _prime_state(opt)
    with _scope(tr, name):
        sd = opt.sharded_state_dict(optimizer_model_state_dict(model), is_loading=True, metadata=_dist_metadata(fmt))
        fitted = _fit_common(dist_checkpointing.load(sd, directory), opt, fmt, path, name)
    subs = list(getattr(opt, "chained_optimizers", [opt]))
    for sub, state in zip(subs, [fitted] if len(subs) == 1 else [fitted[i] for i in range(len(subs))]):
        _load_sub_optimizer(sub, state)


def _load_sub_optimizer(sub, state: dict) -> None:
    """``DistributedOptimizer.load_state_dict`` in its two halves, around two megatron-core defects on the
    TE/Apex-free path (torch Adam keeps a per-param ``step`` tensor), found on 0.16.1 and still in 0.19.2
    (line numbers are 0.19.2's distrib_optimizer.py):
    - ``_set_main_param_and_optimizer_states`` (:1216-1225) copies *every* tensor key of the Adam state,
      ``step`` included, from tensors the loaders built without ``step`` (they skip it, :2390-2392 and
      :2108-2110): KeyError. ``step`` is held aside while the parameter state is copied in (under no_grad:
      ``load_parameter_state_from_dp_reshardable``, :2061, is not decorated with it; its
      fully_reshardable sibling is, :2358);
    - the common half gives every param the *same* ``step`` tensor (:1024-1032; only the
      HybridDeviceOptimizer branch clones it, :1043), and torch Adam increments each param's step in
      place, so one shared tensor would advance once per param per update: each param gets its own copy."""
    state = dict(state)
    param_state, fmt = state.pop("param_state"), state.pop("param_state_sharding_type")
    sub.load_state_dict(state)  # param groups and the Adam step (no "param_state": megatron skips that half)
    inner = sub.optimizer
    steps = {p: st.pop("step") for p, st in inner.state.items() if "step" in st}
    try:
        loader = {"fully_reshardable": sub.load_parameter_state_from_fully_reshardable,
                  "dp_reshardable": sub.load_parameter_state_from_dp_reshardable}[fmt]
        with torch.no_grad():  # dp_reshardable's loader lacks fully_reshardable's @torch.no_grad: copy_ into
            loader(param_state)  # the fp32 main params (views of leaves that require grad) would raise
    finally:
        for p, step in steps.items():
            inner.state[p]["step"] = step.detach().clone()


_GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")  # megatron optimizer.py


def _saved_common(node, out: list) -> list:
    """Every saved sub-optimizer's common state ({"param_groups": [...]}) found in a loaded state dict."""
    if isinstance(node, dict):
        if isinstance(node.get("optimizer"), dict) and "param_groups" in node["optimizer"]:
            out.append(node["optimizer"])
        for k, v in node.items():
            if k not in ("optimizer", "param_state"):
                _saved_common(v, out)
    return out


def _fit_common(loaded: dict, opt, fmt: str, path: str, name: str):
    """The loaded state in the structure of *this* layout's (chained) optimizer.

    The parameter state (one tensor per parameter name) reshards by itself, but the common part
    (param groups, Adam step) is saved per sub-optimizer, and their number changes with the layout
    (e.g. dense and expert optimizers at EP=2, one at EP=1): megatron would then look for
    ``state_dict["optimizer"]`` where the file holds ``{0: ..., 1: ...}``. Each current param group
    takes the saved group with the same megatron identifiers (``param_group_identifier_keys``), else
    the same without ``is_expert_parallel``, else its own hyperparameters; all get the saved step."""
    subs = list(getattr(opt, "chained_optimizers", [opt]))
    saved = [g for c in _saved_common(loaded, []) for g in c["param_groups"]]
    steps = {g["step"] for g in saved if "step" in g}
    if len(steps) > 1:
        raise CheckpointLayoutError(f"{path}: the {name} optimizer's sub-optimizers were saved at different "
                                    f"Adam steps {sorted(steps)}; they cannot be merged at this layout")
    targets = [loaded] if len(subs) == 1 else [loaded[i] for i in range(len(subs))]
    out = []
    for sub, d in zip(subs, targets):
        mine = sub.state_dict()  # the primed state: this layout's groups (step 0)
        groups = []
        for g in mine["optimizer"]["param_groups"]:
            key = tuple(g.get(k) for k in _GROUP_KEYS)
            match = next((s for s in saved if tuple(s.get(k) for k in _GROUP_KEYS) == key), None) or next(
                (s for s in saved if tuple(s.get(k) for k in _GROUP_KEYS if k != "is_expert_parallel")
                 == tuple(g.get(k) for k in _GROUP_KEYS if k != "is_expert_parallel")), None)
            new = {**g, **{k: v for k, v in (match or {}).items() if k not in _GROUP_KEYS}}
            if steps:
                new["step"] = next(iter(steps))
            groups.append(new)
        fitted = {**{k: v for k, v in mine.items() if k != "optimizer"}, "optimizer": {**mine["optimizer"], "param_groups": groups},
                  "param_state": d["param_state"], "param_state_sharding_type": fmt}
        out.append(fitted)
    return out[0] if len(subs) == 1 else {i: o for i, o in enumerate(out)}


def _fmt_layout(layout: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in layout.items() if v is not None)


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


def _resident(tr):
    """Both models on the device while they are saved or loaded (colocated offload keeps them on the host while the
    engine is awake: trainer.step.engine_side.models_resident)."""
    return tr.models_resident()


def save_checkpoint(tr, keep_last: int) -> str:
    # every rank, before any collective of the save: the asynchronous source collects what is still generating
    # (rank 0 waits on the engine there, the others on the gloo rank-0 group), so the trainer_state.pt rank 0 writes
    # between the save's barriers waits for nothing
    tr.source.before_save()
    with _resident(tr):
        return _save_checkpoint(tr, keep_last)


def load_checkpoint(tr, path: str) -> None:
    with _resident(tr):
        _load_checkpoint(tr, path)


def _save_checkpoint(tr, keep_last: int) -> str:
    from megatron.core import dist_checkpointing

    from megatron_s3ac.convert.carried import model_sharded_state_dict

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
    meta = {"version": 1, "step": tr.step_idx, "models": {}}
    for name_, model, opt in _models(tr):
        with _scope(tr, name_):
            # the actor's carried tensors (vision tower, MTP head) too: mcore-to-hf of it is the complete model
            dist_checkpointing.save(model_sharded_state_dict(model), os.path.join(tmp, name_))
        meta["models"][name_] = _save_optimizer(tr, name_, model, opt, os.path.join(tmp, f"{name_}_optim"))
        if name_ == "actor":
            faults.mid_save(tmp, tr.step_idx, tr.rank)  # testing seam (no-op unless its env var is set)
    torch.save(_plain_rng(), os.path.join(tmp, f"rng_rank{tr.rank}.pt"))
    if tr.rank == 0:
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f, indent=1)
        torch.save({"step": tr.step_idx, "skipped_steps": tr.skipped_steps, "stream": tr.stream.state_dict(),
                    "daps": tr.daps.state_dict() if tr.daps is not None else None,
                    "evaluator": tr.evaluator.state_dict() if tr.evaluator is not None else None,
                    **_async_state(tr)},
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


def _async_state(tr) -> dict:
    """The rollout source's generated-but-untrained batches (the asynchronous source, train.max_staleness > 0), else
    nothing (the synchronous loop's trainer_state.pt is unchanged)."""
    st = tr.source.state_dict()
    return {} if st is None else {"async_rollout": st}


def _load_checkpoint(tr, path: str) -> None:
    from megatron_s3ac.convert.carried import load_model

    entries = read_meta(path)["models"]
    for name_, model, opt in _models(tr):
        with _scope(tr, name_):
            load_model(model, os.path.join(path, name_))
        _load_optimizer(tr, name_, model, opt, path, entries.get(name_, {}))
    st = safe_load(os.path.join(path, "trainer_state.pt"))
    tr.step_idx, tr.skipped_steps = int(st["step"]), int(st["skipped_steps"])
    tr.stream.load_state_dict(st["stream"])
    if tr.daps is not None and st["daps"] is not None:
        tr.daps.load_state_dict(st["daps"])
    if tr.evaluator is not None and st.get("evaluator") is not None:
        tr.evaluator.load_state_dict(st["evaluator"])
    if st.get("async_rollout") is not None:
        tr.source.load_state_dict(st["async_rollout"])
    _restore_rng(safe_load(os.path.join(path, f"rng_rank{tr.rank}.pt")))
    tr.sync_weights_soon()

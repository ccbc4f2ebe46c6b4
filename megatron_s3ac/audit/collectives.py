"""A collective audit: each rank's sequence of collectives (op, group, shapes, dtypes), and a check that the ranks
of every group issued the same sequence.

Collectives match by order: the n-th collective a rank issues on a group meets the n-th of every other member. A
rank that skips one, or takes another branch (a device or shared-memory path chosen from its own tensors, an
``if rank == 0`` around a barrier), pairs the rest wrongly: on NCCL a hang until the watchdog, on gloo often a
silent mismatch. On CPU such a branch usually agrees by luck (every tensor is on the host); the audit makes the
agreement itself the assertion, so a test can run the trainer's code at DP=2 and fail on the first divergence.

``audit_collectives()`` patches the ``torch.distributed`` collectives (the names code calls at run time:
``dist.all_reduce``..., and megatron's module-level aliases of them) in this process and yields the
``CollectiveLog``; ``audited(fn, *args)`` runs ``fn`` under it and returns {"result", "records", "error"} even when
``fn`` raised (a rank stuck in a divergent collective ends with its group's timeout), ready for
``models.gloo_ranks.run_distributed``; ``check_consistent(records_by_rank)`` raises ``CollectiveDivergence`` (an AssertionError) naming the group, the index and both ranks' calls with their
call sites. Point-to-point messages (send / recv) are not audited: they pair by peer, not by group order.

Recorded per call: the op, the group (its name, the same on every rank for groups created in the same order, and
its global ranks), the shapes and dtypes of the tensors it carries (object collectives: the number of objects),
``src``/``dst`` and the reduce op. Legitimately rank-dependent parts are left out: ``all_to_all_single``'s split
sizes and first dimension (the MoE token dispatch), ``gather``/``scatter`` lists present on the root only.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist


class CollectiveDivergence(AssertionError):
    """The ranks of one group issued different collective sequences."""


@dataclass(frozen=True)
class Record:
    op: str
    group: str  # the group's name (or its ranks when unnamed)
    ranks: tuple  # the group's global ranks
    args: tuple  # what must agree across the group: (name, description) pairs
    where: str  # call site (file:line function), for the message only

    def key(self) -> tuple:
        return self.op, self.group, self.args

    def describe(self) -> str:
        return f"{self.op}({', '.join(f'{k}={v}' for k, v in self.args)}) at {self.where}"


# op -> the arguments whose shapes/values must agree across the group
_OPS = {
    "all_reduce": ("tensor", "op"),
    "all_gather": ("tensor_list", "tensor"),
    "all_gather_into_tensor": ("output_tensor", "input_tensor"),
    "all_gather_single": ("output_tensor", "input_tensor"),
    "_all_gather_base": ("output_tensor", "input_tensor"),
    "reduce_scatter": ("output", "input_list", "op"),
    "reduce_scatter_tensor": ("output", "input", "op"),
    "reduce_scatter_single": ("output", "input", "op"),
    "_reduce_scatter_base": ("output", "input", "op"),
    "broadcast": ("tensor", "src"),
    "reduce": ("tensor", "dst", "op"),
    "gather": ("tensor", "dst"),
    "scatter": ("tensor", "src"),
    "all_to_all": ("output_tensor_list", "input_tensor_list"),
    "all_to_all_single": ("output", "input"),
    "barrier": (),
    "monitored_barrier": (),
    "all_gather_object": ("object_list",),
    "broadcast_object_list": ("object_list", "src"),
    "gather_object": ("dst",),
    "scatter_object_list": ("src",),
}
_TRAILING_ONLY = {"all_to_all_single"}  # the first dimension is each rank's own token count
_LISTS_OF_OBJECTS = {"all_gather_object", "broadcast_object_list"}


def _tensor(t, trailing: bool = False) -> str:
    shape = tuple(t.shape)[1:] if trailing else tuple(t.shape)
    return f"{str(t.dtype).removeprefix('torch.')}{list(shape)}" + ("[*, ...]" if trailing else "")


def _value(op: str, name: str, v) -> str:
    if isinstance(v, torch.Tensor):
        return _tensor(v, op in _TRAILING_ONLY)
    if op in _LISTS_OF_OBJECTS and name == "object_list":
        return f"{len(v)} objects"
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, torch.Tensor) for x in v):
        return "[" + ", ".join(_tensor(x, op in _TRAILING_ONLY) for x in v) + "]"
    return str(v)


def _group_id(group) -> tuple[str, tuple]:
    g = dist.group.WORLD if group is None else group
    try:
        ranks = tuple(dist.get_process_group_ranks(g))
    except Exception:  # noqa: BLE001 - a group this rank is not in
        ranks = ()
    name = getattr(g, "group_name", None) or str(ranks)
    return str(name), ranks


def _call_site() -> str:
    here = os.path.abspath(__file__)
    for fr in reversed(traceback.extract_stack()):
        f = os.path.abspath(fr.filename)
        if f != here and f"{os.sep}torch{os.sep}distributed{os.sep}" not in f:
            return f"{os.path.basename(f)}:{fr.lineno} {fr.name}"
    return "?"


class CollectiveLog:
    """This rank's audited collectives, in issue order."""

    def __init__(self):
        self.records: list[Record] = []

    def add(self, op: str, bound: inspect.BoundArguments) -> None:
        a = bound.arguments
        name, ranks = _group_id(a.get("group"))
        args = tuple((k, _value(op, k, a[k])) for k in _OPS[op] if k in a and a[k] is not None)
        self.records.append(Record(op, name, ranks, args, _call_site()))


def _aliases(reals: dict) -> list[tuple[object, str, str]]:
    """(module, attribute, op) of every module-level alias of an audited collective in loaded megatron modules
    (megatron-core binds e.g. ``dist_reduce_scatter_func = torch.distributed.reduce_scatter_tensor`` at import: its
    gradient reduce-scatter and parameter all-gather never look the name up on ``torch.distributed``)."""
    import sys

    by_id = {id(f): op for op, f in reals.items()}
    out = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("megatron"):
            continue
        for attr, v in list(vars(mod).items()):
            if id(v) in by_id and callable(v):
                out.append((mod, attr, by_id[id(v)]))
    return out


@contextlib.contextmanager
def audit_collectives():
    """Record every collective this process issues through ``torch.distributed.<op>`` (and megatron's module-level
    aliases of those functions) while inside."""
    log = CollectiveLog()
    saved = {}
    reals = {op: getattr(dist, op) for op in _OPS if getattr(dist, op, None) is not None}
    aliases = _aliases(reals)
    wrappers = {}
    for op, real in reals.items():
        saved[op] = real
        sig = inspect.signature(real)

        def wrapper(*args, _op=op, _real=real, _sig=sig, **kwargs):
            try:
                bound = _sig.bind(*args, **kwargs)
                bound.apply_defaults()
            except TypeError:  # a wrong call: recorded bare, the real function raises its own error
                bound = _sig.bind_partial()
            log.add(_op, bound)
            return _real(*args, **kwargs)

        wrapper.__wrapped__ = real
        wrappers[op] = wrapper
        setattr(dist, op, wrapper)
    for mod, attr, op in aliases:
        setattr(mod, attr, wrappers[op])
    try:
        yield log
    finally:
        for op, real in saved.items():
            setattr(dist, op, real)
        for mod, attr, op in aliases:
            setattr(mod, attr, reals[op])


def audited(fn, *args, **kwargs) -> dict:
    """``fn(*args, **kwargs)`` under the audit: {"result", "records", "error" (a traceback or None)}. An exception is
    kept, not raised, so the ranks' records can be compared whatever happened (the divergence is the better
    message than the timeout it caused)."""
    with audit_collectives() as log:
        try:
            return {"result": fn(*args, **kwargs), "records": log.records, "error": None}
        except Exception:  # noqa: BLE001 - reported by the caller with the records
            return {"result": None, "records": log.records, "error": traceback.format_exc()}


def check_consistent(records_by_rank: list[list[Record]]) -> int:
    """Raise ``CollectiveDivergence`` at the first collective where two ranks of one group differ (or one rank's
    sequence on the group ends early); returns how many records were compared."""
    groups: dict[str, tuple] = {}
    for recs in records_by_rank:
        for r in recs:
            groups.setdefault(r.group, r.ranks)
    compared = 0
    for name, ranks in sorted(groups.items()):
        members = [m for m in ranks if m < len(records_by_rank)]
        seqs = {m: [r for r in records_by_rank[m] if r.group == name] for m in members}
        if not members:
            continue
        ref = members[0]
        for m in members[1:]:
            a, b = seqs[ref], seqs[m]
            for i in range(max(len(a), len(b))):
                ra, rb = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
                if ra is None or rb is None or ra.key() != rb.key():
                    def d(r):
                        return r.describe() if r is not None else "nothing (its sequence on the group ends here)"
                    raise CollectiveDivergence(
                        f"group {name} (ranks {list(ranks)}): rank {ref} and rank {m} diverge at collective #{i}:\n"
                        f"  rank {ref}: {d(ra)}\n  rank {m}: {d(rb)}")
            compared += len(a)
    return compared

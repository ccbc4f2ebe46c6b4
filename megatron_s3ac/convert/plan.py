"""The conversion plan: which HF rows make up which piece of which megatron-core checkpoint tensor.

A megatron-core ``torch_dist`` checkpoint stores every parameter as a *global* tensor under a
layout-independent key (TP shards, experts and, for homogeneous stacks, layers are regions of it).
A ``Chunk`` is one region of such a tensor; its body (the region without its leading singleton
"index" axes, e.g. layer or expert) is the row-wise concatenation of ``parts`` — row ranges of HF
tensors — followed by zero rows (vocab padding). QKV interleaving, fc1 = [gate; up], per-expert
placement and vocab padding are all expressed this way, so one plan drives three users: the offline
writer (HF -> torch_dist), the offline reader (torch_dist -> HF) and the live export (sharded model
-> HF) used by rollout weight sync.

Architectures register a plan builder under their HF ``model_type`` (see ``qwen.py``).

*Carried* tensors (``Plan.carried_prefixes``; Qwen3.5: the vision tower and the MTP head) are HF tensors
that have no counterpart in the megatron decoder: the checkpoint stores each as is, as a global tensor
under ``CARRIED_KEY_PREFIX`` + its HF name, in row blocks (``carried_chunks``), so they travel through
hf-to-mcore, training checkpoints (``carried.py``) and mcore-to-hf bit for bit, at any layout. The plan's
own ``chunks`` / ``hf_shapes`` never list them (``with_carried`` adds them for the offline converter),
so the live export (weight sync) never sends them; ``ignorable_hf`` still contains them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from megatron_s3ac.models.registry import ModelInfo, UnsupportedModelError


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message names the file/tensor and the cause."""


@dataclass(frozen=True)
class Part:
    """Rows [start, stop) of the HF tensor ``hf`` (dim 0)."""

    hf: str
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Chunk:
    """Region ``offset``/``shape`` of checkpoint tensor ``key`` (global shape ``global_shape``).

    The first ``len(shape) - body_ndim`` axes are index axes of size 1 (layer, expert). The body
    [rows, *rest] = cat(parts) along dim 0, then ``shape[prefix]`` - sum(part rows) zero rows.
    ``aliases`` are further keys with the same geometry and content (e.g. the TE-spec name of a norm).
    """

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    parts: tuple[Part, ...]
    body_ndim: int
    aliases: tuple[str, ...] = ()

    @property
    def prefix(self) -> int:
        return len(self.shape) - self.body_ndim

    @property
    def body_shape(self) -> tuple[int, ...]:
        return self.shape[self.prefix:]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Plan:
    """Everything needed to convert one architecture instance, in HF tensor order."""

    info: ModelInfo
    chunks: list[Chunk]
    hf_shapes: dict[str, tuple[int, ...]]  # every HF tensor the checkpoint must contain, in output order
    objects: list[str]  # unique keys of the (empty) ``_extra_state`` ShardedObjects megatron requests
    # HF tensors the megatron model has no counterpart for (never exported); dropped on import, except the
    # carried ones (names under ``carried_prefixes``), which the checkpoint stores as is
    ignorable_hf: set[str] = field(default_factory=set)
    carried_prefixes: tuple[str, ...] = ()

    def sources(self) -> dict[str, list[tuple[Chunk, int, Part]]]:
        """hf name -> [(chunk, row offset of the part inside the chunk body, part)] in HF row order."""
        out: dict[str, list[tuple[Chunk, int, Part]]] = {name: [] for name in self.hf_shapes}
        for ch in self.chunks:
            row = 0
            for p in ch.parts:
                out[p.hf].append((ch, row, p))
                row += p.rows
        for name, lst in out.items():
            lst.sort(key=lambda t: t[2].start)
            covered = sum(p.rows for _, _, p in lst)
            if covered != self.hf_shapes[name][0]:
                raise AssertionError(f"plan covers {covered} of {self.hf_shapes[name][0]} rows of {name}")
        return out

    def check_coverage(self) -> None:
        """Every checkpoint tensor is tiled exactly once by its chunks (a planning bug otherwise)."""
        seen: dict[str, int] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for ch in self.chunks:
            seen[ch.key] = seen.get(ch.key, 0) + ch.numel
            shapes[ch.key] = ch.global_shape
        for key, n in seen.items():
            if n != math.prod(shapes[key]):
                raise AssertionError(f"chunks of {key} cover {n} of {math.prod(shapes[key])} elements")

    def tensor_keys(self) -> dict[str, tuple[int, ...]]:
        """checkpoint key -> global shape, aliases included."""
        out = {}
        for ch in self.chunks:
            for k in (ch.key, *ch.aliases):
                out[k] = ch.global_shape
        return out


# checkpoint key of a carried HF tensor: this prefix + its HF name
CARRIED_KEY_PREFIX = "s3ac_carried."
# carried tensors are stored in row blocks of at most this many bytes (one block per row when a row is
# larger), so neither the converter nor a training rank ever holds more than one block of, e.g., the
# MTP layer's fused experts at once
CARRIED_BLOCK_BYTES = 256 << 20


def carried_chunks(name: str, shape: tuple[int, ...], itemsize: int) -> list[Chunk]:
    """Chunks of carried HF tensor ``name``: dim 0 split into k equal row blocks (k the smallest divisor
    of the row count giving blocks <= ``CARRIED_BLOCK_BYTES``: megatron's dist_checkpointing wants a
    regular grid)."""
    if not shape:
        raise ConversionError(f"tensor {name} is a scalar (shape []): carried tensors need at least one axis")
    rows, row_bytes = shape[0], math.prod(shape[1:]) * itemsize
    k = next(d for d in range(1, rows + 1)
             if d == rows or (rows % d == 0 and (rows // d) * row_bytes <= CARRIED_BLOCK_BYTES))
    n = rows // k
    key = CARRIED_KEY_PREFIX + name
    return [Chunk(key=key, global_shape=tuple(shape), offset=(i * n, *([0] * (len(shape) - 1))),
                  shape=(n, *shape[1:]), parts=(Part(name, i * n, (i + 1) * n),), body_ndim=len(shape))
            for i in range(k)]


def is_carried_key(key: str) -> bool:
    return key.startswith(CARRIED_KEY_PREFIX)


def with_carried(plan: Plan, carried: dict[str, tuple[tuple[int, ...], int]]) -> Plan:
    """``plan`` plus the carried HF tensors ``{name: (shape, itemsize)}`` (after the model's own, in the
    given order), for the offline converter. Names outside ``plan.carried_prefixes`` are a ConversionError."""
    bad = [n for n in carried if not n.startswith(plan.carried_prefixes) or not plan.carried_prefixes]
    if bad:
        raise ConversionError(f"the {plan.info.model_type} mapping carries only tensors under "
                              f"{list(plan.carried_prefixes)}; got {', '.join(bad[:5])}")
    chunks, shapes = list(plan.chunks), dict(plan.hf_shapes)
    for name, (shape, itemsize) in carried.items():
        chunks += carried_chunks(name, shape, itemsize)
        shapes[name] = tuple(shape)
    return Plan(info=plan.info, chunks=chunks, hf_shapes=shapes, objects=plan.objects,
                ignorable_hf=plan.ignorable_hf, carried_prefixes=plan.carried_prefixes)


_PLANS: dict[str, Callable[[ModelInfo], Plan]] = {}


def register_plan(*model_types: str):
    """Decorator: ``fn(info) -> Plan`` converts the given HF model_types."""

    def deco(fn):
        for mt in model_types:
            _PLANS[mt] = fn
        return fn

    return deco


def build_plan(info: ModelInfo) -> Plan:

    if info.model_type not in _PLANS:
        raise UnsupportedModelError(
            f"no checkpoint conversion for model_type {info.model_type!r}; supported: {', '.join(sorted(_PLANS))}")
    plan = _PLANS[info.model_type](info)
    plan.check_coverage()
    return plan


def overlap(a_off, a_shape, b_off, b_shape):
    """Intersection of two boxes as (offset, shape), or None when empty."""
    off, shp = [], []
    for ao, asz, bo, bsz in zip(a_off, a_shape, b_off, b_shape):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        off.append(lo)
        shp.append(hi - lo)
    return tuple(off), tuple(shp)


def box_slices(inner_off, inner_shape, outer_off):
    """Index of box ``inner`` inside a tensor that holds the box starting at ``outer_off``."""
    return tuple(slice(i - o, i - o + s) for i, s, o in zip(inner_off, inner_shape, outer_off))


def part_region(ch: Chunk, row: int, rows: int) -> tuple[tuple, tuple]:
    """Global (offset, shape) of rows [row, row+rows) of the chunk body."""
    p = ch.prefix
    off = list(ch.offset)
    off[p] += row
    shape = list(ch.shape)
    shape[p] = rows
    return tuple(off), tuple(shape)

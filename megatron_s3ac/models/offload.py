"""Idle-model offload (``train.offload_idle``): a model's parameters, gradients (megatron's
``main_grad`` buffers) and optimizer state to host memory and back.

What moves is *storage*, not tensors: every tensor that matters (``p.data``, ``p.main_grad``,
``p.grad``, the optimizer's main params and Adam moments) is a view of some storage (megatron's DDP
keeps params and grads in contiguous buffers). Each distinct storage on the model's device is copied
whole into a host buffer (pinned on CUDA, so the copies run at DMA speed and can be asynchronous)
and then resized to 0 bytes, which frees the device memory while every view, parameter object,
optimizer reference and DDP bucket stays valid. ``onload`` re-allocates each storage at its old size
and copies the bytes back: the round trip is bit-exact by construction. On a CPU-only machine the
"device" is the host too, so the same copy-and-free runs between two host allocations: the round
trip is really exercised (and tested) even without a GPU.

Megatron's ``HybridDeviceOptimizer`` (``optim.cpu_offload``) already keeps its offloaded state on the
host; only tensors on the model's device are moved, so such state is left where it is.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

KINDS = ("params", "grads", "optimizer")


@dataclass
class OffloadStats:
    """One offload or onload: bytes moved per kind ('params', 'grads', 'optimizer') and seconds."""

    direction: str
    bytes: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def metrics(self, prefix: str) -> dict:
        """Logging keys: ``time/offload_<prefix>_<direction>`` (s) and ``mem/<prefix>_<kind>_gb``."""
        out = {f"time/offload_{prefix}_{self.direction}": self.seconds}
        out.update({f"mem/{prefix}_{k}_gb": v / 2**30 for k, v in self.bytes.items()})
        return out


def _inner_optimizers(optimizer):
    """The torch optimizers inside megatron's wrappers (ChainedOptimizer -> DistributedOptimizer /
    Float16Optimizer / FP32Optimizer -> torch AdamW or HybridDeviceOptimizer)."""
    if optimizer is None:
        return []
    if hasattr(optimizer, "chained_optimizers"):
        return [o for c in optimizer.chained_optimizers for o in _inner_optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return [inner]
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return []


def _tensors(model_chunks, optimizer):
    """(kind, tensor) of everything offload moves; shared storages are deduplicated by the caller."""
    for chunk in model_chunks:
        for p in chunk.parameters():
            yield "params", p.data
        for p in chunk.parameters():
            for g in (getattr(p, "main_grad", None), p.grad):
                if g is not None:
                    yield "grads", g
    for opt in _inner_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                yield "optimizer", p.data
                if p.grad is not None:
                    yield "optimizer", p.grad
        for state in opt.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    yield "optimizer", v


def _whole(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A uint8 tensor viewing all ``nbytes`` of ``storage``."""
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return t.set_(storage, 0, (nbytes,), (1,))


def _aligned(n: int) -> int:
    return -(-int(n) // HostOffload.ALIGN) * HostOffload.ALIGN


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostOffload:
    """Offload ``model_chunks`` (+ ``optimizer``) to host memory and back, all of it or some kinds.

    ``offload(kinds)`` -> OffloadStats: the model's storages of those kinds ('params', 'grads', 'optimizer';
    default all) still on the device go to the host; ``onload(kinds)`` brings those kinds back. The model must not
    run while any of its storages is on the host. The set of storages is collected at each offload, so the optimizer
    state created by later steps is included.

    Host memory is ONE arena per model (``host_bytes``), kept for the life of this object and reused by every
    offload, each storage at a 512-byte aligned offset. On CUDA it is pinned, and torch's pinned allocator rounds
    every allocation up to a power of two and never returns it to the system
    (ATen/core/CachingHostAllocator.h:300-309, 341 in torch 2.13): one per tensor would pin up to twice the model
    per tensor and pay a cudaHostAlloc for each. So the arena is requested at that power of two (the planner counts
    the same: plan.memory.pinned_bytes), sized for the optimizer's Adam moments the first step will create, and only
    re-allocated if the model's storages outgrow it.
    """

    ALIGN = 512

    def __init__(self, model_chunks, optimizer=None, device: torch.device | None = None):
        self.chunks = list(model_chunks)
        self.optimizer = optimizer
        if device is None:
            device = next(p.device for c in self.chunks for p in c.parameters())
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self._saved: list[tuple[str, torch.UntypedStorage, torch.Tensor]] | None = None
        self._arena: torch.Tensor | None = None

    @property
    def on_host(self) -> bool:
        """True while any storage of the model is on the host (the model cannot run)."""
        return bool(self._saved)

    @property
    def host_bytes(self) -> int:
        """Bytes of the host arena (pinned on CUDA; 0 before the first offload)."""
        return 0 if self._arena is None else self._arena.numel()

    def offloaded_kinds(self) -> set:
        return {k for k, _, _ in self._saved or []}

    def _storages(self):
        seen, out = set(), []
        for kind, t in _tensors(self.chunks, self.optimizer):
            if t.device != self.device:
                continue  # e.g. HybridDeviceOptimizer's host-side state
            st = t.untyped_storage()
            key = st.data_ptr()
            if st.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            out.append((kind, st))
        return out

    def _future_optimizer_bytes(self) -> int:
        """Adam's state of the params that have none yet: exp_avg and exp_avg_sq like their main param, and the step
        counter, each at an aligned offset."""
        return sum(2 * _aligned(p.numel() * p.element_size()) + self.ALIGN for o in _inner_optimizers(self.optimizer)
                   for g in o.param_groups for p in g["params"] if not o.state.get(p))

    def _arena_for(self, moving) -> torch.Tensor:
        """The arena, (re-)allocated when it is too small for the whole model (every kind, on the device or not)."""
        total = sum(_aligned(st.nbytes()) for _, st in self._storages()) + sum(
            _aligned(h.numel()) for _, _, h in self._saved or [])
        if self._arena is None or self._arena.numel() < total:
            if self._saved:
                raise RuntimeError("HostOffload: the model's storages outgrew its host arena while part of it is "
                                   "offloaded; onload() first")
            size = max(total + self._future_optimizer_bytes(), 1)
            if self.pin:  # the pinned allocator would round it up anyway: use all of the block
                size = 1 << (size - 1).bit_length()
            self._arena = None  # the old arena goes before the new one is taken
            self._arena = torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
        return self._arena

    def _place_in_arena(self, sizes: list[int]) -> list[int]:
        """First-fit offsets for ``sizes`` among the arena's free ranges (the views still on the host are kept)."""
        taken = sorted((int(h.storage_offset()), int(h.storage_offset()) + h.numel()) for _, _, h in self._saved or [])
        free, at = [], 0
        for lo, hi in taken:
            if lo > at:
                free.append([at, lo])
            at = max(at, hi)
        free.append([at, self._arena.numel()])
        out = []
        for n in sizes:
            for rng in free:
                lo = _aligned(rng[0])
                if lo + n <= rng[1]:
                    out.append(lo)
                    rng[0] = lo + n
                    break
            else:
                raise RuntimeError(f"HostOffload: no room for {n} bytes in the {self._arena.numel()}-byte host arena")
        return out

    @torch.no_grad()
    def offload(self, kinds=KINDS) -> OffloadStats:
        kinds = tuple(kinds)
        moving = [(k, st) for k, st in self._storages() if k in kinds]
        if not moving and self.offloaded_kinds() >= set(kinds):
            raise RuntimeError(f"HostOffload.offload: {sorted(kinds)} already offloaded")
        stats = OffloadStats("offload")
        t0 = time.perf_counter()
        arena = self._arena_for(moving)
        offs = self._place_in_arena([st.nbytes() for _, st in moving])
        saved = list(self._saved or [])
        for (kind, st), off in zip(moving, offs):
            n = st.nbytes()
            host = arena[off:off + n]
            host.copy_(_whole(st, n), non_blocking=self.pin)
            saved.append((kind, st, host))
            stats.bytes[kind] = stats.bytes.get(kind, 0) + n
        _sync(self.device)  # the copies must land before the device memory is released
        for _, st in moving:
            st.resize_(0)
        self._saved = saved
        stats.seconds = time.perf_counter() - t0
        return stats

    @torch.no_grad()
    def onload(self, kinds=KINDS) -> OffloadStats:
        kinds = tuple(kinds)
        back = [s for s in self._saved or [] if s[0] in kinds]
        if not back:
            raise RuntimeError(f"HostOffload.onload: none of {sorted(kinds)} is offloaded")
        stats = OffloadStats("onload")
        t0 = time.perf_counter()
        for kind, st, host in back:
            n = host.numel()
            st.resize_(n)
            _whole(st, n).copy_(host, non_blocking=self.pin)
            stats.bytes[kind] = stats.bytes.get(kind, 0) + n
        _sync(self.device)
        # the arena stays allocated (reused by the next offload); what is still on the host keeps its place
        self._saved = [s for s in self._saved if s[0] not in kinds] or None
        stats.seconds = time.perf_counter() - t0
        return stats

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostOffload:
    """Offload ``model_chunks`` (+ ``optimizer``) to host memory and back.

    ``offload()`` -> OffloadStats; the model must not be used until ``onload()``. The set of
    storages is collected at each offload, so the optimizer state created by later steps is included.
    """

    def __init__(self, model_chunks, optimizer=None, device: torch.device | None = None):
        self.chunks = list(model_chunks)
        self.optimizer = optimizer
        if device is None:
            device = next(p.device for c in self.chunks for p in c.parameters())
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self._saved: list[tuple[str, torch.UntypedStorage, torch.Tensor]] | None = None

    @property
    def on_host(self) -> bool:
        return self._saved is not None

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

    @torch.no_grad()
    def offload(self) -> OffloadStats:
        if self.on_host:
            raise RuntimeError("HostOffload.offload: the model is already offloaded")
        stats = OffloadStats("offload")
        t0 = time.perf_counter()
        saved = []
        for kind, st in self._storages():
            n = st.nbytes()
            host = torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
            host.copy_(_whole(st, n), non_blocking=self.pin)
            saved.append((kind, st, host))
            stats.bytes[kind] = stats.bytes.get(kind, 0) + n
        _sync(self.device)  # the copies must land before the device memory is released
        for _, st, _ in saved:
            st.resize_(0)
        self._saved = saved
        stats.seconds = time.perf_counter() - t0
        return stats

    @torch.no_grad()
    def onload(self) -> OffloadStats:
        if not self.on_host:
            raise RuntimeError("HostOffload.onload: the model is not offloaded")
        stats = OffloadStats("onload")
        t0 = time.perf_counter()
        for kind, st, host in self._saved:
            n = host.numel()
            st.resize_(n)
            _whole(st, n).copy_(host, non_blocking=self.pin)
            stats.bytes[kind] = stats.bytes.get(kind, 0) + n
        _sync(self.device)
        self._saved = None  # drops the host buffers
        stats.seconds = time.perf_counter() - t0
        return stats

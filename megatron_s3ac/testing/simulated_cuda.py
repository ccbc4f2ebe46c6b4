"""A simulated GPU for device scripts' memory bookkeeping on a CPU machine.

Reproduces what the CUDA driver and NVML report around a process's CUDA context: the context is created by the
first runtime call that needs one (``torch.cuda.set_device`` under CUDA 12, ``mem_get_info``, any allocation) and
then occupies ``context_bytes`` of device memory; NVML (``pynvml``) reads the device's used memory without creating
a context. ``SimulatedGPU.install(monkeypatch)`` puts it in place of ``torch.cuda``'s functions used for that and of
the ``pynvml`` module; ``stop_at`` names a function that raises ``SimulationEnd`` (where a test stops the script).
"""
from __future__ import annotations

import sys
import types

GIB = 1024**3


class SimulationEnd(Exception):
    """Raised where the simulated script run is stopped."""


class SimulatedGPU:
    def __init__(self, total_bytes: int = 80 * GIB, other_used_bytes: int = GIB // 2,
                 context_bytes: int = int(0.53 * GIB)):
        self.total, self.other, self.context_bytes = int(total_bytes), int(other_used_bytes), int(context_bytes)
        self.context = False
        self.calls: list[str] = []

    def used(self) -> int:
        return self.other + (self.context_bytes if self.context else 0)

    def _runtime(self, name: str):
        self.calls.append(name)
        self.context = True  # a runtime call needing a context creates it

    # torch.cuda
    def is_available(self) -> bool:
        self.calls.append("is_available")  # cudaGetDeviceCount: no context
        return True

    def set_device(self, device) -> None:
        self._runtime("set_device")

    def mem_get_info(self, device=None):
        self._runtime("mem_get_info")
        return self.total - self.used(), self.total

    def memory_reserved(self, device=None) -> int:
        return 0  # nothing allocated through torch's caching allocator yet

    def pynvml(self) -> types.ModuleType:
        gpu = self
        m = types.ModuleType("pynvml")

        class NVMLError(Exception):
            pass

        m.NVMLError = NVMLError
        m.nvmlInit = lambda: gpu.calls.append("nvmlInit")
        m.nvmlShutdown = lambda: None
        m.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
        m.nvmlDeviceGetHandleByUUID = lambda u: ("gpu", u)
        m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=gpu.total, used=gpu.used(),
                                                                   free=gpu.total - gpu.used())
        return m

    def install(self, monkeypatch, stop_at=None) -> None:
        """Replace torch.cuda's is_available / set_device / mem_get_info / memory_reserved and the pynvml module
        through ``monkeypatch`` (pytest's: undone after the test); ``stop_at``: (object, name) that raises
        SimulationEnd when called."""
        import torch

        for name in ("is_available", "set_device", "mem_get_info", "memory_reserved"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setitem(sys.modules, "pynvml", self.pynvml())
        if stop_at is not None:
            def stop(*args, **kwargs):
                raise SimulationEnd(stop_at[1])

            monkeypatch.setattr(stop_at[0], stop_at[1], stop)

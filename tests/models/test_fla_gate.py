"""fla is skipped where it refuses to run (Hopper + 3.4 <= Triton < 3.7.1 without tilelang).

The decision depends only on the GPU generation and package versions, so the test sets those."""
import sys
import types

import pytest
import torch

from megatron_s3ac.models.cpu_compat import fla_refusal


@pytest.mark.parametrize("capability,triton_version,tilelang,refused", [
    ((9, 0), "3.6.0", False, True),     # seen on an H200: fla raises in backward
    ((9, 0), "3.7.1", False, False),
    ((9, 0), "3.3.1", False, False),
    ((9, 0), "3.6.0", True, False),      # tilelang backend present
    ((8, 0), "3.6.0", False, False),     # not Hopper
])
def test_fla_refusal(monkeypatch, capability, triton_version, tilelang, refused):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=triton_version))
    if tilelang:
        monkeypatch.setitem(sys.modules, "tilelang", types.ModuleType("tilelang"))
    else:
        monkeypatch.setitem(sys.modules, "tilelang", None)  # import raises ImportError
    why = fla_refusal()
    assert (why is not None) == refused
    if refused:
        assert triton_version in why


def test_no_gpu_no_refusal(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fla_refusal() is None

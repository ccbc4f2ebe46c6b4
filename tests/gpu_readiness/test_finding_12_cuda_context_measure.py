"""Finding 12 (issue 24): ``tools/device_checks/plan_calibration.py`` measures the CUDA context before it exists.

At 2c164be the script's first reading was ``torch.cuda.mem_get_info()``, which itself creates the context, so the
"context" it reported (free before - free after - reserved) was ~0 GiB. A real context needs a GPU; here the script's
``main`` runs against a simulated GPU (megatron_s3ac/testing/simulated_cuda.py: the context appears at the first
runtime call that needs one, NVML reads used memory without one) up to its process-group start, and the context it
reports must be the simulated one. The device check itself (the script on a GPU, default flags) covers the real
figure; without CUDA it still exits 1 naming the cause (checked below).
"""
import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys

import pytest
import torch.distributed as dist

from megatron_s3ac.testing.simulated_cuda import GIB, SimulatedGPU, SimulationEnd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "device_checks", "plan_calibration.py")


def _script():
    spec = importlib.util.spec_from_file_location("plan_calibration_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_context_is_measured_from_before_it_exists(monkeypatch):
    gpu = SimulatedGPU(context_bytes=int(0.53 * GIB))
    gpu.install(monkeypatch, stop_at=(dist, "init_process_group"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SimulationEnd):
        _script().main([])
    m = re.search(r"CUDA context:? ~?([0-9.]+) GiB", out.getvalue())
    assert m, f"no CUDA context figure before the process group starts; printed: {out.getvalue()!r}"
    assert float(m.group(1)) == pytest.approx(0.53, abs=0.01)
    assert gpu.context  # the script did create it (after the first reading)


def test_without_cuda_the_script_exits_1_naming_the_cause():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and "needs a CUDA GPU" in r.stderr

"""The environment check (megatron_s3ac/env.py) on faked stacks, and the megatron-core refusal.

The "good" stack is the matrix of docs/environment.md; its ``Requires-Dist`` lines are copied from the
wheels' METADATA (sglang-0.5.23-cp312, sglang_kernel-0.4.10, torch-2.14.1, flash_linear_attention-0.6.0,
fla_core-0.6.0, megatron_core-0.19.2; transformer_engine_torch 2.18.0 as TE's wheels state their pin on the core
library, ``transformer_engine_cu13==V``). Bad stacks change one thing each; the expected finding is derived from
that change, not from the code under test.
"""
import json
import re
import subprocess
import sys

import pytest

from megatron_s3ac import env
from megatron_s3ac.models import cpu_compat

# the megatron-core the lock installs: requirements-cpu.txt (Python 3.12)
LOCKED_MCORE = "0.19.2"

GOOD = {
    "torch": "2.14.1", "triton": "3.8.0", "transformer-engine": "2.18.0", "transformer-engine-torch": "2.18.0",
    "transformer-engine-cu13": "2.18.0", "transformer-engine-cu12": None, "megatron-core": "0.19.2",
    "sglang": "0.5.23", "sglang-kernel": "0.4.10", "sgl-kernel": None, "flashinfer-python": "0.7.2",
    "flash-linear-attention": "0.6.0", "fla-core": "0.6.0", "tilelang": "0.1.12", "ray": "2.60.0",
    "nvidia-modelopt": "0.47.0", "transformers": "5.19.0", "numpy": "2.3.5",
}
REQUIRES = {
    "sglang": ["torch==2.14.1", "transformers==5.19.0", "sglang-kernel==0.4.10", "flashinfer_python[cu13]==0.7.2",
               "tilelang==0.1.12", "numpy", 'ray[default]>=2.55.1; extra == "ray"',
               'nvidia-modelopt; extra == "diffusion"'],
    "sglang-kernel": ["torch==2.14.1"],
    "torch": ['triton~=3.8.0; platform_system == "Linux" and python_version < "3.15"', "filelock"],
    "transformer-engine-torch": ["torch>=2.1", "transformer_engine_cu13==2.18.0"],
    "transformer-engine": ['transformer_engine_torch==2.18.0; extra == "pytorch"'],
    "flash-linear-attention": ["fla-core==0.6.0", "transformers<6,>=5.6.2"],
    "fla-core": ["einops", 'torch>=2.7.0; extra == "cuda"', 'triton>=3.3; extra == "cuda"'],
    "megatron-core": ["torch>=2.6.0", "numpy", "packaging>=24.2", 'flash-linear-attention~=0.4.0; extra == "dev"',
                      'flashinfer-python<0.7.0,>=0.5.0; extra == "dev"',
                      'transformer-engine[core_cu13,pytorch]; extra == "te"'],
    "flashinfer-python": ["torch", "numpy"],
}
H200 = {"torch_cuda": "13.0", "cuda_available": True, "device_count": 8, "capability": (9, 0),
        "device_name": "NVIDIA H200", "nccl": "2.30.7", "nccl_available": True, "load_errors": {}}
CPU = {"torch_cuda": None, "cuda_available": False, "device_count": 0, "capability": None,
       "device_name": None, "nccl": None, "nccl_available": False, "load_errors": {}}


def run(require_gpu=True, runtime=H200, **changes):
    versions = {**GOOD, **changes}
    return env.check_environment(require_gpu, versions=versions, requires=REQUIRES, runtime=runtime,
                                 raise_on_error=False)


def test_matrix_stack_passes_on_hopper():
    report = env.check_environment(True, versions=GOOD, requires=REQUIRES, runtime=H200)  # raises if not
    assert report.ok and report.findings == []
    text = report.format()
    assert "sglang" in text and "0.5.23" in text and "no problems found" in text


def test_matrix_agrees_with_setup_gpu_extra():
    """env.MATRIX and setup.py's `gpu` extra state the same pins (one matrix, two places)."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(__file__).resolve().parents[1].joinpath("setup.py").read_text())
    gpu = next(n.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and
               getattr(n.targets[0], "id", None) == "GPU")
    pins = {}
    for elt in gpu.elts:
        from packaging.requirements import Requirement
        r = Requirement(elt.value)
        assert r.marker is None, elt.value  # one Python (3.12), one megatron-core (0.19.2): no per-Python pins
        spec = str(r.specifier)
        if spec.startswith("=="):
            pins[r.name.lower()] = spec[2:]
    for name, v in pins.items():
        assert env.MATRIX.get(name) == v, (name, v, env.MATRIX.get(name))


def test_sglang_with_another_torch_is_refused_naming_both():
    # the old Dockerfile: NGC torch + `sglang==0.5.23 --no-deps`
    with pytest.raises(env.IncompatibleEnvironment) as e:
        env.check_environment(True, versions={**GOOD, "torch": "2.9.0a0+50eac811a6.nv25.9"},
                              requires=REQUIRES, runtime=H200)
    msg = str(e.value)
    assert "sglang 0.5.23 requires torch==2.14.1" in msg and "torch 2.9.0a0+50eac811a6.nv25.9 is installed" in msg
    assert "sglang-kernel 0.4.10 requires torch==2.14.1" in msg  # its compiled kernels too


def test_local_build_tag_satisfies_pin():
    assert run(torch="2.14.1+cu130").ok


@pytest.mark.parametrize("pkg,bad,owner,spec", [
    ("flashinfer-python", "0.6.1", "sglang 0.5.23", "flashinfer_python==0.7.2"),
    ("sglang-kernel", "0.4.9", "sglang 0.5.23", "sglang-kernel==0.4.10"),
    ("transformers", "5.24.0", "sglang 0.5.23", "transformers==5.19.0"),
    ("triton", "3.6.0", "torch 2.14.1", "triton~=3.8.0"),
    ("transformer-engine-cu13", "2.9.0", "transformer-engine-torch 2.18.0", "transformer_engine_cu13==2.18.0"),
    ("fla-core", "0.5.2", "flash-linear-attention 0.6.0", "fla-core==0.6.0"),
])
def test_violated_declared_pin_is_an_error(pkg, bad, owner, spec):
    report = run(**{pkg: bad})
    assert not report.ok
    assert [f.what for f in report.errors] == [f"{owner} requires {spec}, but {pkg} {bad} is installed"]


def test_extra_and_platform_markers_are_not_requirements():
    # sglang's `ray` extra wants ray>=2.55.1, megatron-core's `dev` extra wants flash-linear-attention~=0.4.0 and
    # flashinfer-python<0.7.0 (0.6.0 / 0.7.2 installed), its `te` extra names TE: not installed through those
    # extras, so not checked as pins
    assert run(ray="2.40.0").ok
    assert not any("megatron-core 0.19.2 requires" in f.what for f in run().findings)
    assert not any("requires transformer-engine" in f.what for f in run(**{"transformer-engine-torch": "2.20.2",
                                                                           "transformer-engine": "2.20.2"}).errors)


def test_other_sglang_release_is_refused():
    report = run(sglang="0.5.22")
    assert any("sglang 0.5.22 is installed" in f.what and "0.5.23" in f.what for f in report.errors)


def test_both_sgl_kernel_names_installed_is_refused():
    report = run(**{"sgl-kernel": "0.3.21"})
    assert [f.what.split(":")[0] for f in report.errors] == [
        "both sgl-kernel 0.3.21 and sglang-kernel 0.4.10 are installed"]


@pytest.mark.parametrize("mcore", ["0.16.1", "0.17.1", "0.18.2", "0.19.1", "0.20.0", "0.15.3", "0.16.0"])
def test_unsupported_megatron_core_is_refused(mcore):
    """0.16.1 (Python 3.11) was dropped: refused like any other release but 0.19.2, naming the fix."""
    report = run(**{"megatron-core": mcore})
    assert any(f"megatron-core {mcore} is not supported" in f.what for f in report.errors)
    assert any("megatron-core==0.19.2" in f.fix for f in report.errors)


def test_te_outside_megatron_declared_range_is_a_warning():
    stack = {"transformer-engine": "2.20.2", "transformer-engine-torch": "2.20.2", "transformer-engine-cu13": "2.20.2"}
    requires = {**REQUIRES, "transformer-engine-torch": ["torch>=2.1", "transformer_engine_cu13==2.20.2"]}
    report = env.check_environment(True, versions={**GOOD, **stack}, requires=requires, runtime=H200)
    assert report.ok
    assert [f.level for f in report.findings] == ["warning"]
    assert "2.20.2" in report.findings[0].what and "<2.19,>=2.18.0" in report.findings[0].what


def test_te_range_of_megatron_core_019():
    """0.19.2 declares no TE range; its pyproject builds against TE 2.18.0+27486e03, so 2.18.x is quiet and 2.11.0
    (the TE of the dropped 0.16.1) warns naming the 2.18 line and the fix."""
    def stack(v):
        return {"transformer-engine": v, "transformer-engine-torch": v, "transformer-engine-cu13": v,
                "megatron-core": "0.19.2"}

    def requires(v):
        return {**REQUIRES, "transformer-engine-torch": ["torch>=2.1", f"transformer_engine_cu13=={v}"],
                "transformer-engine": [f'transformer_engine_torch=={v}; extra == "pytorch"']}

    ok = env.check_environment(True, versions={**GOOD, **stack("2.18.0")}, requires=requires("2.18.0"), runtime=H200)
    assert ok.ok and ok.findings == []
    old = env.check_environment(True, versions={**GOOD, **stack("2.11.0")}, requires=requires("2.11.0"), runtime=H200)
    assert old.ok and [f.level for f in old.findings] == ["warning"]
    assert "2.11.0" in old.findings[0].what and "<2.19,>=2.18.0" in old.findings[0].what
    assert "==2.18.0" in old.findings[0].fix


def test_te_extension_built_for_another_torch_is_refused():
    rt = {**H200, "load_errors": {"transformer_engine.pytorch": "ImportError: transformer_engine_torch.so: "
                                                               "undefined symbol: _ZN3c104cuda9SetDeviceEab"}}
    report = run(runtime=rt)
    assert len(report.errors) == 1
    f = report.errors[0]
    assert "transformer-engine-torch 2.18.0" in f.what and "torch 2.14.1" in f.what and "undefined symbol" in f.what
    assert "--no-build-isolation" in f.fix


@pytest.mark.parametrize("triton,cap,tilelang,warned", [
    ("3.6.0", (9, 0), None, True),       # the H200 of docs/device_checks/qwen3_5_cuda.md
    ("3.4.0", (9, 0), None, True),
    ("3.7.0", (9, 0), None, True),
    ("3.7.1", (9, 0), None, False),      # fixed upstream
    ("3.8.0", (9, 0), None, False),      # what torch 2.14.1 brings
    ("3.6.0", (9, 0), "0.1.12", False),  # tilelang backend
    ("3.6.0", (10, 0), None, False),     # Blackwell is not affected
    ("3.3.1", (9, 0), None, False),
])
def test_fla_triton_rule_on_hopper(triton, cap, tilelang, warned):
    requires = {**REQUIRES, "torch": []}  # isolate the fla rule from torch's own triton pin
    report = env.check_environment(True, versions={**GOOD, "triton": triton, "tilelang": tilelang},
                                   requires=requires, runtime={**H200, "capability": cap})
    assert report.ok  # a fallback exists: never an error
    assert any("flash-linear-attention" in f.what and f"Triton {triton}" in f.what
               for f in report.findings) == warned


def test_gpu_job_without_cuda_or_nccl_is_refused_cpu_check_is_not():
    no_gpu = run(runtime=CPU)
    whats = [f.what for f in no_gpu.errors]
    assert any("CUDA is not available: torch is a CPU build" in w for w in whats)
    assert any("no NCCL backend" in w for w in whats)
    assert run(require_gpu=False, runtime=CPU).ok
    hidden = run(runtime={**CPU, "torch_cuda": "13.0", "nccl_available": True})
    assert [f.what for f in hidden.errors] == [
        "a GPU job but CUDA is not available: torch (CUDA 13.0) sees no GPU (driver, CUDA_VISIBLE_DEVICES, "
        "container --gpus)"]


def test_all_errors_are_reported_at_once():
    report = run(torch="2.11.0", **{"megatron-core": "0.18.2"}, runtime=CPU)
    assert len(report.errors) == 5  # sglang->torch, sglang-kernel->torch, megatron-core, CUDA, NCCL


def test_this_machine_real_metadata():
    """The real readers on this (CPU) venv: versions and Requires-Dist come from importlib.metadata,
    nothing here violates a declared pin, megatron-core 0.19.2 (Python 3.12) is accepted."""
    versions = env.installed_versions()
    assert versions["megatron-core"] == cpu_compat.megatron_core_version() == LOCKED_MCORE
    assert versions["torch"] is not None
    requires = env.installed_requires(versions)
    assert any(r.startswith("torch") for r in requires["megatron-core"])
    report = env.check_environment(False, raise_on_error=False)
    assert report.ok, report.format()


def test_cli_exit_codes_and_json(capsys):
    """`s3ac-env` (env.main): the versions-only check passes here; the GPU check fails (no CUDA) and
    says what to fix."""
    assert env.main(["--no-gpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True and data["versions"]["megatron-core"] == LOCKED_MCORE
    assert env.main([]) == 1
    out = capsys.readouterr().out
    assert "ERROR: a GPU job but CUDA is not available" in out and "fix:" in out


@pytest.mark.slow
def test_module_entry_point():
    """`python -m megatron_s3ac.env` in a fresh interpreter (slow only because it imports torch)."""
    run = subprocess.run([sys.executable, "-m", "megatron_s3ac.env", "--no-gpu", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["ok"] is True


def test_cpu_shim_refuses_unsupported_megatron_core():
    assert cpu_compat.require_supported_megatron() == LOCKED_MCORE  # the installed one
    for good in ("0.19.2", "0.19.2+ba40176"):  # 0.19.2 appends the enclosing checkout's commit
        assert cpu_compat.require_supported_megatron(good) == good
    for bad in ("0.16.1", "0.16.1+local", "0.17.1", "0.18.2", "0.19.1", "0.20.0", "0.16.0", "garbage"):
        with pytest.raises(cpu_compat.UnsupportedMegatronCore, match=re.escape(f"megatron-core {bad} is installed")):
            cpu_compat.require_supported_megatron(bad)


def test_vllm_in_the_trainer_environment_is_refused_naming_its_pins():
    """vllm 0.32.0's METADATA: torch==2.13.0, transformers<5.20.0,>=5.16.1: the engine gets its own environment."""
    req = {**REQUIRES, "vllm": ["torch==2.13.0", "transformers<5.20.0,>=5.16.1", "flashinfer-python==0.7.0.post1"]}
    report = env.check_environment(True, versions={**GOOD, "vllm": "0.32.0"}, requires=req, runtime=H200,
                                   raise_on_error=False)
    text = " | ".join(f.what + " -> " + f.fix for f in report.findings)
    assert "vllm 0.32.0 requires torch==2.13.0, but torch 2.14.1 is installed" in text
    assert "vllm 0.32.0 is installed in the trainer's environment" in text and "rollout.vllm.python" in text

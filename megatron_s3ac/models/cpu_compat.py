"""Run megatron-core 0.19.2 (Python 3.12) on CPU (gloo) when CUDA is absent.

megatron-core assumes a GPU in a handful of places (see ../shared/notes/megatron_on_cpu.md):
direct ``torch.cuda.*`` calls (current_device, synchronize, streams, CUDA RNG state), hard-coded
``device="cuda"`` literals inside schedules and mask helpers, and a ``torch.cuda.Stream()`` built by the
all-to-all dispatcher. (Without Transformer Engine megatron defines ``moe_utils.te_general_gemm`` as None
itself, ``megatron/core/transformer/moe/moe_utils.py:41-53``: no shim; 0.16.1 needed one.)

``enable()`` neutralises exactly those, without editing megatron-core:
  * ``torch.cuda`` functions megatron calls become CPU-safe stand-ins (streams are no-ops, the "CUDA"
    RNG state is a CPU generator state so ``get_cuda_rng_tracker().fork()`` works);
  * a ``TorchFunctionMode`` rewrites any CUDA ``device=`` argument (``"cuda"``, ``cuda:N``, an int)
    to CPU, drops ``pin_memory=True``, makes ``Tensor.cuda()`` a no-op, and reports CPU tensors' ``Tensor.type()`` as the CUDA
    type name the optimizers dispatch on.

``patch_missing_fla()`` binds torch kernels where megatron's Gated DeltaNet reads the
flash-linear-attention names (the package ``megatron/core/ssm/gated_delta_net/``, whose ``common.py`` and
``gdn.py`` each hold their own copies).

It is inert (returns False and changes nothing) when CUDA is available, so the same code runs on GPUs.
The function mode is per-thread; ``enable()`` enters it on the calling thread, which is also where CPU
autograd runs backward.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version
from torch.overrides import TorchFunctionMode

_STATE = {"enabled": False}
_LOCAL = threading.local()

# The megatron-core release this shim (and the models built on it) is written against: 0.19.2, on
# Python 3.12 (docs/environment.md, "megatron-core"; 0.16.1 on Python 3.11 was dropped). Others are
# refused up front: 0.17 / 0.18 are untested (0.18's Gated DeltaNet is not yet 0.19's package layout
# that ``patch_missing_fla`` patches), and a newer release may move the internals patched here again.
MCORE_SUPPORTED = SpecifierSet(">=0.19.2,<0.20")
MCORE_WHY = ("megatron_s3ac is written and tested against megatron-core 0.19.2 (Python 3.12): RouterReplay, "
             "the Gated DeltaNet internals it overrides, torch_dist checkpoints, this CPU shim; "
             "0.16.1 (Python 3.11) is no longer supported, 0.17 / 0.18 are untested")
MCORE_FIX = "pip install megatron-core==0.19.2 (Python 3.12)"


class UnsupportedMegatronCore(RuntimeError):
    """The installed megatron-core is outside ``MCORE_SUPPORTED``."""


def megatron_core_version() -> str:
    """The installed release, as its wheel's metadata names it. (0.19.2's ``package_info.__version__``
    appends ``+<hash>`` of whatever git checkout its site-packages lies in unless ``NO_VCS_VERSION=1``,
    ``megatron/core/package_info.py:20-32``: inside this repository's ``.venv`` it would name this
    repository's commit, not megatron's; the Makefile's ``.pth`` sets the variable.)"""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:  # a source checkout on sys.path
        from megatron.core import package_info

        return package_info.__version__


def require_supported_megatron(version: str | None = None) -> str:
    """Raise ``UnsupportedMegatronCore`` naming the installed version unless it is supported; returns it.
    Called by ``enable`` and ``patch_missing_fla`` before they touch megatron-core internals."""
    found = megatron_core_version() if version is None else version
    try:
        ok = MCORE_SUPPORTED.contains(Version(Version(found).public), prereleases=True)
    except InvalidVersion:
        ok = False
    if not ok:
        raise UnsupportedMegatronCore(
            f"megatron-core {found} is installed; supported: {MCORE_SUPPORTED} ({MCORE_WHY}). "
            f"Fix: {MCORE_FIX}")
    return found


def cuda_available() -> bool:
    return torch.cuda.is_available() and os.environ.get("S3AC_FORCE_CPU", "0") != "1"


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, bool):
        return False
    if isinstance(dev, int):
        return True
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # no pinned allocator without CUDA (rope_utils' CP index tensor)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers dispatch on 'torch.cuda.FloatTensor' etc.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _NoStream:
    """Stand-in for torch.cuda.Stream/Event: every operation is a no-op on CPU."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NoStream()

    def record(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, *a):
        return 0.0


# The "CUDA" RNG that megatron's tracker forks and restores. A generator of its own, so forking it
# leaves the CPU RNG untouched (megatron checks that). CPU dropout does not draw from it: dropout is 0
# in RL training.
_FAKE_CUDA_GEN = torch.Generator()


def _to_cpu_splits(tensor, as_numpy: bool = False, record_stream: bool = False):
    # megatron converts split sizes to numpy only when they were on the GPU; on CPU they stay tensors,
    # which all_to_all_single rejects.
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


def _patch_torch_cuda():
    c = torch.cuda
    # A torch.device, not an int: megatron passes it as ``device=`` inside autograd backward
    # functions, which run while the function mode is popped (a mode never sees its own handler's calls).
    c.current_device = lambda: torch.device("cpu")
    c.synchronize = lambda *a, **k: None
    c.Stream = _NoStream
    c.Event = _NoStream
    c.current_stream = lambda *a, **k: _NoStream()
    c.default_stream = lambda *a, **k: _NoStream()
    c.stream = lambda *a, **k: contextlib.nullcontext()
    c.empty_cache = lambda: None
    c.set_device = lambda *a, **k: None
    c.device_count = lambda: 0
    # The "CUDA" RNG is a CPU generator: the tracker forks/restores it like the real one.
    c.get_rng_state = lambda *a, **k: _FAKE_CUDA_GEN.get_state()
    c.set_rng_state = lambda state, *a, **k: _FAKE_CUDA_GEN.set_state(state)
    c.manual_seed = lambda seed: _FAKE_CUDA_GEN.manual_seed(int(seed))
    c.manual_seed_all = lambda seed: None  # torch.manual_seed calls it after seeding the CPU generator
    c.random.get_rng_state = c.get_rng_state
    c.random.set_rng_state = c.set_rng_state


def _patch_megatron():
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    from megatron.core.transformer.moe import token_dispatcher

    mrandom._get_cuda_rng_state = lambda *a, **k: _FAKE_CUDA_GEN.get_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: _FAKE_CUDA_GEN.set_state(state)
    # Weight init draws from the CPU RNG inside the tracker's fork; on GPU that RNG is a different
    # device's, on CPU it is the same one, so megatron's "CPU RNG state changed" warning is noise here.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)
    moe_utils.maybe_move_tensor_to_cpu = _to_cpu_splits
    token_dispatcher.maybe_move_tensor_to_cpu = _to_cpu_splits


def enter_device_mode() -> None:
    """Enter the CPU device mode on the calling thread (idempotent)."""
    if getattr(_LOCAL, "mode", None) is None:
        _LOCAL.mode = _CpuDeviceMode()
        _LOCAL.mode.__enter__()


def enable() -> bool:
    """Make megatron-core CPU-safe in this process. Returns True if the CPU shim is active (only
    without CUDA: on a GPU it changes nothing). Raises ``UnsupportedMegatronCore`` first if
    megatron-core is not a supported release."""
    if not _STATE.get("version_ok"):
        require_supported_megatron()
        _STATE["version_ok"] = True
    if cuda_available():
        return False
    if not _STATE["enabled"]:
        _patch_torch_cuda()
        _patch_megatron()
        _STATE["enabled"] = True
    enter_device_mode()
    return True


def is_enabled() -> bool:
    return _STATE["enabled"]


# ---- Gated DeltaNet without flash-linear-attention (Qwen3.5-MoE) ----------------------------------
def have_fla() -> bool:
    """Whether flash-linear-attention (fla: Triton kernels for the gated delta rule) is importable."""
    try:
        import fla.modules.l2norm  # noqa: F401
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:
        return False
    return True


def _torch_l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm (``x / sqrt(sum(x^2) + eps)``), computed in fp32 like fla's kernel and transformers'
    reference, and *returned* in fp32: the torch kernel below works in fp32 anyway, so q / k are not
    rounded back to bf16 in between (as in transformers, which normalises inside its fp32 kernel).
    A no-op cast for fp32 inputs."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _torch_chunk_gated_delta_rule(query, key, value, g, beta, **kwargs):
    """megatron's ``torch_chunk_gated_delta_rule`` (the transformers reference algorithm: inputs, chunk
    products and the recurrent state in fp32), with the output cast to ``value``'s dtype, i.e. the
    model's (q / k arrive in fp32 from ``_torch_l2norm``). fla returns the input dtype too."""
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    out, state = torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, **kwargs)
    return out.to(value.dtype), state


def torch_gdn_in_use() -> bool:
    """Whether ``patch_missing_fla`` bound the torch GDN kernels (fla absent or refused)."""
    from megatron.core.ssm import gated_delta_net as gdn

    return bool(getattr(gdn, "_s3ac_torch_path", False))


def fla_refusal() -> str | None:
    """Why fla cannot be used on this machine although it imports, or None.

    fla 0.6 refuses its gated-delta-rule backward with 3.4 <= Triton < 3.7.1 on Hopper unless
    tilelang is installed (wrong results upstream; seen on an H200 with Triton 3.6)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return None
    try:
        import triton
        from packaging.version import Version
    except Exception:
        return None
    v = Version(triton.__version__.split("+")[0])
    if not Version("3.4.0") <= v < Version("3.7.1"):
        return None
    try:
        import tilelang  # noqa: F401
        return None
    except Exception:
        return f"Triton {v} on a Hopper GPU without tilelang"


def _torch_causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None, **kwargs):
    """fla's ``causal_conv1d`` (the call megatron-core 0.19.2 makes, ``ssm/gated_delta_net/gdn.py:214-222``)
    in torch: x [b, s, d], weight [d, w] (depthwise), the same zero left-padding as megatron's own
    ``nn.Conv1d(padding=w-1)`` path (``gdn.py:199-211``), then SiLU; returns
    (y [b, s, d], None). Neither packed sequences (``cu_seqlens``) nor a carried conv state (inference)."""
    import torch.nn.functional as F

    if cu_seqlens is not None or initial_state is not None or output_final_state:
        raise NotImplementedError("torch causal_conv1d: no cu_seqlens / initial_state / final state (fla only)")
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"torch causal_conv1d: activation {activation!r}")
    seq_len, width = x.shape[1], weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=weight.shape[0])
    y = y[..., :seq_len]
    if activation is not None:
        y = F.silu(y)
    return y.transpose(1, 2), None


def _gdn_kernel_modules():
    """The modules whose globals megatron's Gated DeltaNet reads the fla names from, and the flag's home.

    The package ``megatron/core/ssm/gated_delta_net/`` imports them into three namespaces: ``common.py:43-54`` (the fla try-import; ``HAVE_FLA`` is checked by
    ``_GDNBase.__init__``, ``common.py:141-145``; ``l2norm`` is read by ``_prepare_input_for_gated_delta_rule``,
    ``common.py:411``), ``gdn.py:17-26`` (``from common import causal_conv1d, chunk_gated_delta_rule``: read
    by ``GatedDeltaNet._setup_variant_attrs``, ``gdn.py:59-62``, and ``forward``, ``gdn.py:214``) and the
    package ``__init__.py:9-19`` (re-exports)."""
    from megatron.core.ssm import gated_delta_net as pkg
    from megatron.core.ssm.gated_delta_net import common, gdn

    return pkg, [pkg, common, gdn]


def patch_missing_fla() -> bool:
    """megatron-core's ``GatedDeltaNet`` raises ImportError without fla and its forward then
    calls the fla names ``l2norm`` / ``chunk_gated_delta_rule`` (``l2norm`` is never defined). When
    fla is absent (CPU, or a GPU without the wheel) bind those module names to torch versions:
    ``l2norm`` and ``chunk_gated_delta_rule`` to the fp32 torch versions above (megatron's own
    ``torch_chunk_gated_delta_rule``, the transformers reference algorithm, wrapped), and let the
    constructor pass. Precision: under bf16 the normalised q / k, the chunk products and the
    recurrent state are fp32 and only the kernel's output is cast back (the decay ``g`` is fp32 too,
    see ``qwen3_5_spec.TorchGatedDeltaNet``); in fp32 nothing changes. The causal conv1d is fla's
    ``causal_conv1d`` outside deterministic mode, so it is bound to ``_torch_causal_conv1d`` (the same
    convolution).
    The names are bound in every module that reads them (``_gdn_kernel_modules``). Applied on CPU and GPU alike;
    a no-op when fla is installed and usable (see ``fla_refusal``). Returns True if the torch path
    is in use."""
    if not _STATE.get("version_ok"):
        require_supported_megatron()
        _STATE["version_ok"] = True
    pkg, mods = _gdn_kernel_modules()
    if getattr(pkg, "_s3ac_torch_path", False):
        return True
    if pkg.HAVE_FLA:
        why = fla_refusal()
        if why is None:
            return False
        logging.getLogger(__name__).warning("flash-linear-attention not used (%s): torch GDN kernel instead", why)
    for mod in mods:
        mod.l2norm = _torch_l2norm
        mod.chunk_gated_delta_rule = _torch_chunk_gated_delta_rule
        if hasattr(mod, "causal_conv1d"):  # the conv is fla's unless deterministic_mode (gdn.py:199-222)
            mod.causal_conv1d = _torch_causal_conv1d
        mod.HAVE_FLA = True  # only lets __init__ pass: the names above are the torch kernels
    pkg._s3ac_torch_path = True
    return True

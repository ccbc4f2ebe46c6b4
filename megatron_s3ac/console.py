"""A quiet console: silence the library warnings every run prints and nobody can act on.

``silence_known_warnings()`` is called first thing by every CLI entry point (s3ac-train, s3ac-eval,
s3ac-convert, s3ac-plan, s3ac-env). Each filter below matches one known message (a literal prefix,
category, and where narrower is possible the module the warning is attributed to) and says why hiding it
is safe. Nothing else is filtered: a new warning still shows. The same filters go into PYTHONWARNINGS,
so the processes a CLI starts (torchrun ranks, reward-pool workers, Ray actors) inherit them.
``S3AC_SHOW_WARNINGS=1`` turns all of this off (e.g. when upgrading megatron-core or torch).

Pure python (no torch / megatron import): importable from any floor.
"""
from __future__ import annotations

import dataclasses
import os
import re
import warnings

SHOW_ENV = "S3AC_SHOW_WARNINGS"


@dataclasses.dataclass(frozen=True)
class Known:
    message: str  # literal start of the warning's text (no commas: PYTHONWARNINGS is comma-separated)
    category: type
    modules: tuple = ()  # modules the warning is attributed to (exact names); () = any
    why: str = ""


KNOWN = (
    Known("Apex is not installed", UserWarning, (),
          "megatron-core (models/backends.py, gpt_layer_specs.py) falls back to torch's own norm layers; the "
          "CPU path is built on them and s3ac-env reports whether Apex / TE are present"),
    Known("Transformer Engine and Apex are not installed", UserWarning, (),
          "megatron-core (optimizer/__init__.py, optimizer.py, clip_grads.py, megatron_fsdp) falls back to "
          "torch optimizers and multi_tensor_* reference kernels: what the CPU path runs on purpose"),
    Known("`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning, (),
          "torch 2.14 deprecates the API megatron-core 0.19.2 calls for its distributed optimizer's and "
          "tensor-parallel collectives (distributed/param_and_grad_buffer.py:50-51, "
          "tensor_parallel/mappings.py:12-13); nothing in this project calls it and the call still works"),
    Known("`torch.distributed.reduce_scatter_tensor` is deprecated", FutureWarning, (),
          "as all_gather_into_tensor: megatron-core's gradient reduce-scatter, a deprecation only"),
    Known("full scope is deprecated", UserWarning, ("megatron.core.transformer.transformer_config",),
          "megatron-core 0.19.2's own TransformerConfig default cuda_graph_modules='full' (transformer_config.py:1047) "
          "triggers its own deprecation notice in __post_init__ (transformer_config.py:2414-2418); CUDA graphs are off "
          "here"),
    Known("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning,
          ("megatron.core.optimizer.optimizer", "megatron_s3ac.models.cpu_compat"),
          "megatron's DistributedOptimizer.zero_grad reads .grad of its fp32 shard views only to set it to None "
          "(optimizer.py:68 _zero_grad_group_helper via distrib_optimizer.py:2580-2586, marked 'throws grad-access "
          "warning' there). On CPU the read passes through cpu_compat's TorchFunctionMode, hence that module; the "
          "training gradients live in megatron's main_grad buffers, not in .grad"),
    Known("MimoModelConfig is experimental and still under active development.", UserWarning,
          ("megatron.core.models.mimo.config.base_configs",),
          "megatron-core 0.19.2 warns in MimoModelConfig's class body, at import (models/mimo/config/base_configs.py:"
          "36-41), whatever the model; this project builds no MIMO model"),
    Known("Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning, (),
          "torch's notice when megatron's dist_checkpointing builds ShardedTensors; checkpoints are unaffected"),
)


def _filters():
    for k in KNOWN:
        for module in k.modules or (None,):
            yield k, module


def silence_known_warnings() -> None:
    """Install the KNOWN filters in this process and export them to child processes (idempotent)."""
    if os.environ.get(SHOW_ENV, "") not in ("", "0"):
        return
    options = []
    for k, module in _filters():
        warnings.filterwarnings("ignore", message=re.escape(k.message), category=k.category,
                                module=re.escape(module) + r"\Z" if module else "")
        options.append(f"ignore:{k.message}:{k.category.__name__}" + (f":{module}" if module else ""))
    current = [o for o in os.environ.get("PYTHONWARNINGS", "").split(",") if o]
    os.environ["PYTHONWARNINGS"] = ",".join(current + [o for o in options if o not in current])

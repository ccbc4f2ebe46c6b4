"""HF <-> megatron-core checkpoint conversion: one mapping per architecture, three users.

* ``hf_to_mcore(hf_dir, out_dir, workers)``: offline, streaming HF safetensors -> torch_dist.
* ``mcore_to_hf(mcore_dir, out_dir, hf_config)``: offline, streaming torch_dist -> HF safetensors.
* ``export_hf_weights(model_chunks, info, bucket_bytes)``: live sharded model -> HF tensors.
* ``verify.verify(hf_dir, mcore_dir, tp, pp, ep)``: transformers vs megatron logits (own module:
  it imports transformers).
The mapping itself is a ``Plan`` (``plan.py``) built per HF model_type (``qwen.py``).
Other names are imported on first use (PEP 562), so ``import megatron_s3ac.convert.<module>`` (the CLI)
pays only for what that module needs. ``hf_to_mcore`` and ``mcore_to_hf`` are bound eagerly: they share
their submodule's name, and the import system sets the package attribute to the *submodule* whenever
that submodule is first imported (``mcore_to_hf.py`` imports ``hf_to_mcore.py``), after which
``from megatron_s3ac.convert import hf_to_mcore`` would return the module, not the function (both are
torch-free; ``importlib.import_module("megatron_s3ac.convert.hf_to_mcore")`` still gives the module).
"""
import importlib

# the built-in architectures' plans (plan.register_plan), registered when the package is imported
from megatron_s3ac.convert import qwen as _qwen, qwen3_5 as _qwen3_5  # noqa: F401,E402
# after the submodule imports above set the attributes to the modules: rebind them to the functions
from megatron_s3ac.convert.hf_to_mcore import hf_to_mcore  # noqa: E402
from megatron_s3ac.convert.mcore_to_hf import mcore_to_hf  # noqa: E402

_WHERE = {"Chunk": "plan", "ConversionError": "plan", "Part": "plan", "Plan": "plan", "build_plan": "plan",
          "register_plan": "plan", "ConvertStats": "hf_to_mcore",
          "export_hf_weights": "export"}


def __getattr__(name):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


__all__ = ["Chunk", "ConversionError", "ConvertStats", "Part", "Plan", "build_plan", "export_hf_weights",
           "hf_to_mcore", "mcore_to_hf", "register_plan"]


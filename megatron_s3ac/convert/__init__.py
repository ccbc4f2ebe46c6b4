"""HF <-> megatron-core checkpoint conversion: one mapping per architecture, three users.

* ``hf_to_mcore(hf_dir, out_dir, workers)``: offline, streaming HF safetensors -> torch_dist.
* ``mcore_to_hf(mcore_dir, out_dir, hf_config)``: offline, streaming torch_dist -> HF safetensors.
* ``export_hf_weights(model_chunks, info, bucket_bytes)``: live sharded model -> HF tensors.
* ``verify.verify(hf_dir, mcore_dir, tp, pp, ep)``: transformers vs megatron logits (own module:
  it imports transformers).
The mapping itself is a ``Plan`` (``plan.py``) built per HF model_type (``qwen.py``).
"""
from megatron_s3ac.convert.plan import Chunk, ConversionError, Part, Plan, build_plan, register_plan
from megatron_s3ac.convert.hf_to_mcore import ConvertStats, hf_to_mcore
from megatron_s3ac.convert.mcore_to_hf import mcore_to_hf
from megatron_s3ac.convert.export import export_hf_weights

__all__ = ["Chunk", "ConversionError", "ConvertStats", "Part", "Plan", "build_plan", "export_hf_weights",
           "hf_to_mcore", "mcore_to_hf", "register_plan"]


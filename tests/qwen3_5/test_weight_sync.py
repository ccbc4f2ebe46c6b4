"""Weight sync trainer -> CPU engine built from a vision-language Qwen3.5-MoE checkpoint.

Published Qwen3.5 / Intern-S2 checkpoints are ``Qwen3_5MoeForConditionalGeneration``: text weights
under ``model.language_model.``, the vision tower under ``model.visual.``, ``lm_head`` at the top. The
trainer's exporter names tensors like that checkpoint (convert/qwen3_5.py); the engine may hold the
full VL model (``multimodal=True``, like SGLang), transformers' text-only causal LM of it (default,
in-memory names ``model.*``), or be built from the config (the trainer loop without
``engine_hf_dir``). In every case, after a sync of the perturbed trainer the engine's log-probs of a
fixed sequence equal the trainer's within 1e-5, and the vision weights are untouched.
"""
import pytest
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from tests.qwen3_5.sync_ranks import KINDS, vl_sync

TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
CLASSES = {"multimodal": "Qwen3_5MoeForConditionalGeneration", "text": "Qwen3_5MoeForCausalLM",
           "config": "Qwen3_5MoeForCausalLM", "config_multimodal": "Qwen3_5MoeForConditionalGeneration"}


def _text_tensor_bytes(hf_dir):
    import glob

    from safetensors import safe_open

    n = total = 0
    for f in glob.glob(f"{hf_dir}/*.safetensors"):
        with safe_open(f, "pt") as sf:
            for k in sf.keys():
                if not k.startswith("model.visual."):
                    n += 1
                    total += sf.get_tensor(k).nbytes
    return n, total


def _check(results, engine_rank, kinds, hf_dir):
    trainer = next(r["trainer"] for r in results if r["trainer"] is not None)
    n_text, text_bytes = _text_tensor_bytes(hf_dir)
    for kind in kinds:
        res = results[engine_rank][kind]
        assert res["class"] == CLASSES[kind]
        diff = (res["after"] - trainer).abs().max().item()
        print(f"{kind}: engine vs trainer log-prob diff {diff:.2e}, {res['n_visual']} vision tensors")
        assert diff < 1e-5, (kind, diff)
        assert (res["before"] - res["after"]).abs().max().item() > 1e-2  # the perturbation arrived
        assert res["visual_untouched"]
        assert res["n_visual"] == (21 if "multimodal" in kind else 0)
        st = res["stats"]
        assert st.engine_rank == engine_rank and st.tensors == n_text and st.bytes == text_bytes
        assert all(kind not in r for i, r in enumerate(results) if i != engine_rank)


def test_sync_into_engines_of_a_vl_checkpoint(q35_hf, q35_mcore):
    results = run_distributed(vl_sync, 1, q35_hf["vl"], q35_mcore["vl"], 1, 1, 0, KINDS, TOKENS, 20_000)
    _check(results, 0, KINDS, q35_hf["vl"])


def test_sync_ep2_into_vl_engine_on_rank1(q35_hf, q35_mcore):
    """EP=2, the engine on rank 1 (not the export leader: its buckets come from rank 0)."""
    kinds = ("multimodal", "config")
    results = run_distributed(vl_sync, 2, q35_hf["vl"], q35_mcore["vl"], 1, 2, 1, kinds, TOKENS, 20_000)
    _check(results, 1, kinds, q35_hf["vl"])


def test_engine_accepts_both_text_prefixes():
    """The engine resolves a text tensor under either HF prefix onto whichever class it holds; names
    outside the text model are not rewritten."""
    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
    from megatron_s3ac.models.tiny_qwen3_5 import tiny_qwen3_5_config

    cfg = tiny_qwen3_5_config("vl")
    w = torch.full((8, 64), 0.25)
    for multimodal, mem in ((False, "model."), (True, "model.language_model.")):
        engine = CPUEngine.from_config(cfg, multimodal=multimodal)
        params = dict(engine.model.named_parameters())
        for i, prefix in enumerate(("model.language_model.", "model.")):
            engine.update_weights([(f"{prefix}layers.{i}.mlp.gate.weight", w + i)])
            assert torch.equal(params[f"{mem}layers.{i}.mlp.gate.weight"], w + i)
        engine.update_weights([("lm_head.weight", torch.zeros(96, 64))])
        assert params["lm_head.weight"].abs().sum() == 0
        visual = "model.visual.patch_embed.proj.bias"
        if multimodal:
            engine.update_weights([(visual, torch.ones(16))])
            assert torch.equal(params[visual], torch.ones(16))
        else:
            with pytest.raises(KeyError):
                engine.update_weights([(visual, torch.ones(16))])
        with pytest.raises(KeyError):
            engine.update_weights([("model.language_model.layers.0.mlp.nonexistent.weight", w)])

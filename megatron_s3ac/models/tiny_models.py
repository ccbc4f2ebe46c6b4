"""Tiny random models built with transformers' config classes and saved in the hub layout.

Nothing is downloaded: ``save_tiny_hf(model_type, out_dir)`` writes ``config.json`` +
``model.safetensors`` (+ ``generation_config.json``) exactly as ``save_pretrained`` does for real
checkpoints, so the converter, the engines and the trainer read them through the same code path.
"""
from __future__ import annotations

import os

import torch

TINY = {
    "qwen2": dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0),
    "qwen3": dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0),
    "qwen3_moe": dict(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], max_position_embeddings=256, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, rope_theta=10000.0),
}


def tiny_config(model_type: str, **overrides):
    """A transformers config object for a tiny model of ``model_type``."""
    from transformers import AutoConfig

    kw = dict(TINY[model_type])
    kw.update(overrides)
    theta = kw.pop("rope_theta", 10000.0)
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return cfg


def tiny_hf_model(model_type: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A randomly initialised transformers CausalLM (eval mode). Norm weights are randomised too,
    so a wrong mapping of any tensor shows up in the logits."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
    return model.eval()


def save_tiny_hf(model_type: str, out_dir: str, seed: int = 0, **overrides) -> str:
    """Write a tiny random checkpoint in the hub safetensors layout; returns ``out_dir``."""
    model = tiny_hf_model(model_type, seed=seed, **overrides)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def char_tokenizer(chars: str = "0123456789+="):
    """A real HF fast tokenizer with one token per character; ids 0/1/2 are <pad>/<eos>/<bos>,
    unknown characters map to <pad>. For tiny arithmetic/text models in tests and demos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def next_token_nll(info, logits, ids):
    """Mean next-token negative log-likelihood (fp32) of ``ids`` [B, T] under ``logits`` [B, T, V_padded];
    the padded vocabulary columns are cut to ``info.vocab_size`` (the device checks' reference loss)."""
    import torch

    lp = torch.log_softmax(logits[..., :info.vocab_size].float(), -1)
    return -lp[:, :-1].gather(-1, ids[:, 1:, None]).mean()

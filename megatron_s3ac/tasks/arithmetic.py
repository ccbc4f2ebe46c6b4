"""The CPU demo's task "a+b=": its reward "arithmetic" (registered by rollout.rewards from ``tasks.REWARDS``,
inline: a regex on the response's first 64 characters).

Its prompts (``arithmetic_prompts``, over data.prompts' ``CharVocab``), the demo model
(``tiny_arithmetic_hf_config``) and that model for another character-vocabulary task (``tiny_task_hf_config``).
"""
from __future__ import annotations

import re

from megatron_s3ac.data.prompts import BOS, EOS, PAD, CharVocab, Prompt

REWARD = "arithmetic"
_SUM_PROMPT = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*=\s*$")
_LEADING_DIGITS = re.compile(r"\s*(\d+)")


def arithmetic_reference(prompt: str) -> str:
    """"12+34=" -> "46"."""
    m = _SUM_PROMPT.match(prompt)
    if m is None:
        raise ValueError(f"not an 'a+b=' prompt: {prompt!r}")
    return str(int(m.group(1)) + int(m.group(2)))


def arithmetic_reward(response: str, reference: str) -> float:
    """+1 iff the digits the response starts with equal the reference sum, else -1."""
    m = _LEADING_DIGITS.match(response[:64])
    return 1.0 if m is not None and m.group(1) == str(int(reference)) else -1.0


def tiny_arithmetic_hf_config():
    """The demo model: Qwen3-MoE architecture, 2 layers, hidden 64, 4 experts top-2 (~126K params)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        "qwen3_moe", vocab_size=CharVocab().size, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    return cfg


def tiny_task_hf_config(vocab: CharVocab, max_prompt_tokens: int, max_response_tokens: int):
    """The demo model for a character-vocabulary task (tasks.multistep, tasks.chain): its
    vocabulary, and positions for the longest prompt + response (at least the demo's 64)."""
    cfg = tiny_arithmetic_hf_config()
    cfg.vocab_size = vocab.size
    cfg.max_position_embeddings = max(64, max_prompt_tokens + max_response_tokens)
    return cfg


def arithmetic_prompts(n: int, max_operand: int, seed: int, vocab: CharVocab | None = None,
                       exclude: set[str] | None = None) -> list[Prompt]:
    """n distinct "a+b=" prompts with a, b uniform in [0, max_operand] (seeded), minus ``exclude``."""
    import torch

    vocab = vocab or CharVocab()
    g = torch.Generator().manual_seed(seed)
    out, seen = [], set(exclude or ())
    limit = (max_operand + 1) ** 2
    while len(out) < n and len(seen) < limit:
        a, b = torch.randint(0, max_operand + 1, (2,), generator=g).tolist()
        text = f"{a}+{b}="
        if text in seen:
            continue
        seen.add(text)
        out.append(Prompt([BOS] + vocab.encode(text), text, str(a + b)))
    return out

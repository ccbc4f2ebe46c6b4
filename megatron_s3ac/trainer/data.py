"""Prompt sets: the synthetic "a+b=" task (character vocabulary) and math sets from jsonl/parquet.

A prompt set is a list of ``Prompt(ids, text, reference)``. ``PromptStream`` yields prompt indices
in a seeded order (one permutation per epoch); its state is two ints, so a checkpoint restores it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

# ---- the CPU demo's task ---------------------------------------------------------------------
ARITH_CHARS = "0123456789+="
PAD, BOS, EOS = 0, 1, 2  # special ids; characters start at 3


class CharVocab:
    """Tokenizer-free vocabulary for the arithmetic task: 3 specials + digits, '+', '=' (15 ids)."""

    def __init__(self, chars: str = ARITH_CHARS):
        self.chars = chars
        self.size = 3 + len(chars)
        self._ids = {c: 3 + i for i, c in enumerate(chars)}

    def encode(self, s: str) -> list[int]:
        return [self._ids[c] for c in s]

    def decode(self, ids) -> str:
        return "".join(self.chars[i - 3] for i in ids if 3 <= i < self.size)


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
    """The demo model for a character-vocabulary task (trainer.tasks_multistep, trainer.tasks_chain): its
    vocabulary, and positions for the longest prompt + response (at least the demo's 64)."""
    cfg = tiny_arithmetic_hf_config()
    cfg.vocab_size = vocab.size
    cfg.max_position_embeddings = max(64, max_prompt_tokens + max_response_tokens)
    return cfg


@dataclass
class Prompt:
    ids: list[int]
    text: str
    reference: str


def arithmetic_prompts(n: int, max_operand: int, seed: int, vocab: CharVocab | None = None,
                       exclude: set[str] | None = None) -> list[Prompt]:
    """n distinct "a+b=" prompts with a, b uniform in [0, max_operand] (seeded), minus ``exclude``."""
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


# ---- math prompt sets (DAPO-Math-17k, MATH-1460) -----------------------------------------------
def _read_rows(path: str) -> list[dict]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                rows.append(None)  # counted as malformed below
    return rows


def _extract(row) -> tuple[object, str] | None:
    """(prompt: str or chat messages, reference) from one row of either schema, or None.

    DAPO-Math-17k (verl layout): prompt = [{"role": "user", "content": ...}],
    reward_model = {"ground_truth": ...}. MATH-1460 style: problem / answer (or question / answer).
    """
    if not isinstance(row, dict):
        return None
    prompt = row.get("prompt", row.get("problem", row.get("question")))
    ref = row.get("answer", row.get("solution_answer"))
    if ref is None and isinstance(row.get("reward_model"), dict):
        ref = row["reward_model"].get("ground_truth")
    if isinstance(prompt, str):
        ok = bool(prompt.strip())
    elif isinstance(prompt, (list, tuple)):
        ok = len(prompt) > 0 and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt)
    else:
        ok = False
    if not ok or ref is None or str(ref).strip() == "":
        return None
    return prompt, str(ref)


def load_math_prompts(path: str, tokenizer, max_prompt_tokens: int, apply_chat_template: bool = True
                      ) -> tuple[list[Prompt], dict]:
    """Prompts from a local jsonl/parquet file; malformed or too-long rows are skipped and counted."""
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    rows = _read_rows(path)
    prompts, stats = [], {"rows": len(rows), "malformed": 0, "too_long": 0}
    for row in rows:
        got = _extract(row)
        if got is None:
            stats["malformed"] += 1
            continue
        prompt, ref = got
        msgs = prompt if isinstance(prompt, (list, tuple)) else [{"role": "user", "content": prompt}]
        if apply_chat_template and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=True)
        else:
            text = "\n".join(m["content"] for m in msgs)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_tokens:
            stats["too_long"] += 1
            continue
        prompts.append(Prompt(list(ids), text, ref))
    stats["kept"] = len(prompts)
    return prompts, stats


class PromptStream:
    """Endless seeded stream of prompt indices: a fresh permutation every epoch. State = (epoch, pos)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0
        self._perm = self._make_perm()

    def _make_perm(self) -> torch.Tensor:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100003 + self.epoch))

    def take(self, k: int) -> torch.Tensor:
        out = []
        while k > 0:
            chunk = self._perm[self.pos:self.pos + k]
            out.append(chunk)
            self.pos += len(chunk)
            k -= len(chunk)
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._make_perm()
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, s: dict) -> None:
        self.epoch, self.pos = int(s["epoch"]), int(s["pos"])
        self._perm = self._make_perm()


# ---- coverage data (value pretraining) -------------------------------------------------------
def write_coverage(path: str, records: list[dict]) -> None:
    """jsonl rows {prompt_ids, response_ids, reward, source}; appended atomically per call."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def read_coverage(path: str) -> tuple[list[dict], dict]:
    rows, bad = [], 0
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
                if r["prompt_ids"] and r["response_ids"] and r["reward"] in (-1, 1, -1.0, 1.0):
                    rows.append(r)
                    continue
            except (json.JSONDecodeError, KeyError, TypeError):
                pass
            bad += 1
    return rows, {"rows": len(rows), "malformed": bad}

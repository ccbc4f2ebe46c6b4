"""The critic's privileged input (BPCO critic notes sec. 3.6 / 4, eq. 13, Algorithm 1 line 12): V(s_t, q(x)).

The critic is discarded after training, so it may see what the policy never sees: the row's reference answer (and
its worked solution, ``model.critic_privileged: answer_and_solution``). Every critic forward reads

    prompt ids + block ids + response ids,   block = the fixed template below, tokenized on its own,

and the value of response position t is read where it is without the block (the output predicting response token
t), ``block`` positions later. Only the critic's batch changes (``critic_view``): the actor's batch, every engine
request and the evaluation are built before and without it. A row without the field gets the template's empty
form (an empty answer / solution) and is counted (``critic/privileged_missing``).

The templates (the text tokenizers' is read by an LLM critic; the character vocabularies' uses the only separator
every toy task has, ``=``):

    text:       "\\n\\n[Reference solution]\\n{solution}\\n[Reference answer]\\n{answer}\\n\\n"   (solution part only
                with answer_and_solution)
    characters: "{answer}="  (the toy tasks have no solution column)

R3 does not replay the critic's routing (the rollout engine never ran the critic's sequence; the critic routes
with its own router, as without the block), so the critic's view carries no routes.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch

from megatron_s3ac.trainer.step.batch import RolloutBatch

TEXT_ANSWER = "\n\n[Reference answer]\n{answer}\n\n"
TEXT_SOLUTION = "\n\n[Reference solution]\n{solution}\n[Reference answer]\n{answer}\n\n"
CHAR_ANSWER = "{answer}="


def block_text(mode: str, answer: Optional[str], solution: Optional[str], chars: bool) -> str:
    """The template filled with ``answer`` / ``solution`` (None -> the empty form)."""
    if chars:
        return CHAR_ANSWER.format(answer=answer or "")
    template = TEXT_SOLUTION if mode == "answer_and_solution" else TEXT_ANSWER
    return template.format(answer=answer or "", solution=solution or "")


def is_missing(mode: str, answer: Optional[str], solution: Optional[str], chars: bool) -> bool:
    """Whether a row lacks a field ``mode`` asks for (character tasks have no solution field to lack)."""
    return not answer or (mode == "answer_and_solution" and not chars and not solution)


class PrivilegedBlocks:
    """Block ids per reference. ``encode``: text -> ids (the task's vocabulary, no special tokens)."""

    def __init__(self, mode: str, encode: Callable[[str], list], chars: bool, max_tokens: int = 64):
        self.mode, self.encode, self.chars, self.max_tokens = mode, encode, chars, int(max_tokens)
        self._cache: dict = {}

    @classmethod
    def of(cls, mode: str, vocab, max_tokens: int = 64) -> Optional["PrivilegedBlocks"]:
        """None for ``none``; else blocks in ``vocab``'s ids (a ``CharVocab`` or an HF tokenizer), each at most
        ``max_tokens`` long (``model.critic_privileged_max_tokens``: what the planner assumed)."""
        mode = getattr(mode, "value", mode)
        if mode == "none":
            return None
        if hasattr(vocab, "chars"):
            return cls(mode, vocab.encode, True, max_tokens)
        return cls(mode, lambda text: list(vocab(text, add_special_tokens=False)["input_ids"]), False, max_tokens)

    def ids(self, answer: Optional[str], solution: Optional[str] = None) -> tuple[list, bool]:
        """(block ids [b], missing) of one row."""
        key = (answer, solution)
        if key not in self._cache:
            text = block_text(self.mode, answer, solution, self.chars)
            try:
                ids = list(self.encode(text))
            except (KeyError, ValueError) as err:
                raise ValueError(f"model.critic_privileged={self.mode}: the task's vocabulary cannot encode the "
                                 f"privileged block {text!r} ({type(err).__name__}: {err})") from None
            if len(ids) > self.max_tokens:
                raise ValueError(f"model.critic_privileged={self.mode}: the block of reference {answer!r} is "
                                 f"{len(ids)} tokens, above model.critic_privileged_max_tokens={self.max_tokens} "
                                 f"(the bound s3ac-plan sizes the critic's sequences by): raise it")
            self._cache[key] = (ids, is_missing(self.mode, answer, solution, self.chars))
        return self._cache[key]

    def of_prompts(self, prompts: Sequence) -> tuple[list, torch.Tensor]:
        """(block ids per prompt, missing [n] bool) for ``data.prompts.Prompt``s (.reference, .solution)."""
        got = [self.ids(p.reference, getattr(p, "solution", None)) for p in prompts]
        return [g[0] for g in got], torch.tensor([g[1] for g in got], dtype=torch.bool)


def critic_view(batch: RolloutBatch, blocks: Sequence[Sequence[int]], pad_to: int = 8) -> RolloutBatch:
    """``batch`` with ``blocks[i]`` inserted between row i's prompt and response: tokens [N, L'], ``prompt_len`` +
    len(block), ``idx`` shifted by it (the same response token t: its value is V(s_t, q(x))), every per-token
    field [N, T] unchanged, routes dropped (the critic's routing is its own). ``pad_to``: L' rounded up to it."""
    n = len(batch)
    if len(blocks) != n:
        raise ValueError(f"critic_view: {len(blocks)} blocks for {n} rows")
    dev = batch.tokens.device
    b = torch.tensor([len(x) for x in blocks], dtype=batch.prompt_len.dtype, device=batch.prompt_len.device)
    P, R = batch.prompt_len, batch.resp_len
    L = int(-(-int((P + b + R).max()) // pad_to) * pad_to)
    tokens = torch.zeros(n, L, dtype=batch.tokens.dtype, device=dev)
    for i in range(n):  # once per critic operation, per row: not a per-token hot path
        p, r = int(P[i]), int(R[i])
        blk = torch.as_tensor(list(blocks[i]), dtype=batch.tokens.dtype, device=dev)
        tokens[i, :p + len(blk) + r] = torch.cat([batch.tokens[i, :p], blk, batch.tokens[i, p:p + r]])
    T = batch.mask.shape[1]
    t = torch.arange(T, device=batch.idx.device)
    idx = ((P + b).to(batch.idx.device)[:, None] - 1 + t[None]).clamp(max=L - 1)
    return dataclasses.replace(batch, tokens=tokens, idx=idx, prompt_len=P + b, routes=None)

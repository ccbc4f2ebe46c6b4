"""Digit-chain tasks: CPU-sized prompts whose 12-32-token answers are chains (rollout/rewards/chain.py).

    cumsum   "3517="    -> "3896"       running sum mod 10 (o_t from o_{t-1} and d_t)
    add      "47+85="   -> "2131"       column addition, least-significant digit first, sum digit + carry
    reverse  "3517="    -> "7153"
    sort     "3517="    -> "1357"
    runsum   "3,5,1,7=" -> "3,8,9,16"   running sums (every intermediate result)

Reward "chain": +1 iff the whole chain is right. Difficulty knobs (ChainSpec): the kind and the chain
length, drawn uniformly per prompt from [min_len, max_len] (digits of the string; of each operand for
``add``; items for ``runsum``), so a set mixes short (easy) and long (hard) prompts as DAPS needs.
The same character-vocabulary machinery as the arithmetic task (trainer.data.CharVocab): "0123456789+="
keep their ids, "," is 15.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from megatron_s3ac.rollout.rewards.chain import ANSWERS, chain_answer
from megatron_s3ac.trainer.data import BOS, CharVocab, Prompt

CHAIN_CHARS = "0123456789+=,"
REWARD = "chain"


def _digit_string(g: torch.Generator, n: int) -> str:
    return "".join(str(d) for d in torch.randint(0, 10, (n,), generator=g).tolist())


# kind -> (prompt text of length n, answer characters of length n): the registered kinds
@dataclasses.dataclass(frozen=True)
class ChainKind:
    prompt: Callable[[torch.Generator, int], str]
    answer_chars: Callable[[int], int]  # longest answer of length n (characters, no <eos>)
    prompt_chars: Callable[[int], int]  # prompt of length n (characters)


KINDS: dict[str, ChainKind] = {
    "cumsum": ChainKind(lambda g, n: _digit_string(g, n) + "=", lambda n: n, lambda n: n + 1),
    "reverse": ChainKind(lambda g, n: _digit_string(g, n) + "=", lambda n: n, lambda n: n + 1),
    "sort": ChainKind(lambda g, n: _digit_string(g, n) + "=", lambda n: n, lambda n: n + 1),
    "add": ChainKind(lambda g, n: _digit_string(g, n) + "+" + _digit_string(g, n) + "=", lambda n: 2 * n,
                     lambda n: 2 * n + 2),
    # running sums of n single digits reach 9n: at most len(str(9n)) characters each, n - 1 commas
    "runsum": ChainKind(lambda g, n: ",".join(_digit_string(g, n)) + "=",
                        lambda n: sum(len(str(9 * (i + 1))) for i in range(n)) + n - 1, lambda n: 2 * n),
}
assert set(KINDS) == set(ANSWERS), "every chain kind needs a prompt generator and an answer"


@dataclasses.dataclass(frozen=True)
class ChainSpec:
    """Difficulty knobs: ``kind`` (KINDS) and the chain length in [min_len, max_len]."""

    kind: str = "cumsum"
    min_len: int = 12
    max_len: int = 12

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"chain kind must be one of {sorted(KINDS)}, got {self.kind!r}")
        if not 2 <= self.min_len <= self.max_len:
            raise ValueError(f"need 2 <= min_len <= max_len, got {self.min_len}, {self.max_len}")

    def max_response_tokens(self) -> int:
        """Longest answer + <eos>: max_new_tokens that never truncates a right answer."""
        return KINDS[self.kind].answer_chars(self.max_len) + 1

    def max_prompt_tokens(self) -> int:
        """<bos> + the longest prompt."""
        return 1 + KINDS[self.kind].prompt_chars(self.max_len)


def chain_vocab() -> CharVocab:
    return CharVocab(CHAIN_CHARS)


def tiny_chain_hf_config(spec: ChainSpec = ChainSpec()):
    """The demo model (tiny Qwen3-MoE) with the chain vocabulary and room for prompt + answer."""
    from megatron_s3ac.trainer.data import tiny_task_hf_config

    return tiny_task_hf_config(chain_vocab(), spec.max_prompt_tokens(), spec.max_response_tokens())


def chain_prompts(n: int, spec: ChainSpec, seed: int, vocab: CharVocab | None = None,
                  exclude: set[str] | None = None) -> list[Prompt]:
    """n distinct prompts (seeded), minus ``exclude``; references are the answers (chain_answer).
    Stops early only if the space is exhausted (tiny specs)."""
    vocab = vocab or chain_vocab()
    g = torch.Generator().manual_seed(seed)
    out, seen, tries = [], set(exclude or ()), 0
    while len(out) < n and tries < 50 * n + 1000:
        tries += 1
        length = int(torch.randint(spec.min_len, spec.max_len + 1, (1,), generator=g))
        text = KINDS[spec.kind].prompt(g, length)
        if text in seen:
            continue
        seen.add(text)
        out.append(Prompt([BOS] + vocab.encode(text), text, chain_answer(spec.kind, text)))
    return out


# ---- trainer glue (config section ``data``: task=chain, chain, min_len, max_len) ------------------
def spec_of(data_cfg) -> ChainSpec:
    """The ChainSpec a ``data`` config section describes (raises ValueError when invalid)."""
    return ChainSpec(kind=data_cfg.chain, min_len=data_cfg.min_len, max_len=data_cfg.max_len)


def chain_data(data_cfg) -> tuple[CharVocab, list[Prompt], list[Prompt]]:
    """(vocabulary, training prompts, held-out prompts); the held-out split is drawn first with seed + 1
    and excluded from the training set (as the arithmetic task does)."""
    spec, vocab = spec_of(data_cfg), chain_vocab()
    held = chain_prompts(data_cfg.eval_prompts, spec, data_cfg.seed + 1, vocab)
    train = chain_prompts(data_cfg.num_prompts, spec, data_cfg.seed, vocab, exclude={p.text for p in held})
    return vocab, train, held

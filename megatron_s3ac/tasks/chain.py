"""Digit-chain tasks: CPU-sized prompts whose 12-32-token answers are chains, and their reward "chain".

Kinds (prompt -> answer; every digit string is read left to right, position 1 first):

- ``cumsum``   "3517="       -> "3896"        running sum mod 10: o_t = (o_{t-1} + d_t) mod 10
- ``add``      "47+85="      -> "2131"        a + b (74 + 58 = 132) with both numbers written least-
                                              significant digit first; per column the sum digit, then
                                              the carry: 4+8 = 12 -> "21", 7+5+1 = 13 -> "31"
- ``reverse``  "3517="       -> "7153"
- ``sort``     "3517="       -> "1357"
- ``runsum``   "3,5,1,7="    -> "3,8,9,16"    running sums of single digits (every intermediate result)

Reward "chain" (``chain_reward``, registered by rollout.rewards from ``tasks.REWARDS``; inline: string
operations on at most MAX_RESPONSE_CHARS characters): +1 iff the response is exactly the chain the prompt
determines (the reference, computed with ``chain_answer``, which the warm-up trains on), else -1: a mistake at
one step dooms the answer while the steps before it are right, so the response-level signal has to be assigned
to the step that failed. ``first_error`` is a diagnostic (the index of the first wrong token), not a reward.

Difficulty knobs (ChainSpec): the kind and the chain length, drawn uniformly per prompt from [min_len, max_len]
(digits of the string; of each operand for ``add``; items for ``runsum``), so a set mixes short (easy) and long
(hard) prompts as DAPS needs. The same character-vocabulary machinery as the arithmetic task
(data.prompts.CharVocab): "0123456789+=" keep their ids, "," is 15. torch is imported only to draw prompts, so
the reward path (rollout.rewards' workers) stays torch-free.
"""
from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Callable

from megatron_s3ac.data.prompts import BOS, CharVocab, Prompt

from megatron_s3ac.tasks.arithmetic import tiny_task_hf_config

if TYPE_CHECKING:
    import torch

MAX_RESPONSE_CHARS = 128  # longer than any chain of these tasks: -1


def cumsum_chain(digits: str) -> str:
    acc, out = 0, []
    for d in digits:
        acc = (acc + int(d)) % 10
        out.append(str(acc))
    return "".join(out)


def add_chain(a: str, b: str) -> str:
    """a, b: digit strings of equal length, least-significant digit first. Per column t the sum digit
    s_t = (a_t + b_t + c_{t-1}) mod 10, then the carry c_t (c_0 = 0): "47" + "85" (74 + 58 = 132) ->
    "21" "31" = "2131" (the sum digits 2, 3 and the last carry 1 spell 132 from the units up)."""
    if len(a) != len(b):
        raise ValueError(f"add: operands of unequal length {a!r}, {b!r}")
    c, out = 0, []
    for x, y in zip(a, b):
        s = int(x) + int(y) + c
        c = s // 10
        out.append(f"{s % 10}{c}")
    return "".join(out)


def runsum_chain(items: list[str]) -> str:
    acc, out = 0, []
    for v in items:
        acc += int(v)
        out.append(str(acc))
    return ",".join(out)


_DIGITS = re.compile(r"^(\d+)=$")
_ADD = re.compile(r"^(\d+)\+(\d+)=$")
_LIST = re.compile(r"^(\d(?:,\d)*)=$")


def _digits(prompt: str) -> str:
    m = _DIGITS.match(prompt)
    if m is None:
        raise ValueError(f"not a digit-string prompt 'ddd=': {prompt!r}")
    return m.group(1)


def _add(prompt: str) -> str:
    m = _ADD.match(prompt)
    if m is None:
        raise ValueError(f"not an addition prompt 'ddd+ddd=': {prompt!r}")
    return add_chain(m.group(1), m.group(2))


def _runsum(prompt: str) -> str:
    m = _LIST.match(prompt)
    if m is None:
        raise ValueError(f"not a digit-list prompt 'd,d,d=': {prompt!r}")
    return runsum_chain(m.group(1).split(","))


# kind -> answer of a prompt (KINDS below holds each kind's prompt generator)
ANSWERS: dict[str, Callable[[str], str]] = {
    "cumsum": lambda p: cumsum_chain(_digits(p)),
    "add": _add,
    "reverse": lambda p: _digits(p)[::-1],
    "sort": lambda p: "".join(sorted(_digits(p))),
    "runsum": _runsum,
}
_CHAIN = re.compile(r"^\d+(?:,\d+)*$")


def chain_answer(kind: str, prompt: str) -> str:
    """The answer the prompt determines (raises ValueError for an unknown kind or a malformed prompt)."""
    if kind not in ANSWERS:
        raise ValueError(f"unknown chain kind {kind!r}; known: {sorted(ANSWERS)}")
    return ANSWERS[kind](prompt)


def chain_reward(response: str, reference: str) -> float:
    """+1 iff the response (stripped) is exactly the reference chain (chain_answer of the prompt), else -1."""
    if _CHAIN.match(reference) is None:
        raise ValueError(f"reference {reference!r} is not a chain of digits")
    got = response.strip()
    return 1.0 if len(got) <= MAX_RESPONSE_CHARS and got == reference else -1.0


def common_prefix_len(got, want) -> int:
    """How many leading items of two sequences agree (characters, or step values: tasks.multistep's
    step_accuracy): the one loop behind both tasks' "where did the answer leave the chain"."""
    n = 0
    for g, w in zip(got, want):
        if g != w:
            break
        n += 1
    return n


def first_error(response: str, reference: str) -> int:
    """Index of the first character where the response leaves the chain (len(answer) if it is the
    chain with extra text after it, -1 if it is exactly the chain). A diagnostic, not a reward."""
    got = response.strip()
    return -1 if got == reference else common_prefix_len(got, reference)


# ---- prompts ------------------------------------------------------------------------------------
CHAIN_CHARS = "0123456789+=,"
REWARD = "chain"


def _digit_string(g: torch.Generator, n: int) -> str:
    import torch

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
    return tiny_task_hf_config(chain_vocab(), spec.max_prompt_tokens(), spec.max_response_tokens())


def chain_prompts(n: int, spec: ChainSpec, seed: int, vocab: CharVocab | None = None,
                  exclude: set[str] | None = None) -> list[Prompt]:
    """n distinct prompts (seeded), minus ``exclude``; references are the answers (chain_answer).
    Stops early only if the space is exhausted (tiny specs)."""
    import torch

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

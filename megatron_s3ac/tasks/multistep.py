"""A CPU-sized task where credit assignment matters: multi-operand arithmetic written step by step, and its
reward "multistep".

    prompt  "12+7+30="   ->   response "19,49" <eos>      (every running value, comma separated)

Each step's value is computed from the value written before it, so an early mistake dooms the answer (reward
"multistep", ``multistep_reward``: +1 iff the whole chain is right, every step's value right, no step missing or
extra; registered by rollout.rewards from ``tasks.REWARDS``, inline: a regex and an integer compare on at most
MAX_RESPONSE_CHARS characters) while the steps before it can be right (``step_accuracy`` reads the correct
prefix off): the response-level signal must be assigned to the step that failed, which a token-level critic can
do and a response-level baseline cannot. Operators "+" and "-"; values may be negative ("5-9=" -> "-4").
Answers are ~5-30 tokens (vs 2-4 for "a+b="), with the same character-vocabulary machinery
(data.prompts.CharVocab).

Difficulty is configurable (MultistepSpec): number of operands (steps = operands - 1), operand size
(each prompt draws its digit count uniformly, so 1-digit and max-digit operands are both common) and
operators; a set spans easy to hard (prompt_difficulty: steps and carries/borrows), as DAPS needs.
torch is imported only to draw prompts, so the reward path stays torch-free.
"""
from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Optional

from megatron_s3ac.data.prompts import BOS, CharVocab, Prompt

from megatron_s3ac.tasks.arithmetic import tiny_task_hf_config
from megatron_s3ac.tasks.chain import common_prefix_len

if TYPE_CHECKING:
    import torch

MAX_RESPONSE_CHARS = 256  # a longer response is not a chain of a CPU-sized task: -1
_PROMPT = re.compile(r"^\s*(\d+)((?:[+-]\d+)+)\s*=\s*$")
_TERM = re.compile(r"([+-])(\d+)")
_CHAIN = re.compile(r"^-?\d+(?:,-?\d+)*$")


def parse_prompt(prompt: str) -> tuple[list[int], list[str]]:
    """"12+7-30=" -> ([12, 7, 30], ["+", "-"]); raises ValueError for anything else."""
    m = _PROMPT.match(prompt)
    if m is None:
        raise ValueError(f"not a multi-step prompt 'a+b(+-c...)=': {prompt!r}")
    terms = _TERM.findall(m.group(2))
    return [int(m.group(1))] + [int(v) for _, v in terms], [op for op, _ in terms]


def running_values(operands: list[int], ops: list[str]) -> list[int]:
    """The value after each step: [a op1 b, (a op1 b) op2 c, ...] (len = len(ops))."""
    acc, out = operands[0], []
    for op, v in zip(ops, operands[1:]):
        acc = acc + v if op == "+" else acc - v
        out.append(acc)
    return out


def multistep_reference(prompt: str) -> str:
    """"12+7+30=" -> "19,49"."""
    return ",".join(str(v) for v in running_values(*parse_prompt(prompt)))


def parse_chain(text: str) -> Optional[list[int]]:
    """"19,49" -> [19, 49]; None when the text is not a comma-separated list of integers."""
    text = text.strip()
    if not text or len(text) > MAX_RESPONSE_CHARS or _CHAIN.match(text) is None:
        return None
    return [int(v) for v in text.split(",")]


def multistep_reward(response: str, reference: str) -> float:
    """+1 iff the response's chain of step values equals the reference chain exactly, else -1."""
    got, want = parse_chain(response), parse_chain(reference)
    if want is None:
        raise ValueError(f"reference {reference!r} is not a chain of integers")
    return 1.0 if got == want else -1.0


def step_accuracy(response: str, reference: str) -> float:
    """Fraction of the reference's steps the response gets right before its first wrong (or missing)
    step, in [0, 1]; 0 for an unparsable response. A diagnostic of where answers fail, not a reward."""
    want = parse_chain(reference) or []
    got = parse_chain(response)
    if not want or got is None:
        return 0.0
    return common_prefix_len(got, want) / len(want)


# ---- prompts ------------------------------------------------------------------------------------
# "0123456789+=" first: the arithmetic task's ids are unchanged (3..14); "," and "-" are 15, 16
MULTISTEP_CHARS = "0123456789+=,-"
REWARD = "multistep"


@dataclasses.dataclass(frozen=True)
class MultistepSpec:
    """Difficulty knobs. operands in [min_operands, max_operands]; operand values in [0, max_operand]
    with a uniformly drawn digit count; ops: the operators drawn from ("+" or "+-")."""

    min_operands: int = 3
    max_operands: int = 5
    max_operand: int = 99
    ops: str = "+"

    def __post_init__(self):
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(f"need 2 <= min_operands <= max_operands, got {self.min_operands}, {self.max_operands}")
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        if not self.ops or set(self.ops) - set("+-"):
            raise ValueError(f"ops must be a non-empty subset of '+-', got {self.ops!r}")

    def max_response_tokens(self) -> int:
        """Longest chain (characters) + <eos>: max_new_tokens that never truncates a right answer."""
        width = len(str(self.max_operands * self.max_operand)) + ("-" in self.ops)
        steps = self.max_operands - 1
        return steps * width + (steps - 1) + 1

    def max_prompt_tokens(self) -> int:
        """<bos> + the longest prompt."""
        return 1 + self.max_operands * (len(str(self.max_operand)) + 1)


def multistep_vocab() -> CharVocab:
    return CharVocab(MULTISTEP_CHARS)


def tiny_multistep_hf_config(spec: MultistepSpec = MultistepSpec()):
    """The demo model (tiny Qwen3-MoE) with the multistep vocabulary and room for prompt + answer."""
    return tiny_task_hf_config(multistep_vocab(), spec.max_prompt_tokens(), spec.max_response_tokens())


def _operand(g: torch.Generator, max_operand: int) -> int:
    import torch

    digits = int(torch.randint(1, len(str(max_operand)) + 1, (1,), generator=g))
    hi = min(max_operand, 10 ** digits - 1)
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def multistep_prompts(n: int, spec: MultistepSpec, seed: int, vocab: CharVocab | None = None,
                      exclude: set[str] | None = None) -> list[Prompt]:
    """n distinct prompts (seeded), minus ``exclude``; references are the step chains.
    Stops early only if the space is exhausted (tiny specs)."""
    import torch

    vocab = vocab or multistep_vocab()
    g = torch.Generator().manual_seed(seed)
    out, seen, tries = [], set(exclude or ()), 0
    while len(out) < n and tries < 50 * n + 1000:
        tries += 1
        k = int(torch.randint(spec.min_operands, spec.max_operands + 1, (1,), generator=g))
        vals = [_operand(g, spec.max_operand) for _ in range(k)]
        ops = [spec.ops[int(torch.randint(0, len(spec.ops), (1,), generator=g))] for _ in range(k - 1)]
        text = str(vals[0]) + "".join(f"{op}{v}" for op, v in zip(ops, vals[1:])) + "="
        if text in seen:
            continue
        seen.add(text)
        out.append(Prompt([BOS] + vocab.encode(text), text, multistep_reference(text)))
    return out


def _carries(a: int, b: int) -> int:
    """Carries in the column addition of two non-negative ints (borrows for subtraction: see below)."""
    n, c = 0, 0
    while a or b:
        s = a % 10 + b % 10 + c
        c = int(s >= 10)
        n += c
        a, b = a // 10, b // 10
    return n


def _borrows(a: int, b: int) -> int:
    """Borrows in the column subtraction |a| - |b| with |a| >= |b|."""
    a, b = max(abs(a), abs(b)), min(abs(a), abs(b))
    n, br = 0, 0
    while a or b:
        d = a % 10 - b % 10 - br
        br = int(d < 0)
        n += br
        a, b = a // 10, b // 10
    return n


def prompt_difficulty(text: str) -> dict:
    """{"steps", "carries", "max_digits"} of a prompt: carries (and borrows) summed over its steps,
    computed on the running value as the answer is written."""
    operands, ops = parse_prompt(text)
    acc, carries = operands[0], 0
    for op, v, nxt in zip(ops, operands[1:], running_values(operands, ops)):
        same_sign = (op == "+") == (acc >= 0)
        carries += _carries(abs(acc), v) if same_sign else _borrows(acc, v)
        acc = nxt
    return {"steps": len(ops), "carries": carries, "max_digits": max(len(str(v)) for v in operands)}


# ---- trainer glue (config section ``data``: task, min_operands, max_operands, max_operand, ops) ------
def spec_of(data_cfg) -> MultistepSpec:
    """The MultistepSpec a ``data`` config section describes (raises ValueError when invalid)."""
    return MultistepSpec(min_operands=data_cfg.min_operands, max_operands=data_cfg.max_operands,
                         max_operand=data_cfg.max_operand, ops=data_cfg.ops)


def multistep_data(data_cfg) -> tuple[CharVocab, list[Prompt], list[Prompt]]:
    """(vocabulary, training prompts, held-out prompts) of the multistep task; the held-out split is
    drawn first with seed + 1 and excluded from the training set (as the arithmetic task does)."""
    spec, vocab = spec_of(data_cfg), multistep_vocab()
    held = multistep_prompts(data_cfg.eval_prompts, spec, data_cfg.seed + 1, vocab)
    train = multistep_prompts(data_cfg.num_prompts, spec, data_cfg.seed, vocab, exclude={p.text for p in held})
    return vocab, train, held

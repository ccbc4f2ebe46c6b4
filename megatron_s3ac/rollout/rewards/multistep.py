"""Verifiable reward of the multi-step arithmetic task (trainer/tasks_multistep.py).

A prompt "12+7+30=" asks for every running result, comma separated: "19,49" (n operands -> n - 1
steps). The reward is +1 iff the response is exactly that chain (every step's value right, no step
missing or extra), else -1: each step is computed from the previous written value, so one early
mistake dooms the answer, while a correct prefix of steps can still be read off (step_accuracy) to
see where a response went wrong. Operators "+" and "-"; values may be negative ("5-9=" -> "-4").

Registered as "multistep" by rollout/rewards.py (inline: a regex and an integer compare on at most
MAX_RESPONSE_CHARS characters, bounded). It imports only reward_chain's common_prefix_len (neither imports rewards.py: no cycle).
"""
from __future__ import annotations

import re
from typing import Optional

from megatron_s3ac.rollout.rewards.chain import common_prefix_len

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

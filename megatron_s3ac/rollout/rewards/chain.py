"""Verifiable reward of the digit-chain tasks (trainer/tasks_chain.py): 12-32-token answers that are a
chain, each token computed from the prompt and the tokens written before it.

Kinds (prompt -> answer; every digit string is read left to right, position 1 first):

- ``cumsum``   "3517="       -> "3896"        running sum mod 10: o_t = (o_{t-1} + d_t) mod 10
- ``add``      "47+85="      -> "2131"        a + b (74 + 58 = 132) with both numbers written least-
                                              significant digit first; per column the sum digit, then
                                              the carry: 4+8 = 12 -> "21", 7+5+1 = 13 -> "31"
- ``reverse``  "3517="       -> "7153"
- ``sort``     "3517="       -> "1357"
- ``runsum``   "3,5,1,7="    -> "3,8,9,16"    running sums of single digits (every intermediate result)

The reward is +1 iff the response is exactly the chain the prompt determines (the reference, which
trainer/tasks_chain.py computes with chain_answer and the warm-up trains on), else -1: a mistake at one
step dooms the answer while the steps before it are right, so the response-level signal has to be
assigned to the step that failed.
``first_error`` is a diagnostic (the index of the first wrong token), not a reward.

Registered as "chain" by rollout/rewards.py (inline: string operations on at most MAX_RESPONSE_CHARS
characters, bounded). This module imports nothing of the package (no cycle).
"""
from __future__ import annotations

import re
from typing import Callable

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


# kind -> answer of a prompt (tasks_chain builds each kind's prompt generator beside it)
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
    """How many leading items of two sequences agree (characters, or step values: reward_multistep's
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

"""The CPU demo's task "a+b=": its reward "arithmetic" (registered by rollout.rewards from ``tasks.REWARDS``,
inline: a regex on the response's first 64 characters).

Its prompts (``arithmetic_prompts``), vocabulary (``CharVocab``) and demo model (``tiny_arithmetic_hf_config``)
stay in data/prompts.py for now: ``trainer.step.build.build_data`` reads them from there.
"""
from __future__ import annotations

import re

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

"""Scoring responses as correct (1) / incorrect (0).

- math: the rollout's verifiable reward through the training path, `rollout.rewards.score_answers`
  (math-verify in RewardPool worker processes with a hard time limit); reward > 0 is correct. An answer whose verification times out, crashes or raises
  scores 0 and is counted, so one pathological answer cannot stall or crash an evaluation.
- choice: the letter the response commits to (see `extract_choice_letter`) equals the reference.
- any other registered reward name (e.g. "arithmetic" for the CPU demo, "multistep" for the step-by-step
  arithmetic task) works like math.
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

import numpy as np

from megatron_s3ac.rollout.rewards import RewardPool, extract_last_boxed, get_reward, score_answers

CHOICE_TAIL_CHARS = 2000  # "the answer is X" is searched for only near the end of a response

_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")
# "(C)", "C", "C)", "C.", "C: text", "**C**": a letter that is not the start of a longer word.
_LEADING_LETTER = re.compile(r"^[\s(\[*]*([A-Z])(?![A-Za-z0-9])")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)?\s*(?:option|choice)?\s*[:\-]?\s*[(\[*]*\s*([A-Z])(?![A-Za-z0-9])",
                        re.IGNORECASE)


def extract_choice_letter(response: str, num_choices: int = 4) -> Optional[str]:
    """The chosen letter (A..), or None when the response commits to none.

    Looked for, in order: the last \\boxed{} ("C", "(C)", "\\text{C}", "C) text"); the last "answer
    is C" / "Answer: (C)" near the end; a response that is just a letter. Letters beyond
    num_choices do not count. Bare letters inside the reasoning ("option A is wrong") are ignored
    on purpose: they would credit guesses.
    """
    valid = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:num_choices]
    boxed = extract_last_boxed(response)
    if boxed is not None:
        m = _LEADING_LETTER.match(_TEXT_WRAPPER.sub(r"\1", boxed))
        return m.group(1) if m and m.group(1) in valid else None
    tail = response[-CHOICE_TAIL_CHARS:]
    for m in reversed(list(_ANSWER_IS.finditer(tail))):
        letter = m.group(1)
        if letter.isupper() and letter in valid:  # "answer is a ..." (lowercase) is prose, not a pick
            return letter
    m = re.fullmatch(r"[\s(\[*]*([A-Z])[\s)\].*]*", response)
    return m.group(1) if m and m.group(1) in valid else None


def score(kind: str, responses: Sequence[str], references: Sequence[str], *,
          num_choices: Sequence[int] = (), reward: Optional[str] = None,
          pool: Optional[RewardPool] = None) -> tuple[np.ndarray, dict[str, int]]:
    """Correctness [N] bool of N responses, and counts {"timeouts", "crashes", "errors"}.

    kind "choice" uses num_choices [N]; otherwise the registered reward (default "math") is run,
    isolated ones in `pool`.
    """
    if len(responses) != len(references):
        raise ValueError(f"{len(responses)} responses for {len(references)} references")
    counts = {"timeouts": 0, "crashes": 0, "errors": 0}
    if kind == "choice":
        ns = list(num_choices) or [4] * len(responses)
        correct = [extract_choice_letter(r, n) == ref for r, n, ref in zip(responses, ns, references)]
        return np.array(correct, dtype=bool), counts
    # the training path (rollout.rewards.score_answers), so evaluation and training agree on every
    # answer, a raising one included (-1 there, incorrect here; counted as an error)
    name = reward or "math"
    errors: list[int] = []
    before = pool.stats.as_dict() if pool is not None else None
    rewards = np.asarray(score_answers(name, list(responses), list(references),
                                       pool if get_reward(name).isolate else None,
                                       on_error=lambda i, exc: errors.append(i)), dtype=np.float64)
    if before is not None and get_reward(name).isolate:
        after = pool.stats.as_dict()
        counts = {key: after[key] - before[key] for key in counts}
    counts["errors"] += len(errors)
    return rewards > 0, counts

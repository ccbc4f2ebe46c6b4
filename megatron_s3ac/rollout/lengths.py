"""Long-tailed response lengths by design (``rollout.length_tail``): a per-response token budget, so that a few
responses run to the cap and most stop early, as RL response lengths do (a benchmark workload: bench/bench_async.py
``--long-tail``; docs/trainer.md "Asynchronous rollout").

``SamplingParams.length_tail = (long_frac, short_min, short_max, salt)`` (empty: off, every response's budget is
``max_new_tokens``). Response k of prompt ``ids`` gets the budget

    u, v = two uniforms in [0, 1) from blake2b(salt, k, ids)
    budget = max_new_tokens                                        if u < long_frac
             short_min + floor(v * (short_max - short_min + 1))    otherwise

so a fraction ``long_frac`` of the responses is at the cap and the rest uniform on [short_min, short_max]: the
expected budget is ``long_frac * cap + (1 - long_frac) * (short_min + short_max) / 2``. With the tail on the
trainer also sets ``ignore_eos`` (rollout_phases.sampling_params), so the engine really decodes each budget to its end:
the lengths are the design's, not the model's. The budget depends only on (salt, k, the prompt's tokens): an engine
pool's chunking, the call's seed and the arm of a benchmark do not change it, and a partial-rollout continuation
(rollout/partial.py ``continuation_requests``) recomputes its response's budget from the sample's own prompt and index.
Engines that apply it: cpu / hf (``CPUEngine.generate_groups``) and vllm (its client sends the budgets; the server
already takes one per request); the others are refused at config load.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

ENGINES = ("cpu", "hf", "vllm")  # the engines whose generate applies SamplingParams.length_tail


def check_tail(tail: Sequence, cap: int) -> tuple:
    """``tail`` as a validated (long_frac, short_min, short_max, salt) tuple ((): off)."""
    if not tail:
        return ()
    if len(tail) != 4:
        raise ValueError(f"length_tail must be (long_frac, short_min, short_max, salt), got {tail!r}")
    frac, lo, hi, salt = float(tail[0]), int(tail[1]), int(tail[2]), int(tail[3])
    if not 0.0 < frac <= 1.0:
        raise ValueError(f"length_tail long_frac={frac} must be in (0, 1]")
    if not 1 <= lo <= hi < cap:
        raise ValueError(f"length_tail needs 1 <= short_min ({lo}) <= short_max ({hi}) < max_new_tokens ({cap})")
    return (frac, lo, hi, salt)


def _uniforms(salt: int, k: int, ids: Sequence[int]) -> tuple[float, float]:
    h = hashlib.blake2b(struct.pack("<qq", int(salt), int(k)) + struct.pack(f"<{len(ids)}q", *map(int, ids)),
                        digest_size=16).digest()
    a, b = struct.unpack("<QQ", h)
    return a / 2.0**64, b / 2.0**64


def response_budget(tail: Sequence, cap: int, prompt_ids: Sequence[int], k: int) -> int:
    """The token budget of response ``k`` of the prompt ``prompt_ids`` (``cap`` when the tail is off)."""
    if not tail:
        return int(cap)
    frac, lo, hi, salt = tail
    u, v = _uniforms(salt, k, prompt_ids)
    if u < frac:
        return int(cap)
    return int(lo) + min(int(v * (int(hi) - int(lo) + 1)), int(hi) - int(lo))


def row_budgets(params, prompts: Sequence[Sequence[int]], n_samples: int) -> list[int]:
    """One budget per row of a prompt-major expanded batch (row r: prompt r // n_samples, response r % n_samples)."""
    n = max(int(n_samples), 1)
    return [response_budget(params.length_tail, params.max_new_tokens, p, r % n) for r, p in enumerate(prompts)]


def expected_budget(tail: Sequence, cap: int) -> float:
    """The designed mean budget (the formula of the module docstring)."""
    if not tail:
        return float(cap)
    frac, lo, hi, _ = tail
    return frac * cap + (1.0 - frac) * (lo + hi) / 2.0

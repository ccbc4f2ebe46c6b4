"""EnginePool's up-front context check names a too-long prompt by its index in the whole batch (each engine only
sees its own chunk and would number prompts within it). Pure function; the pool with real Ray actors:
tests/rollout/test_engine_pool.py::test_too_long_prompt_is_named_by_its_index_in_the_batch."""
import pytest

from megatron_s3ac.rollout.engines.pool import check_prompt_lengths, split_evenly
from megatron_s3ac.rollout.engines.sglang.engine import PromptTooLongError

PROMPTS = [[1] * 4, [1] * 5, [1] * 6, [1] * 7, [1] * 9]  # lengths 4..9


def chunks(n, engines):
    return [(e, lo, hi) for e, (lo, hi) in enumerate(split_evenly(n, engines)) if lo < hi]


def test_the_global_index_and_the_engine_are_named():
    # 2 engines: prompts 0-1 on engine 0, 2-4 on engine 1; prompt 4 (9 tokens) + 8 new = 17 > 16
    with pytest.raises(PromptTooLongError, match=r"^engine 1: prompt 4 has 9 tokens; with max_new_tokens=8 it needs "
                                                 r"17 > the context length 16\."):
        check_prompt_lengths(PROMPTS, 8, chunks(5, 2), {0: 16, 1: 16}, lambda e: f"engine {e}")
    check_prompt_lengths(PROMPTS, 7, chunks(5, 2), {0: 16, 1: 16}, str)  # 9 + 7 = 16 fits exactly


def test_each_prompt_is_checked_against_its_own_engine():
    ctx = {0: 12, 1: 100}  # prompt 1 (5 tokens) + 8 > 12 on engine 0; engine 1's prompts fit
    with pytest.raises(PromptTooLongError, match="^e0: prompt 1 has 5 tokens"):
        check_prompt_lengths(PROMPTS, 8, chunks(5, 2), ctx, lambda e: f"e{e}")
    check_prompt_lengths(PROMPTS, 8, chunks(5, 2), {0: None, 1: 100}, str)  # unknown context: not checked here

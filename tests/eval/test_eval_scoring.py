"""Scoring: choice-letter extraction, math via the reward pool, verifier timeouts score 0."""
import time

import numpy as np
import pytest

from eval_fixtures import SLEEP_REWARD
from megatron_s3ac.eval.scoring import extract_choice_letter, score


@pytest.mark.parametrize("response, expected", [
    ("... so the answer is \\boxed{C}.", "C"),
    ("\\boxed{(B)}", "B"),
    ("\\boxed{\\text{D}}", "D"),
    ("\\boxed{A) 42 kg}", "A"),
    ("First I thought \\boxed{A} but actually \\boxed{B}", "B"),   # the last box counts
    ("Answer: C", "C"),
    ("The correct answer is (D).", "D"),
    ("answer is A. Wait, no: the answer is **B**", "B"),            # the last statement counts
    ("The answer is option C", "C"),
    ("B", "B"),
    (" (A) ", "A"),
    ("\\boxed{E}", None),                                          # beyond 4 choices
    ("\\boxed{42}", None),
    ("\\boxed{Apple}", None),                                      # a word, not a letter
    ("Option A is wrong because B is larger.", None),              # bare letters in reasoning
    ("the answer is a tricky one", None),                          # lowercase: prose
    ("", None),
])
def test_extract_choice_letter(response, expected):
    assert extract_choice_letter(response, num_choices=4) == expected


def test_extract_choice_letter_respects_num_choices():
    assert extract_choice_letter("\\boxed{E}", num_choices=5) == "E"
    assert extract_choice_letter("Answer: C", num_choices=2) is None


def test_score_choice():
    ok, counts = score("choice", ["\\boxed{B}", "Answer: A", "no idea"], ["B", "B", "C"], num_choices=[4, 4, 4])
    assert ok.tolist() == [True, False, False] and counts == {"timeouts": 0, "crashes": 0, "errors": 0}


def test_score_math_in_pool(pool):
    ok, counts = score("math", ["\\boxed{\\frac{1}{2}}", "\\boxed{3}", "I give up", "\\boxed{016}", "\\boxed{-3, 3}"],
                       ["0.5", "4", "1", "16", "$3$, $-3$"], pool=pool)  # AIME "016"; OlympiadBench list
    assert ok.tolist() == [True, False, False, True, True]
    assert counts["timeouts"] == 0


def test_score_math_needs_a_pool():
    with pytest.raises(ValueError, match="RewardPool"):
        score("math", ["\\boxed{1}"], ["1"])


def test_inline_reward_without_pool():
    ok, counts = score("math", ["46 is it", "45", "7"], ["46", "46", "not a number"], reward="arithmetic")
    assert ok.tolist() == [True, False, False]
    assert counts["errors"] == 1  # int("not a number") raised: scored 0 and counted


def test_verifier_timeout_scores_zero_and_is_counted(pool):
    t0 = time.monotonic()
    ok, counts = score("math", ["\\boxed{1}", "\\boxed{2}"], ["1", "2"], reward=SLEEP_REWARD, pool=pool)
    assert ok.tolist() == [False, False]
    assert counts["timeouts"] == 2
    assert time.monotonic() - t0 < 3 * pool.timeout_s  # bounded: two workers, one limit each
    ok, counts = score("math", ["\\boxed{1}"], ["1"], pool=pool)  # the pool recovered
    assert ok.tolist() == [True] and counts["timeouts"] == 0
    assert isinstance(ok, np.ndarray) and ok.dtype == bool


def test_eval_and_training_score_the_same_answers(pool):
    """One scoring path: eval's correctness is exactly reward > 0 of rollout.rewards.score_answers
    (what training uses) on the same answers, incl. one whose reward raises (training: -1; eval:
    incorrect and counted), for an inline reward and for the pooled math verifier."""
    from megatron_s3ac.rollout.rewards import score_answers

    responses, refs = ["46 is it", "45", "7", " 12"], ["46", "46", "not a number", "12"]
    train = score_answers("arithmetic", responses, refs)
    assert train == [1.0, -1.0, -1.0, 1.0]  # the raising answer is -1 for training
    ok, counts = score("math", responses, refs, reward="arithmetic")
    assert ok.tolist() == [r > 0 for r in train] and counts["errors"] == 1

    responses = ["\\boxed{\\frac{1}{2}}", "\\boxed{3}", "I give up", "\\boxed{0.5}"]
    refs = ["0.5", "4", "1", "\\frac12"]
    train = score_answers("math", responses, refs, pool)
    ok, counts = score("math", responses, refs, pool=pool)
    assert ok.tolist() == [r > 0 for r in train] == [True, False, False, True]
    assert counts == {"timeouts": 0, "crashes": 0, "errors": 0}

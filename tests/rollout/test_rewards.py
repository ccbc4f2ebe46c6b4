"""Rewards: math-verify equivalences, malformed and adversarial answers, hard limits, plug-ins."""
import os
import time

import numpy as np
import pytest

from megatron_s3ac.rollout.rewards import (
    RewardPool, extract_last_boxed, get_reward, math_reward, register_reward, registered_rewards, score_answers,
)
from megatron_s3ac.tasks.arithmetic import arithmetic_reference, arithmetic_reward

TIMEOUT_S = 3.0


# Plug-in rewards for the pool tests; module level so the worker processes can import them.
@register_reward("test_sleep_forever")
def sleep_forever(response, reference):
    time.sleep(3600)
    return 1.0


@register_reward("test_crash")
def crash(response, reference):
    os._exit(3)  # like a segfault: the worker vanishes without replying


@register_reward("test_raise")
def raise_error(response, reference):
    raise RecursionError("too deep")


@register_reward("test_exact")
def exact(response, reference):
    return 1.0 if response.strip() == reference.strip() else -1.0


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=TIMEOUT_S, memory_limit_mb=4096) as p:
        yield p


@pytest.mark.parametrize("response, reference", [
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("The answer is \\boxed{0.5}.", "\\frac{1}{2}"),
    ("so it is $1/2$", "\\frac12"),
    ("\\boxed{1/2}", "1/2"),
    ("First \\boxed{3}, no wait: \\boxed{\\dfrac{1}{2}}", "0.5"),  # the last box counts
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}"),
])
def test_equivalent_forms(response, reference):
    assert math_reward(response, reference) == 1.0


@pytest.mark.parametrize("response, reference", [
    ("\\boxed{0.51}", "0.5"),
    ("\\boxed{2}", "\\frac{1}{2}"),
    ("\\boxed{\\frac{1}{2}}, no wait, \\boxed{3}", "0.5"),
    ("", "1"),
    ("no answer at all", "7"),
    ("\\boxed{", "1"),
    ("\\boxed{}}}{{", "1"),
])
def test_wrong_or_malformed(response, reference):
    assert math_reward(response, reference) == -1.0


def test_extract_last_boxed():
    assert extract_last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert extract_last_boxed("\\fbox{7}") == "7"
    assert extract_last_boxed("\\boxed{1") is None
    assert extract_last_boxed("none") is None


def test_arithmetic_reward():
    assert arithmetic_reference("12+34=") == "46"
    assert arithmetic_reward("46", "46") == 1.0
    assert arithmetic_reward("46<eos>", "46") == 1.0
    assert arithmetic_reward("47", "46") == -1.0
    assert arithmetic_reward("460", "46") == -1.0
    assert arithmetic_reward("", "46") == -1.0
    with pytest.raises(ValueError):
        arithmetic_reference("12*34=")


def test_registry():
    assert {"math", "arithmetic"} <= set(registered_rewards())
    assert get_reward("arithmetic").isolate is False and get_reward("math").isolate is True
    with pytest.raises(KeyError):
        get_reward("nope")
    with pytest.raises(ValueError):
        register_reward("math")(lambda r, g: 1.0)


@register_reward("test_raises_inline", isolate=False)
def raises_inline(response, reference):
    if response == "boom":
        raise ValueError("unparsable")
    return 1.0 if response == reference else -1.0


def test_score_answers_is_the_one_path(pool):
    # cheap rewards inline: an answer whose scoring raises is wrong (-1), not a crash of the caller
    assert score_answers("test_raises_inline", ["a", "boom", "b"], ["a", "a", "a"]) == [1.0, -1.0, -1.0]
    assert score_answers("arithmetic", ["46", "45"], ["46", "46"]) == [1.0, -1.0]
    # isolated rewards only through a pool (its per-answer limits), never inline
    with pytest.raises(ValueError, match="runs in worker processes: pass a RewardPool"):
        score_answers("math", ["\\boxed{1}"], ["1"])
    before = pool.stats.total
    assert score_answers("math", ["\\boxed{0.5}", "\\boxed{3}"], ["1/2", "1/2"], pool) == [1.0, -1.0]
    assert pool.stats.total == before + 2


def test_pool_scores_in_workers(pool):
    r = pool.score("math", ["\\boxed{0.5}", "\\boxed{3}", "$\\frac{1}{2}$"], ["1/2", "1/2", "0.5"])
    assert r.dtype == np.float32 and r.tolist() == [1.0, -1.0, 1.0]
    assert pool.score("arithmetic", ["46", "45"], ["46", "46"]).tolist() == [1.0, -1.0]
    assert pool.score("test_exact", ["a", "b"], ["a", "a"]).tolist() == [1.0, -1.0]


def test_pool_kills_stuck_and_crashed_workers(pool):
    before = pool.stats.as_dict()
    t0 = time.monotonic()
    r = pool.score("test_sleep_forever", ["x"], ["y"])
    assert r.tolist() == [-1.0] and time.monotonic() - t0 < TIMEOUT_S + 2
    assert pool.score("test_crash", ["x", "y"], ["x", "y"]).tolist() == [-1.0, -1.0]
    assert pool.score("test_raise", ["x"], ["y"]).tolist() == [-1.0]
    after = pool.stats.as_dict()
    assert after["timeouts"] - before["timeouts"] == 1
    assert after["crashes"] - before["crashes"] == 2
    assert after["errors"] - before["errors"] == 1
    assert after["workers_replaced"] - before["workers_replaced"] == 3
    # the replaced workers still serve
    assert pool.score("math", ["\\boxed{2}"] * 4, ["2"] * 4).tolist() == [1.0] * 4


ADVERSARIAL = {
    "tower": "\\boxed{10^{10^{10}}}",
    "tower_plain": "10^10^10",
    "factorial": "\\boxed{100000!}",
    "nested_parens": "\\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}",
    "nested_fracs": "\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 300 + "}",
    "megabyte": "a" * 1_000_000,
    "megabyte_box": "\\boxed{" + "9" * 1_000_000 + "}",
    "unicode_junk": "\\boxed{\u202e\ud800\x00\uffff🙂ℵ∑\u0301\u0301}",
    "binary_junk": "".join(chr(i) for i in range(0, 2000, 7)),
}


def test_adversarial_answers_bounded(pool):
    names = list(ADVERSARIAL)
    before = pool.stats.total
    t0 = time.monotonic()
    r = pool.score("math", [ADVERSARIAL[n] for n in names], ["1/2"] * len(names))
    elapsed = time.monotonic() - t0
    assert r.tolist() == [-1.0] * len(names), dict(zip(names, r.tolist()))
    assert pool.stats.total - before == len(names)  # every one counted
    # 2 workers, each answer capped at TIMEOUT_S: a hard bound on the batch
    assert elapsed < len(names) / 2 * TIMEOUT_S + 5
    assert pool.stats.max_seconds < TIMEOUT_S + 1

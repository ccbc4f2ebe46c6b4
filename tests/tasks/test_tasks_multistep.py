"""The multi-step arithmetic task: the reward is exact on hand-worked cases, references are the
running values, a generated set spans difficulties, and the vocabulary extends the demo's."""
import collections

import pytest

from megatron_s3ac.tasks.multistep import (multistep_reference, multistep_reward, parse_prompt,
                                                    step_accuracy)
from megatron_s3ac.rollout.rewards import get_reward
from megatron_s3ac.data.prompts import BOS, CharVocab
from megatron_s3ac.tasks.multistep import (MULTISTEP_CHARS, MultistepSpec, multistep_prompts, multistep_vocab,
                                                   prompt_difficulty, tiny_multistep_hf_config)


@pytest.mark.parametrize("prompt,chain", [
    ("12+7+30=", "19,49"),
    ("1+2=", "3"),
    ("99+99+99+99=", "198,297,396"),
    ("5-9+20=", "-4,16"),
    ("0+0+0=", "0,0"),
    ("50-20-40-5=", "30,-10,-15"),
])
def test_reference_is_the_running_values(prompt, chain):
    assert multistep_reference(prompt) == chain


@pytest.mark.parametrize("response,score", [
    ("19,49", 1.0),
    (" 19,49 ", 1.0),       # surrounding whitespace is not an answer
    ("19,48", -1.0),        # last step wrong
    ("18,49", -1.0),        # right final value after a wrong step is still wrong (not the chain)
    ("20,50", -1.0),        # early mistake carried forward: doomed
    ("49", -1.0),           # steps skipped
    ("19", -1.0),           # stopped early
    ("19,49,0", -1.0),      # extra step
    ("19,,49", -1.0),
    ("19+49", -1.0),
    ("", -1.0),
    ("1" * 300, -1.0),      # absurdly long
])
def test_reward_exact_on_hand_cases(response, score):
    assert multistep_reward(response, "19,49") == score
    assert get_reward("multistep").fn(response, "19,49") == score


def test_reward_negative_values():
    assert multistep_reward("-4,16", "-4,16") == 1.0
    assert multistep_reward("4,16", "-4,16") == -1.0


def test_step_accuracy_locates_the_first_wrong_step():
    ref = "96,113,160,241"
    assert step_accuracy(ref, ref) == 1.0
    assert step_accuracy("96,113,161,242", ref) == 0.5   # third step wrong, fourth follows from it
    assert step_accuracy("95,112,159,240", ref) == 0.0
    assert step_accuracy("96,113", ref) == 0.5           # stopped after two steps
    assert step_accuracy("96,x", ref) == 0.0


def test_parse_prompt_rejects_other_text():
    assert parse_prompt("3+4-5=") == ([3, 4, 5], ["+", "-"])
    for bad in ("3+4", "3*4=", "=", "+3+4="):
        with pytest.raises(ValueError):
            parse_prompt(bad)


def test_vocabulary_extends_the_demo_ids():
    ms, ar = multistep_vocab(), CharVocab()
    assert ms.encode("0123456789+=") == ar.encode("0123456789+=")  # same ids as the a+b= task
    assert ms.encode(",-") == [15, 16] and ms.size == 3 + len(MULTISTEP_CHARS) == 17
    assert tiny_multistep_hf_config().vocab_size == 17


def test_prompt_set_spans_difficulties():
    spec = MultistepSpec(min_operands=2, max_operands=6, max_operand=99)
    prompts = multistep_prompts(400, spec, seed=0)
    assert len(prompts) == 400 and len({p.text for p in prompts}) == 400
    vocab = multistep_vocab()
    diffs = [prompt_difficulty(p.text) for p in prompts]
    steps = collections.Counter(d["steps"] for d in diffs)
    assert set(steps) == {1, 2, 3, 4, 5} and min(steps.values()) >= 40  # every length well represented
    carries = [d["carries"] for d in diffs]
    assert min(carries) == 0 and max(carries) >= 6
    assert {d["max_digits"] for d in diffs} == {1, 2}
    for p in prompts:
        assert p.ids == [BOS] + vocab.encode(p.text) and p.reference == multistep_reference(p.text)
        assert len(p.ids) <= spec.max_prompt_tokens() and len(p.reference) + 1 <= spec.max_response_tokens()
    # the hardest answers are in the 10-30 token range the task is for
    assert 10 <= max(len(p.reference) + 1 for p in prompts) <= 30
    # held-out split: disjoint, reproducible
    held = multistep_prompts(50, spec, seed=1, exclude={p.text for p in prompts})
    assert not {p.text for p in held} & {p.text for p in prompts}
    assert [p.text for p in multistep_prompts(50, spec, seed=1, exclude={p.text for p in prompts})] == \
        [p.text for p in held]


def test_hand_checked_difficulty():
    # 8+92: 2 carries (units, tens); 100-81: 2 borrows
    assert prompt_difficulty("3+5+92-81=") == {"steps": 3, "carries": 4, "max_digits": 2}
    assert prompt_difficulty("1+2=") == {"steps": 1, "carries": 0, "max_digits": 1}


def test_spec_validation():
    for bad in (dict(min_operands=1), dict(min_operands=4, max_operands=3), dict(max_operand=0), dict(ops="*")):
        with pytest.raises(ValueError):
            MultistepSpec(**bad)

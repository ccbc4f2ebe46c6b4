"""The digit-chain tasks: answers hand-derived per kind, the reward is exact match of the whole chain,
generated sets are reproducible, disjoint from the held-out split and within the declared lengths."""
import pytest

from megatron_s3ac.tasks.chain import chain_answer, chain_reward, first_error
from megatron_s3ac.rollout.rewards import get_reward
from megatron_s3ac.data.prompts import BOS, CharVocab
from megatron_s3ac.tasks.chain import CHAIN_CHARS, KINDS, ChainSpec, chain_prompts, chain_vocab, \
    tiny_chain_hf_config


@pytest.mark.parametrize("kind,prompt,answer", [
    ("cumsum", "3517=", "3896"),            # 3, 3+5, 8+1, 9+7=16 -> 6
    ("cumsum", "0000=", "0000"),
    ("cumsum", "99999=", "98765"),
    ("add", "47+85=", "2131"),              # 74 + 58 = 132: 4+8=12 -> "21", 7+5+1=13 -> "31"
    ("add", "9303+9737=", "81114001"),      # 3039 + 7379 = 10418: 18, 11, 4 (+1), 10
    ("add", "00+00=", "0000"),
    ("add", "99+99=", "8191"),              # 99 + 99 = 198
    ("reverse", "3517=", "7153"),
    ("sort", "3517=", "1357"),
    ("sort", "90090=", "00099"),
    ("runsum", "3,5,1,7=", "3,8,9,16"),
    ("runsum", "9,9,9=", "9,18,27"),
])
def test_answers_hand_derived(kind, prompt, answer):
    assert chain_answer(kind, prompt) == answer


def test_add_chain_spells_the_sum():
    # the sum digits then the last carry, read from the units up, are the decimal sum
    for a, b in [("1234567", "7654321"), ("9999", "0001"), ("5050", "5050")]:
        ans = chain_answer("add", f"{a}+{b}=")
        digits = ans[0::2] + ans[-1]
        assert int(digits[::-1]) == int(a[::-1]) + int(b[::-1])


@pytest.mark.parametrize("response,score", [
    ("3896", 1.0), (" 3896\n", 1.0),
    ("3895", -1.0),        # last step wrong
    ("4907", -1.0),        # an early mistake carried forward consistently (4, 9, 0, 7): still wrong
    ("389", -1.0),         # stopped early
    ("38960", -1.0),       # extra token
    ("", -1.0), ("3" * 500, -1.0),
])
def test_reward_is_whole_chain_exact(response, score):
    assert chain_reward(response, "3896") == score
    assert get_reward("chain").fn(response, "3896") == score


def test_reward_refuses_a_reference_that_is_not_a_chain():
    with pytest.raises(ValueError, match="not a chain"):
        chain_reward("12", "12+3=")


def test_first_error_locates_the_break():
    assert first_error("3896", "3896") == -1
    assert first_error("3807", "3896") == 2
    assert first_error("389", "3896") == 3
    assert first_error("38960", "3896") == 4


@pytest.mark.parametrize("bad", [("cumsum", "35a="), ("add", "12+3="), ("runsum", "12,3="), ("reverse", "12")])
def test_malformed_prompts_are_refused(bad):
    with pytest.raises(ValueError):
        chain_answer(*bad)
    with pytest.raises(ValueError, match="unknown chain kind"):
        chain_answer("mul", "12=")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_prompt_sets(kind):
    spec = ChainSpec(kind, 4, 7)
    vocab = chain_vocab()
    prompts = chain_prompts(300, spec, seed=3)
    assert len({p.text for p in prompts}) == 300
    lens = set()
    for p in prompts:
        assert p.ids == [BOS] + vocab.encode(p.text) and p.reference == chain_answer(kind, p.text)
        assert len(p.ids) <= spec.max_prompt_tokens() and len(p.reference) + 1 <= spec.max_response_tokens()
        lens.add(len(p.text))
    assert len(lens) == 4  # every length 4..7 drawn
    held = chain_prompts(50, spec, seed=4, exclude={p.text for p in prompts})
    assert not {p.text for p in held} & {p.text for p in prompts}
    assert [p.text for p in chain_prompts(50, spec, seed=4, exclude={p.text for p in prompts})] == \
        [p.text for p in held]


def test_longest_answers_fit_exactly():
    # the bound is tight: the longest answer of each kind reaches it
    assert ChainSpec("add", 8, 8).max_response_tokens() == 17
    assert ChainSpec("runsum", 6, 6).max_response_tokens() == len("9,18,27,36,45,54") + 1
    assert ChainSpec("cumsum", 12, 16).max_response_tokens() == 17


def test_vocabulary_extends_the_demo_ids():
    v = chain_vocab()
    assert v.encode("0123456789+=") == CharVocab().encode("0123456789+=") and v.encode(",") == [15]
    assert v.size == 3 + len(CHAIN_CHARS) and tiny_chain_hf_config().vocab_size == v.size
    assert tiny_chain_hf_config(ChainSpec("add", 16, 16)).max_position_embeddings >= 1 + 34 + 33


def test_spec_validation():
    for bad in (dict(kind="mul"), dict(min_len=1), dict(min_len=5, max_len=4)):
        with pytest.raises(ValueError):
            ChainSpec(**bad)

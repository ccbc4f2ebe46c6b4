"""evaluate() end to end with the real CPU engine on a tiny model: pass rates equal a direct count,
timeouts score 0, and the caller's RNG streams are left exactly where they were."""
import math
import os
import random

import numpy as np
import pytest
import torch

from eval_fixtures import EXAMPLES, SLEEP_REWARD, arithmetic_rows
from megatron_s3ac.eval.benchmarks import Benchmark, prompt_ids
from megatron_s3ac.eval.report import flat_metrics, format_table
from megatron_s3ac.eval.rng import preserved_rng_state
from megatron_s3ac.eval.runner import BenchmarkSpec, batch_seed, evaluate
from megatron_s3ac.eval.scoring import extract_choice_letter
from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.rewards import math_reward
from megatron_s3ac.tasks.arithmetic import arithmetic_reward

K = 8
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=1)  # one token: a one-digit sum is right ~1/15


def arithmetic_spec(n=16):
    return BenchmarkSpec(arithmetic_rows(n), reward="arithmetic", template="raw")


def test_pass_rates_match_a_direct_count(engine, tokenizer):
    report = evaluate(engine, tokenizer, {"sums": arithmetic_spec()}, k=K, params=PARAMS, seed=7, batch_size=5)
    b = report["benchmarks"]["sums"]

    # Direct count: the same requests (the documented seed per batch of 5 prompts), scored by hand.
    rows = arithmetic_rows(16)
    correct = []
    for batch, start in enumerate(range(0, len(rows), 5)):
        chunk = rows[start:start + 5]
        out = engine.generate([tokenizer(r["prompt"])["input_ids"] for r in chunk],
                              SamplingParams(temperature=1.0, max_new_tokens=1, seed=batch_seed(7, "sums", batch)),
                              n_samples=K)
        correct += [[arithmetic_reward(s.response_text, r["answer"]) > 0 for s in samples]
                    for r, samples in zip(chunk, out)]
    correct = np.array(correct)
    assert correct.sum() > 0  # the check below is not vacuous
    assert b["avg_at_k"] == pytest.approx(correct.mean(axis=1).mean())
    assert b["pass_at_k"] == pytest.approx(correct.any(axis=1).mean())  # n == k: pass@k = any correct
    assert b["avg_at_k_ci95"][0] <= b["avg_at_k"] <= b["avg_at_k_ci95"][1]
    assert b["k"] == K and b["num_prompts"] == 16 and b["num_samples"] == 16 * K
    assert sum(b["finish_reasons"].values()) == 16 * K
    assert report["average_avg_at_k"] == b["avg_at_k"]

    again = evaluate(engine, tokenizer, {"sums": arithmetic_spec()}, k=K, params=PARAMS, seed=7, batch_size=5)
    assert again["benchmarks"]["sums"]["avg_at_k"] == b["avg_at_k"]  # reproducible from the seed


def test_math_and_choice_benchmarks(engine, tokenizer, pool):
    empty = Benchmark("empty", [], {"missing_answer": 2})
    report = evaluate(engine, tokenizer,
                      {"math500": os.path.join(EXAMPLES, "math500.jsonl"),
                       "mc": os.path.join(EXAMPLES, "multiple_choice.jsonl"), "empty": empty},
                      k={"math500": 2, "mc": 3}, params=SamplingParams(max_new_tokens=4), seed=0,
                      reward_pool=pool, keep_samples=True)
    m, c, e = (report["benchmarks"][n] for n in ("math500", "mc", "empty"))
    assert (m["k"], c["k"], e["k"]) == (2, 3, 1)  # per-benchmark k; unnamed ones get 1
    for b, verify in ((m, lambda resp, ref: math_reward(resp, ref) > 0),
                      (c, lambda resp, ref: extract_choice_letter(resp, 4) == ref)):
        for s in b["samples"]:  # every stored verdict agrees with the verifier run directly
            assert s["correct"] == [verify(r, s["reference"]) for r in s["responses"]]
        assert b["avg_at_k"] == pytest.approx(np.mean([np.mean(s["correct"]) for s in b["samples"]]))
    assert e["num_prompts"] == 0 and e["num_skipped"] == 2 and math.isnan(e["avg_at_k"])
    assert report["average_avg_at_k"] == pytest.approx((m["avg_at_k"] + c["avg_at_k"]) / 2)  # empty excluded
    table = format_table(report)
    assert "math500" in table and "n/a" in table
    assert set(flat_metrics(report)) >= {"eval/math500/avg@2", "eval/mc/pass@3", "eval/average"}


def test_verifier_timeout_scores_zero_in_report(engine, tokenizer, pool):
    rows = [{"problem": "1+1=", "answer": "2"}]
    report = evaluate(engine, tokenizer, {"slow": BenchmarkSpec(rows, reward=SLEEP_REWARD)}, k=2,
                      params=SamplingParams(max_new_tokens=2), reward_pool=pool)
    b = report["benchmarks"]["slow"]
    assert b["avg_at_k"] == 0.0 and b["verifier_timeouts"] == 2


def _rng_snapshot():
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone()


def _assert_same(a, b):
    assert a[0] == b[0]
    np.testing.assert_array_equal(a[1], b[1])
    assert torch.equal(a[2], b[2])


def test_evaluate_leaves_global_rng_unchanged(engine, tokenizer):
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    before = _rng_snapshot()
    # seed=None in params: evaluate must still not draw from the global stream
    evaluate(engine, tokenizer, {"sums": arithmetic_spec(4)}, k=2, params=SamplingParams(max_new_tokens=2))
    _assert_same(before, _rng_snapshot())


def test_training_stream_identical_with_and_without_eval(engine, tokenizer):
    """A toy training loop's random draws are the same whether or not it evaluates every 2 steps."""
    def train(with_eval):
        torch.manual_seed(0), np.random.seed(0), random.seed(0)
        draws = []
        for step in range(1, 5):
            draws.append((torch.rand(3).tolist(), np.random.rand(), random.random()))
            if with_eval and step % 2 == 0:
                evaluate(engine, tokenizer, {"sums": arithmetic_spec(3)}, k=2, params=PARAMS, seed=step)
        return draws

    assert train(True) == train(False)


def test_preserved_rng_state_restores_after_draws_and_errors():
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    before = _rng_snapshot()
    with pytest.raises(RuntimeError):
        with preserved_rng_state():
            torch.rand(5), np.random.rand(5), random.random()
            raise RuntimeError("eval failed")
    _assert_same(before, _rng_snapshot())


def test_prompt_ids_for_raw_template_match_tokenizer(tokenizer):
    from megatron_s3ac.eval.benchmarks import Item

    assert prompt_ids(Item("3+4=", "7", "math"), tokenizer, "raw") == tokenizer("3+4=")["input_ids"]


def test_cpu_demo_setup_matches_the_trainers_count():
    """The demo's own pieces (CharVocab, BOS-prefixed prompt ids, arithmetic reward, an engine
    without a tokenizer): evaluate() agrees with a count done the way the trainer's evaluate does."""
    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
    from megatron_s3ac.data.prompts import CharVocab
    from megatron_s3ac.tasks.arithmetic import arithmetic_prompts, tiny_arithmetic_hf_config

    vocab = CharVocab()
    engine = CPUEngine.from_config(tiny_arithmetic_hf_config(), seed=0)
    prompts = arithmetic_prompts(12, 9, seed=1, vocab=vocab)
    rows = [{"prompt": p.text, "prompt_ids": p.ids, "answer": p.reference} for p in prompts]
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    report = evaluate(engine, vocab, {"heldout": BenchmarkSpec(rows, reward="arithmetic")}, k=4, params=params,
                      seed=0, batch_size=64)
    out = engine.generate([p.ids for p in prompts], SamplingParams(temperature=1.0, max_new_tokens=3,
                                                                   seed=batch_seed(0, "heldout", 0)), n_samples=4)
    correct = np.array([[arithmetic_reward(vocab.decode(s.response_ids), p.reference) > 0 for s in samples]
                        for p, samples in zip(prompts, out)])
    b = report["benchmarks"]["heldout"]
    assert b["avg_at_k"] == pytest.approx(correct.mean()) and b["pass_at_k"] == pytest.approx(correct.any(1).mean())

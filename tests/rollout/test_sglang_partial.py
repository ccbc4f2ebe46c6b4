"""Partial rollout on SGLangEngine (rollout/engines/sglang/engine.py ``pause_generation`` / ``continue_generation`` /
``generate_continuations``) through the sglang 0.5.23 stand-in (fake_sglang.py item 10: the engine's
``tokenizer_manager`` coroutines on its event ``loop``, as entrypoints/engine.py:343, 396, 528-542 and
managers/tokenizer_manager.py:938-941, 2267-2286): a pause from another thread while ``generate`` blocks returns
the running request's tokens, log-probs and routes so far; the continuation on new weights is checked against a
teacher-forced transformers forward of those weights (the independent reference), as
tests/rollout/test_partial_rollout.py does for the CPU engine."""
import threading

import numpy as np
import pytest

from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.sglang.engine import SGLangConfig, SGLangEngine
from megatron_s3ac.rollout.partial import continuation_requests, merge

from fake_sglang import FakeSGLangEngine, save_tiny_qwen3_moe
from test_sglang_engine import teacher

PROMPTS = [[4, 5, 13, 6, 7, 14], [8, 9, 14]]
MAX_NEW = 10


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return (save_tiny_qwen3_moe(tmp_path_factory.mktemp("sgl_partial_a"), seed=0),
            save_tiny_qwen3_moe(tmp_path_factory.mktemp("sgl_partial_b"), seed=1))


def test_sglang_engine_pauses_a_running_generate_and_continues_on_new_weights(ckpts):
    from safetensors.torch import load_file

    ck0, ck1 = ckpts
    cfg = SGLangConfig(model_path=ck0, enable_return_routed_experts=True, enable_deterministic_inference=True)
    eng = SGLangEngine(cfg, engine_cls=FakeSGLangEngine, flush_retry_delay_s=0.001)
    fake, tm = eng.engine, eng.engine.tokenizer_manager
    assert eng.supports_pause
    fake.cpu._decode_delay = 0.1  # the running request is still decoding when the pause comes
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True, seed=3)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("g", eng.generate(PROMPTS, greedy, n_samples=2,
                                                                         return_routed_experts=True)))
    t.start()
    while tm.model_update_lock._readers == 0:
        t.join(timeout=0.01)
    t.join(timeout=0.35)  # a few tokens in
    eng.pause_generation()
    assert not t.is_alive() and tm.is_pause and tm.pause_calls == 1  # returned after the batch came back
    groups = got["g"]
    rows = [s for g in groups for s in g]
    assert all(s.finish_reason == "abort" for s in rows)
    first = rows[0]
    r = len(first.response_ids)
    assert 0 < r < MAX_NEW
    lp, routes = teacher(ck0, first.prompt_ids, first.response_ids)
    np.testing.assert_allclose(first.logprobs, lp, atol=1e-5)  # behaviour log-probs of the old weights
    P = len(first.prompt_ids)
    assert first.routed_experts.shape[0] == P + r - 1
    assert np.array_equal(np.sort(first.routed_experts, -1), np.sort(routes[:P + r - 1], -1))
    assert all(s.response_ids == [] and s.routed_experts is None for s in rows[1:])  # still waiting: aborted empty
    n_calls = fake.calls.count("generate")
    (late,) = eng.generate([PROMPTS[0]], greedy)  # while paused: aborted before sglang is asked
    assert late[0].finish_reason == "abort" and late[0].response_ids == [] and fake.calls.count("generate") == n_calls
    # the sync while paused (tokenizer_manager.py:2303-2307: no writer lock then), then continue
    eng.update_weights(load_file(f"{ck1}/model.safetensors").items(), require_complete=True)
    eng.continue_generation()
    assert not tm.is_pause
    tagged, reqs, n = continuation_requests(groups, 0, 1, MAX_NEW, max_versions=2)
    assert (n.resumed, n.unstarted, n.kept_tokens) == (1, 3, r)
    conts = eng.generate_continuations([(p, b) for _, _, p, b in reqs], greedy, return_routed_experts=True)
    for (gi, ki, prefix, b), c in zip(reqs, conts):
        assert c.prompt_ids == prefix and len(c.response_ids) == b and c.finish_reason == "length"
        lp1, routes1 = teacher(ck1, prefix, c.response_ids)
        np.testing.assert_allclose(c.logprobs, lp1, atol=1e-5)  # the new tokens under the new weights
        assert np.array_equal(np.sort(c.routed_experts, -1), np.sort(routes1, -1))
        full = merge(tagged[gi][ki], c, 1)
        k = len(groups[gi][ki].response_ids)
        assert full.token_versions.tolist() == [0] * k + [1] * (MAX_NEW - k) and full.finish_reason == "length"
    # a pause with nothing running only sets is_pause (the coroutine runs on the idle loop here)
    eng.pause_generation()
    assert tm.is_pause and tm.pause_calls == 2
    eng.continue_generation()
    (g,) = eng.generate([PROMPTS[1]], greedy)
    assert g[0].finish_reason == "length" and len(g[0].response_ids) == MAX_NEW

"""Partial rollout (rollout/partial.py) on the real CPU engine: pause -> aborted partial responses, continuation on
new weights, per-token versions across 2 syncs, the version bound; each piece checked against a transformers
forward of the weights that generated it (the independent reference)."""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_s3ac.rollout.base import PartialRolloutUnsupported, RolloutEngine, Sample, SamplingParams
from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
from megatron_s3ac.rollout.partial import PartialPending, continuation_requests, merge, unsupported_engine_reason

from rollout_fixtures import tiny_moe_config

PROMPTS = [[4, 5, 13, 6, 7, 14], [8, 9, 14]]
MAX_NEW = 12


def _weights(seed):
    """A full HF state dict of the tiny MoE (seeded random weights: one 'version' of the policy)."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_moe_config()).state_dict()


def _reference(state):
    m = AutoModelForCausalLM.from_config(tiny_moe_config())
    m.load_state_dict(state)
    return m.eval()


def _pause_after(engine, forwards: int):
    """Pause the engine from inside its ``forwards``-th model call of the next generate (a forward hook: the
    deterministic stand-in for the trainer's pause arriving mid-generation)."""
    count = [0]

    def hook(*_):
        count[0] += 1
        if count[0] == forwards:
            engine.pause_generation()

    return engine.model.register_forward_hook(hook)


def _scores(model, ids, start, temperature=1.0):
    """log_softmax(logits / T) of ids[start:] given everything before them (teacher forcing), and the argmax."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[start - 1:len(ids) - 1] / temperature, -1)
    return lp.gather(-1, torch.tensor(ids[start:])[:, None])[:, 0].numpy(), lp.argmax(-1).tolist()


def _generate_cut(engine, params, forwards):
    h = _pause_after(engine, forwards)
    try:
        return engine.generate(PROMPTS, params, n_samples=2, return_routed_experts=True)
    finally:
        h.remove()


def test_pause_returns_partial_responses_and_continuation_matches_new_weights():
    """A pause after 3 model calls (prefill + 2 decodes): every row returns 3 tokens, finish "abort", log-probs and
    routes of those tokens under the old weights; after loading new weights the continuation's tokens (greedy) and
    log-probs equal a teacher-forced transformers forward of the new weights on prompt + partial + new tokens."""
    w0, w1 = _weights(1), _weights(2)
    eng = CPUEngine.from_config(tiny_moe_config(), state_dict=w0)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    groups = _generate_cut(eng, greedy, 3)
    ref0, ref1 = _reference(w0), _reference(w1)
    for g in groups:
        for s in g:
            assert s.finish_reason == "abort" and len(s.response_ids) == 3
            assert s.routed_experts.shape[0] == len(s.prompt_ids) + 2  # the last token was not fed yet
            lp, top = _scores(ref0, s.prompt_ids + s.response_ids, len(s.prompt_ids))
            np.testing.assert_allclose(s.logprobs, lp, atol=1e-5)
            assert s.response_ids == top
    # a generate that starts while paused: every response empty and aborted (sglang's waiting queue)
    (late,) = eng.generate([PROMPTS[0]], greedy)
    assert late[0].finish_reason == "abort" and late[0].response_ids == []
    eng.update_weights(w1.items())
    eng.continue_generation()
    tagged, reqs, n = continuation_requests(groups, 0, 1, MAX_NEW, max_versions=2)
    assert (n.resumed, n.regenerated, n.unstarted, n.kept_tokens) == (4, 0, 0, 12)
    assert all(b == MAX_NEW - 3 for *_, b in reqs)
    conts = eng.generate_continuations([(p, b) for _, _, p, b in reqs], greedy, return_routed_experts=True)
    for (gi, ki, prefix, _), c in zip(reqs, conts):
        assert c.prompt_ids == prefix and len(c.response_ids) == MAX_NEW - 3 and c.finish_reason == "length"
        lp, top = _scores(ref1, prefix + c.response_ids, len(prefix))
        np.testing.assert_allclose(c.logprobs, lp, atol=1e-5)  # the new tokens only, under the new weights
        assert c.response_ids == top
        full = merge(tagged[gi][ki], c, 1)
        assert full.token_versions.tolist() == [0] * 3 + [1] * (MAX_NEW - 3)
        assert full.prompt_ids == groups[gi][ki].prompt_ids and full.finish_reason == "length"
        P = len(full.prompt_ids)
        assert full.routed_experts.shape[0] == P + MAX_NEW - 1
        # routes: rows before P + 2 from the old weights' piece, the rest from the continuation
        assert np.array_equal(full.routed_experts[:P + 2], groups[gi][ki].routed_experts)
        assert np.array_equal(full.routed_experts[P + 2:], c.routed_experts[P + 2:])


def test_token_versions_across_two_syncs_and_sampled_logprobs():
    """Sampled (T=0.8) generation cut twice: versions 0, 1, 2 in order on each response; each token's behaviour
    log-prob is the log_softmax(logits / T) of the version that generated it (three transformers references)."""
    ws = [_weights(s) for s in (3, 4, 5)]
    refs = [_reference(w) for w in ws]
    eng = CPUEngine.from_config(tiny_moe_config(), state_dict=ws[0])
    p = SamplingParams(temperature=0.8, max_new_tokens=MAX_NEW, ignore_eos=True, seed=11)
    groups = _generate_cut(eng, p, 3)  # 3 tokens at version 0
    for v in (1, 2):
        eng.update_weights(ws[v].items())
        eng.continue_generation()
        tagged, reqs, _ = continuation_requests(groups, 0, v, MAX_NEW, max_versions=3)
        h = _pause_after(eng, 3) if v == 1 else None  # the first continuation is cut again after 3 tokens
        try:
            pend = eng.continue_async([(pre, b) for _, _, pre, b in reqs], p)
        finally:
            if h is not None:
                h.remove()
        groups = PartialPending(tagged, reqs, pend, v).result()
    for g in groups:
        for s in g:
            assert s.finish_reason == "length" and len(s.response_ids) == MAX_NEW
            assert s.token_versions.tolist() == [0] * 3 + [1] * 3 + [2] * (MAX_NEW - 6)
            ids, P = s.prompt_ids + s.response_ids, len(s.prompt_ids)
            for v in range(3):
                lp, _ = _scores(refs[v], ids, P, temperature=0.8)
                at = s.token_versions == v
                np.testing.assert_allclose(s.logprobs[at], lp[at], atol=1e-5)


def test_version_bound_regenerates_from_the_prompt():
    """partial_max_versions=1: an interrupted response is not resumed; its tokens are dropped and it restarts
    from its prompt on the new weights (counted as regenerated); with 2 it is resumed."""
    eng = CPUEngine.from_config(tiny_moe_config(), state_dict=_weights(1))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    groups = _generate_cut(eng, greedy, 3)
    eng.continue_generation()
    tagged, reqs, n = continuation_requests(groups, 0, 1, MAX_NEW, max_versions=1)
    assert (n.resumed, n.regenerated, n.unstarted, n.kept_tokens) == (0, 4, 0, 0)
    assert [pre for *_, pre, _ in reqs] == [s.prompt_ids for g in groups for s in g]
    assert all(b == MAX_NEW for *_, b in reqs)
    conts = eng.generate_continuations([(pre, b) for *_, pre, b in reqs], greedy, return_routed_experts=True)
    full = merge(tagged[0][0], conts[0], 1)
    assert full.token_versions.tolist() == [1] * MAX_NEW
    assert full.routed_experts.shape[0] == len(full.prompt_ids) + MAX_NEW - 1
    with pytest.raises(ValueError, match="partial_max_versions=0 must be >= 1"):
        continuation_requests(groups, 0, 1, MAX_NEW, max_versions=0)


def test_unfinished_samples_pass_through_and_merge_checks_its_prefix():
    s = Sample([1, 2], [3, 4], np.array([-0.1, -0.2], np.float32), "stop")
    tagged, reqs, n = continuation_requests([[s]], 7, 8, MAX_NEW, max_versions=2)
    assert reqs == [] and tagged[0][0].token_versions.tolist() == [7, 7] and n.resumed == 0
    with pytest.raises(ValueError, match="prefix"):
        merge(s, Sample([1, 2, 9], [5], np.array([-1.0], np.float32), "stop"), 8)


def test_engines_that_cannot_pause_say_so():
    class Plain(RolloutEngine):
        def generate(self, *a, **k):
            return []

        update_weights = sleep = wake = flush_cache = lambda self, *a: None

    with pytest.raises(PartialRolloutUnsupported, match="Plain cannot pause generation"):
        Plain().pause_generation()
    assert "cpu / hf / sglang / vllm" in unsupported_engine_reason("sglang-like")


@pytest.mark.slow  # > 60 s under load; the fast suite's 20-minute budget (CI)
def test_remote_engine_pauses_a_running_generate():
    """RemoteEngine(pausable=True): pause_generation reaches the actor on its control thread while generate runs
    (each decode step slowed by the testing seam); the generate returns at once with partial, aborted responses; the
    weight update and continue_generation run after it, in order; the continuation completes each response."""
    import functools
    import time

    import ray

    from megatron_s3ac.rollout.engines.cpu.remote import RemoteEngine

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    env = {"runtime_env": {"env_vars": {"S3AC_TESTING_DECODE_DELAY": "0.25", "OMP_NUM_THREADS": "1"}}}
    factory = functools.partial(CPUEngine.from_config, tiny_moe_config(), state_dict=_weights(1))
    try:
        with RemoteEngine(factory, timeout_s=120, torch_threads=1, pausable=True, actor_options=env) as remote:
            assert remote.supports_pause
            greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
            pend = remote.generate_async(PROMPTS, greedy, n_samples=2)
            time.sleep(1.0)
            t = time.time()
            remote.pause_generation()
            groups = pend.result()
            assert time.time() - t < 0.25 * MAX_NEW  # it did not run to the end
            lens = {len(s.response_ids) for g in groups for s in g}
            assert all(s.finish_reason == "abort" for g in groups for s in g) and 0 < min(lens) <= max(lens) < MAX_NEW
            w2 = _weights(2)
            remote.update_weights(w2.items())
            remote.continue_generation()
            tagged, reqs, _ = continuation_requests(groups, 0, 1, MAX_NEW, max_versions=2)
            merged = PartialPending(tagged, reqs, remote.continue_async([(p, b) for *_, p, b in reqs], greedy),
                                    1).result()
            ref1 = _reference(w2)
            for g in merged:
                for s in g:
                    assert len(s.response_ids) == MAX_NEW and s.finish_reason == "length"
                    cut = int((s.token_versions == 0).sum())
                    lp, _ = _scores(ref1, s.prompt_ids + s.response_ids, len(s.prompt_ids))
                    np.testing.assert_allclose(s.logprobs[cut:], lp[cut:], atol=1e-5)
        with RemoteEngine(factory, timeout_s=120, torch_threads=1) as plain:
            assert not plain.supports_pause
            with pytest.raises(PartialRolloutUnsupported, match="started without pausable=True"):
                plain.pause_generation()
    finally:
        if started:
            ray.shutdown()

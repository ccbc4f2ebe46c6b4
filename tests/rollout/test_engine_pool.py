"""EnginePool: N SGLang engines (the 0.5.23 stand-in on a real model) in real Ray actors on CPU, each in its own
placement group; prompts split and gathered in order; weight sync through the object store and through the
broadcast group (trainer side = this process, gloo); dead and late engines named."""
import sys

import numpy as np
import pytest
import ray
import torch
from safetensors.torch import load_file

import fake_sglang
import rollout_fixtures
from megatron_s3ac.rollout.base import SamplingParams, iter_buckets
from megatron_s3ac.rollout.engines.sglang.broadcast import WeightBroadcaster
from megatron_s3ac.rollout.engines.pool import EngineDied, EnginePool, EngineTimeout, split_evenly
from megatron_s3ac.rollout.factory import SGLangSettings, make_engine_factory
from megatron_s3ac.rollout.engines.sglang.engine import PromptTooLongError, SessionSync, WeightUpdateError

from fake_sglang import FakeSGLangEngine, save_tiny_qwen3_moe

pytestmark = pytest.mark.slow  # two actors import torch + transformers: ~30-60 s on 2 cores

PROMPTS = [[4, 5, 13], [8, 9, 14, 6], [7, 7], [5, 6, 7, 8, 9], [10, 11]]


def test_split_evenly():
    assert split_evenly(5, 2) == [(0, 2), (2, 5)]
    assert split_evenly(1, 3) == [(0, 0), (0, 0), (0, 1)]
    assert sum(hi - lo for lo, hi in split_evenly(17, 4)) == 17


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("pool_ckpt"), seed=0)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Two other weight sets of the same architecture, under checkpoint names."""
    return [load_file(save_tiny_qwen3_moe(tmp_path_factory.mktemp(f"w{s}"), seed=s) + "/model.safetensors")
            for s in (1, 2)]


@pytest.fixture(scope="module")
def pool(ckpt):
    for m in (fake_sglang, rollout_fixtures):  # the stand-in travels by value into the actors
        ray.cloudpickle.register_pickle_by_value(m)
    started = not ray.is_initialized()
    if started:
        for attempt in range(3):  # Ray gives its raylet 30 s to register: an overloaded CI box can miss that
            try:
                ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
                break
            except Exception:
                ray.shutdown()
                if attempt == 2:
                    raise
    factory = make_engine_factory("sglang", model_dir=ckpt, settings=SGLangSettings(num_engines=2, bucket_mb=1),
                                  engine_cls=FakeSGLangEngine, torch_threads=1)
    p = EnginePool(factory, 2, cpus_per_engine=0.5, timeout_s=120, start_timeout_s=300)
    yield p, factory
    p.close()
    for m in (fake_sglang, rollout_fixtures):
        ray.cloudpickle.unregister_pickle_by_value(m)
    if started:
        ray.shutdown()


def served(p, e):
    return p.wait([p.submit(e, "engine.debug_checkpoint_state_dict")], "read back")[0]


def test_generate_splits_and_keeps_prompt_order(pool):
    p, factory = pool
    assert len({(i["pid"]) for i in p.info}) == 2 and p.tp_sizes == [1, 1]
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)
    out = p.generate(PROMPTS, params, n_samples=2, return_routed_experts=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = factory().generate(PROMPTS, params, n_samples=2, return_routed_experts=True)  # one engine, all prompts
    finally:
        torch.set_num_threads(threads)
    assert [[s.prompt_ids for s in g] for g in out] == [[q, q] for q in PROMPTS]
    for g, h in zip(out, ref):
        for s, r in zip(g, h):
            assert s.response_ids == r.response_ids  # request k carries seed + k on either engine
            np.testing.assert_allclose(s.logprobs, r.logprobs, atol=1e-5)
            assert np.array_equal(s.routed_experts, r.routed_experts)


def test_stream_hands_back_each_engines_chunk_with_generates_samples(pool):
    """Streaming rewards over a pool (the SGLang stand-in's engines): each engine's groups come back as that engine
    finishes, indexed in the whole batch; the samples are generate's."""
    p, _ = pool
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)
    want = p.generate(PROMPTS, params, n_samples=2, return_routed_experts=True)
    st = p.generate_stream_async(PROMPTS, params, n_samples=2, return_routed_experts=True)
    order = [i for i, _ in st.groups()]
    assert sorted(order) == list(range(len(PROMPTS)))
    halves = [list(range(lo, hi)) for lo, hi in split_evenly(len(PROMPTS), 2)]
    assert order in (halves[0] + halves[1], halves[1] + halves[0])  # engine by engine, each chunk in order
    for g, h in zip(st.result(), want):
        for s, r in zip(g, h):
            assert s.response_ids == r.response_ids and np.array_equal(s.logprobs, r.logprobs)
            assert np.array_equal(s.routed_experts, r.routed_experts)
    assert st.timing is not None


def test_too_long_prompt_is_named_by_its_index_in_the_batch(pool):
    p, _ = pool
    assert [i["context_length"] for i in p.info] == [256, 256]  # the checkpoint's max_position_embeddings
    prompts = PROMPTS[:3] + [[5] * 250] + PROMPTS[4:]  # prompt 3 of the batch = prompt 1 of engine 1's chunk
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
    with pytest.raises(PromptTooLongError, match="rollout engine 1 of 2 on .*: prompt 3 has 250 tokens; with "
                                                 "max_new_tokens=8 it needs 258 > the context length 256"):
        p.generate(prompts, params)
    # context unknown up front: the engine learns it from sglang's refusal (and numbers its own chunk)
    p.call_all("__setattr__", "context_length", None)
    for info in p.info:
        info["context_length"] = None
    with pytest.raises(PromptTooLongError, match="rollout engine 1 of 2 on .*: prompt 3 has 250 tokens"):
        p.generate(prompts, params)
    assert len(p.generate(PROMPTS, params)) == len(PROMPTS)  # refused up front: the pool still serves


def test_update_weights_reaches_every_engine(pool, weights):
    p, _ = pool
    stats = p.update_weights(weights[0].items(), bucket_bytes=16 * 1024, require_complete=True)
    assert stats["buckets"] > 1 and stats["tensors"] == len(weights[0])
    for e in range(2):
        got = served(p, e)
        for name, t in weights[0].items():
            torch.testing.assert_close(got[name], t, rtol=0, atol=0)
    # the trainer's bucket-by-bucket feed (weight_sync.sync_weights) through SessionSync: one session per engine
    sync = SessionSync(p, require_complete=True)
    for bucket in iter_buckets(weights[1].items(), 16 * 1024):
        sync.update_weights(bucket)
    sync.flush_cache()
    for e, calls in enumerate(p.call_all("engine.calls.copy")):
        tail = calls[len(calls) - 1 - calls[::-1].index("begin_weight_update"):]
        n = tail.count("update_weights_from_tensor")
        assert n > 1 and tail == ["begin_weight_update"] + ["update_weights_from_tensor"] * n + [
            "end_weight_update", "flush_cache"]
        got = served(p, e)
        for name, t in weights[1].items():
            torch.testing.assert_close(got[name], t, rtol=0, atol=0)


def test_broadcast_path_over_gloo(pool, weights):
    p, _ = pool
    b = WeightBroadcaster(p, group_name="s3ac-test-pp0", master_address="127.0.0.1", backend="gloo", timeout_s=120)
    b.connect()
    try:
        p.begin_weight_update()
        stats = b.send(iter_buckets(weights[1].items(), 16 * 1024))
        p.finish_sync(stats["names"], require_complete=True)
        assert stats["buckets"] > 1
        for e in range(2):
            got = served(p, e)
            for name, t in weights[1].items():
                torch.testing.assert_close(got[name], t, rtol=0, atol=0)
        # a name sglang would skip silently is refused before anything is broadcast (no receiver left waiting)
        p.begin_weight_update()
        with pytest.raises(WeightUpdateError, match="not in the served checkpoint"):
            b.send([[("model.language_model.embed_tokens.weight", torch.zeros(3))]])
        p.finish_sync([])
    finally:
        b.close()


def test_colocated_sleep_wake_order(pool, weights):
    p, _ = pool
    p.sleep()
    p.sync_colocated(weights[0].items(), require_complete=True)
    calls = p.call_all("engine.calls.copy")
    for c in calls:
        mem = [x for x in c if x.endswith("memory_occupation") or x in ("begin_weight_update", "end_weight_update")]
        assert mem[-5:] == ["release_memory_occupation", "resume_memory_occupation", "begin_weight_update",
                            "end_weight_update", "resume_memory_occupation"]
    out = p.generate(PROMPTS[:2], SamplingParams(temperature=0, max_new_tokens=2))
    assert all(np.isfinite(g[0].logprobs).all() for g in out)


@pytest.mark.parametrize("bad", ["unknown name", "wrong shape"])
def test_refused_update_loads_nothing_on_any_engine(pool, weights, bad):
    """All or nothing through the fan-out (issue 26): every engine checks the whole update before the sessions open,
    so a lazy stream whose last tensor is bad is refused naming it, no engine opened a session or loaded a bucket,
    each serves exactly its weights from before and the pool generates the same tokens and log-probs."""
    p, _ = pool
    before = [served(p, e) for e in range(2)]
    greedy = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    gen_before = p.generate(PROMPTS, greedy)
    calls_before = [len(c) for c in p.call_all("engine.calls.copy")]
    items = list(weights[1].items())
    culprit = (("model.extra.weight", items[0][1]) if bad == "unknown name" else (items[-1][0], items[-1][1][:1]))
    with pytest.raises(WeightUpdateError, match=culprit[0].replace(".", r"\.")):
        p.update_weights(iter(items[:-1] + [culprit]), bucket_bytes=16 * 1024)
    for e, calls in enumerate(p.call_all("engine.calls.copy")):
        assert "begin_weight_update" not in calls[calls_before[e]:]
        got = served(p, e)
        assert all(torch.equal(got[n], t) for n, t in before[e].items())
    gen_after = p.generate(PROMPTS, greedy)
    assert [s.response_ids for g in gen_after for s in g] == [s.response_ids for g in gen_before for s in g]
    assert all(np.array_equal(a.logprobs, b.logprobs) for g, h in zip(gen_after, gen_before) for a, b in zip(g, h))


def test_dead_and_late_engines_are_named(pool):
    p, _ = pool
    ray.kill(p.actors[1], no_restart=True)
    ref = p.actors[1].generate.remote(PROMPTS, SamplingParams(max_new_tokens=2), 1, False)
    with pytest.raises(EngineDied, match="rollout engine 1 of 2 .*died during generate"):
        p.wait([(1, ref)], "generate")
    with pytest.raises(EngineDied, match="rollout engine 1 of 2"):  # the pool stays failed
        p.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    ref = p.actors[0].generate.remote(PROMPTS * 4, SamplingParams(max_new_tokens=64, ignore_eos=True), 4, False)
    with pytest.raises(EngineTimeout, match="rollout engine 0 of 2 .*generate did not finish within 0.01 s"):
        p.wait([(0, ref)], "generate", timeout=0.01)


def test_pausable_pool_pauses_a_running_generate_and_continues(ckpt, pool, tmp_path):
    """EnginePool(pausable=True) of SGLang stand-ins: pause_generation reaches the actor on its control thread while
    its generate runs (SGLangEngine.pause_generation: the tokenizer manager's pause coroutine on sglang's loop);
    the generate returns the running request's tokens so far, aborted; after a weight update and
    continue_generation (default group, in order) the continuations' log-probs are the new weights' (a
    transformers forward of them)."""
    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.partial import PartialPending, continuation_requests

    from test_sglang_engine import teacher

    _, plain_factory = pool
    assert not pool[0].supports_pause
    new = save_tiny_qwen3_moe(tmp_path / "new", seed=1)
    p = EnginePool(plain_factory, 1, cpus_per_engine=0.5, timeout_s=120, start_timeout_s=300, pausable=True)
    try:
        assert p.supports_pause
        a = p.actors[0]
        ray.get(a.call.remote("engine.cpu.__setattr__", ("_decode_delay", 0.2), {}))
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, seed=5)
        pend = p.generate_async(PROMPTS, greedy, n_samples=1)
        readers = lambda: ray.get(a.call.options(concurrency_group="control").remote(
            "engine.tokenizer_manager.model_update_lock.__getattribute__", ("_readers",), {}))
        while readers() == 0:  # the batch is inside sglang's generate_request (tokenizer_manager.py:941)
            ray.wait([pend.chunks[0][0][1]], timeout=0.05)
        ray.wait([pend.chunks[0][0][1]], timeout=0.6)  # a few tokens in
        p.pause_generation()
        groups = pend.result()
        first = groups[0][0]
        assert all(s.finish_reason == "abort" for g in groups for s in g) and 0 < len(first.response_ids) < 8
        lp0, _ = teacher(ckpt, first.prompt_ids, first.response_ids)
        np.testing.assert_allclose(first.logprobs, lp0, atol=1e-5)
        p.update_weights(load_file(f"{new}/model.safetensors").items())
        p.continue_generation()
        tagged, reqs, _ = continuation_requests(groups, 0, 1, 8, max_versions=2)
        merged = PartialPending(tagged, reqs, p.continue_async([(q, b) for *_, q, b in reqs], greedy), 1).result()
        for g in merged:
            for s in g:
                assert len(s.response_ids) == 8 and s.finish_reason == "length"
                cut = int((s.token_versions == 0).sum())
                lp, _ = teacher(new, s.prompt_ids, s.response_ids)
                np.testing.assert_allclose(s.logprobs[cut:], lp[cut:], atol=1e-5)
    finally:
        p.close()

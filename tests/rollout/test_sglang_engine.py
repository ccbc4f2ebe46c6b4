"""SGLangEngine against the behavioural stand-in of sglang 0.5.23 (tests/rollout/fake_sglang.py), one test per
behaviour of issue 14, with independent references: a transformers teacher-forced forward for log-probs and
routes, the tensors that were sent for weights. Plus a GPU-only end-to-end test that skips without sglang."""
import base64
import importlib.util

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.sglang.engine import (
    FlushCacheError, PromptTooLongError, SGLangConfig, SGLangEngine, UnservableModelError, WeightUpdateError,
    decode_routed_experts, to_sglang_sampling_params,
)

from fake_sglang import FakeSGLangEngine, SchedulerDied, save_tiny_qwen3_moe

PROMPTS = [[4, 5, 13, 6, 7, 14], [8, 9, 14]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0)


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    """A second set of weights for the same architecture, under checkpoint names (what a sync sends)."""
    path = save_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe_b"), seed=1)
    return load_file(f"{path}/model.safetensors")


def make(ckpt, **config):
    cfg = SGLangConfig(model_path=ckpt, enable_return_routed_experts=True, enable_deterministic_inference=True,
                       **config)
    engine = SGLangEngine(cfg, engine_cls=FakeSGLangEngine, name="sglang engine 0", flush_retry_delay_s=0.001)
    return engine, engine.engine


_TEACHERS = {}


def teacher(ckpt_or_sd, prompt, response, temperature=1.0, ckpt_dir=None):
    """transformers teacher-forced log-probs [R] and router top-k [P+R-1, L, k] on the same weights."""
    from transformers import AutoModelForCausalLM

    path = ckpt_dir or ckpt_or_sd
    if path not in _TEACHERS:
        _TEACHERS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = _TEACHERS[path]
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    lp = torch.log_softmax(out.logits[0, :-1].float() / temperature, -1)
    tok_lp = lp[len(prompt) - 1:].gather(-1, ids[0, len(prompt):, None])[:, 0]
    k = model.config.num_experts_per_tok
    routes = torch.stack([r.view(ids.shape[1], -1).topk(k, -1).indices for r in out.router_logits], 1)
    return tok_lp.numpy(), routes[:-1].numpy()


def test_decode_routed_experts():
    routes = np.random.default_rng(0).integers(0, 300, size=(7, 3, 2))
    payload = base64.b64encode(routes.astype("<i4").tobytes()).decode()
    out = decode_routed_experts(payload, 7, 3, 2, num_experts=300)
    assert out.dtype == np.int16 and np.array_equal(out, routes)
    with pytest.raises(ValueError, match="expected"):
        decode_routed_experts(payload, 8, 3, 2, 300)


def test_sampling_params_always_carry_a_seed():
    sp = to_sglang_sampling_params(SamplingParams(temperature=0.6, top_k=0, seed=10, stop_strings=("\n",)), 3)
    assert sp["top_k"] == -1 and sp["sampling_seed"] == 13 and sp["stop"] == ["\n"]
    assert to_sglang_sampling_params(SamplingParams(), 2, base_seed=100)["sampling_seed"] == 102
    # sglang takes an int64 seed: a huge user seed wraps instead of overflowing the whole batch
    assert to_sglang_sampling_params(SamplingParams(seed=2**63 - 2), 3)["sampling_seed"] == 1


def test_generate_matches_transformers_teacher_forced(ckpt):
    engine, fake = make(ckpt)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.8, max_new_tokens=6, seed=5), n_samples=2,
                          return_routed_experts=True)
    assert [len(g) for g in out] == [2, 2]
    for prompt, group in zip(PROMPTS, out):
        for s in group:
            lp, routes = teacher(None, prompt, s.response_ids, 0.8, ckpt_dir=ckpt)
            np.testing.assert_allclose(s.logprobs, lp, atol=2e-5)
            assert np.array_equal(np.sort(s.routed_experts, -1), np.sort(routes, -1))
    assert out[0][0].response_ids != out[0][1].response_ids  # distinct seeds per sample


def test_seeds_distinct_without_params_seed_unlike_sglang_default_42(ckpt):
    engine, fake = make(ckpt)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    group = engine.generate([PROMPTS[0]], params, n_samples=3)[0]
    assert len({tuple(s.response_ids) for s in group}) > 1
    # the stand-in follows sglang: no sampling_seed under deterministic inference -> seed 42 for all
    raw = fake.generate(input_ids=[PROMPTS[0]] * 2, sampling_params=[{"max_new_tokens": 6, "ignore_eos": True}] * 2,
                        return_logprob=True)
    assert len({tuple(o["output_ids"]) for o in raw}) == 1


def test_seeds_are_plain_int64_even_from_a_huge_or_numpy_user_seed(ckpt):
    """sglang refuses the whole batch for a seed that is not a plain int in [-2**63, 2**63 - 1]."""
    engine, fake = make(ckpt)
    with pytest.raises(ValueError, match="sampling_seed must be an integer, got int64"):
        fake.generate(input_ids=[PROMPTS[0]], sampling_params=[{"max_new_tokens": 2, "sampling_seed": np.int64(3)}])
    with pytest.raises(ValueError, match="sampling_seed must be in"):
        fake.generate(input_ids=[PROMPTS[0]], sampling_params=[{"max_new_tokens": 2, "sampling_seed": 2**63}])
    for seed in (np.int64(7), 2**63 - 2):
        group = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2, seed=seed), n_samples=4)[0]
        assert len(group) == 4


def test_weight_update_is_one_session_and_loads_what_was_sent(ckpt, other_weights):
    engine, fake = make(ckpt)
    fake.calls.clear()
    engine.update_weights(other_weights.items(), bucket_bytes=16 * 1024, require_complete=True)
    kinds = fake.calls
    n = kinds.count("update_weights_from_tensor")
    assert n > 1 and kinds == ["begin_weight_update"] + ["update_weights_from_tensor"] * n + [
        "end_weight_update", "flush_cache"]
    served = fake.debug_checkpoint_state_dict()
    for name, t in other_weights.items():
        torch.testing.assert_close(served[name], t, rtol=0, atol=0)


def test_bucket_by_bucket_sync_is_one_session(ckpt, other_weights):
    """weight_sync.sync_weights feeds update_weights(bucket) per bucket then flush_cache(): SessionSync turns that
    into one session (sglang would otherwise open/close one per bucket, or load nothing without one)."""
    from megatron_s3ac.rollout.base import iter_buckets
    from megatron_s3ac.rollout.engines.sglang.engine import SessionSync

    engine, fake = make(ckpt)
    fake.calls.clear()
    sync = SessionSync(engine, require_complete=True)
    for bucket in iter_buckets(other_weights.items(), 16 * 1024):
        sync.update_weights(bucket)
    sync.flush_cache()
    n = fake.calls.count("update_weights_from_tensor")
    assert n > 1 and fake.calls == ["begin_weight_update"] + ["update_weights_from_tensor"] * n + [
        "end_weight_update", "flush_cache"]
    for name, t in other_weights.items():
        torch.testing.assert_close(fake.debug_checkpoint_tensor(name), t, rtol=0, atol=0)
    sync = SessionSync(engine, require_complete=True)  # an incomplete sync is refused at the end
    sync.update_weights(list(other_weights.items())[:2])
    with pytest.raises(WeightUpdateError, match="left .* served tensors unsent"):
        sync.flush_cache()
    assert fake.session is None


def test_flattened_buckets_one_payload_per_bucket(ckpt, other_weights):
    engine, fake = make(ckpt)
    fake.calls.clear()
    engine.update_weights(other_weights.items(), bucket_bytes=64 * 1024, flattened=True)
    assert fake.calls.count("update_weights_from_tensor") == engine.last_sync["buckets"] > 1
    served = fake.debug_checkpoint_state_dict()
    for name, t in other_weights.items():
        torch.testing.assert_close(served[name], t, rtol=0, atol=0)


def test_stand_in_refuses_updates_outside_a_session(ckpt, other_weights):
    _, fake = make(ckpt)
    ok, msg = fake.update_weights_from_tensor(named_tensors=list(other_weights.items())[:1])
    assert not ok and "must run between begin_weight_update() and end_weight_update()" in msg


def test_failed_update_names_engine_and_tensors_and_closes_the_session(ckpt, other_weights):
    engine, fake = make(ckpt)
    fake.update_weights_from_tensor = lambda **kw: (False, "Failed to update: disk on fire")
    first = next(iter(other_weights))
    with pytest.raises(WeightUpdateError, match=f"sglang engine 0: update_weights_from_tensor failed for bucket 0 "
                                                f"\\({first}.*disk on fire"):
        engine.update_weights(other_weights.items())
    assert fake.session is None  # end_weight_update was called: the next sync can open a new one


def test_unknown_names_refused_before_sending(ckpt, other_weights):
    engine, fake = make(ckpt)
    name = next(n for n in other_weights if n.startswith("model.layers."))
    vl_name = name.replace("model.", "model.language_model.", 1)
    fake.calls.clear()
    with pytest.raises(WeightUpdateError, match="model.language_model.*not in the served checkpoint.*silently"):
        engine.update_weights([(vl_name, other_weights[name])])
    assert "update_weights_from_tensor" not in fake.calls
    # what it prevents: the stand-in (like sglang's qwen3_moe loader) skips the name and reports success
    before = fake.debug_checkpoint_tensor(name).clone()
    fake.begin_weight_update()
    assert fake.update_weights_from_tensor(named_tensors=[(vl_name, other_weights[name])]) == (True, "Success")
    fake.end_weight_update()
    torch.testing.assert_close(fake.debug_checkpoint_tensor(name), before, rtol=0, atol=0)
    with pytest.raises(WeightUpdateError, match="has shape"):
        engine.update_weights([(name, other_weights[name][:1])])


def test_a_list_is_checked_whole_before_the_first_bucket(ckpt, other_weights):
    """Given every tensor at once, a bad name at the end refuses the sync before any bucket loads."""
    engine, fake = make(ckpt)
    items = list(other_weights.items())
    fake.calls.clear()
    with pytest.raises(WeightUpdateError, match="'model.extra.weight' is not in the served checkpoint"):
        engine.update_weights(items + [("model.extra.weight", items[0][1])], bucket_bytes=16 * 1024)
    assert "begin_weight_update" not in fake.calls and "update_weights_from_tensor" not in fake.calls


def _greedy(engine):
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    return [s.response_ids for g in out for s in g], [s.logprobs.tolist() for g in out for s in g]


@pytest.mark.parametrize("bad", ["unknown name", "wrong shape"])
def test_a_lazy_stream_is_checked_whole_before_the_first_bucket(ckpt, other_weights, bad):
    """All or nothing (issue 26): a lazy stream whose last tensor is bad is refused naming that tensor before the
    session opens and before the first bucket moves (the stand-in, like sglang, would have loaded the buckets before
    it); the engine then serves exactly an untouched engine's weights and generates the same tokens and log-probs."""
    engine, fake = make(ckpt)
    untouched, ref_fake = make(ckpt)
    items = list(other_weights.items())
    name = items[0][0]
    culprit = ("model.extra.weight", items[0][1]) if bad == "unknown name" else (name, items[0][1][:1])
    fake.calls.clear()
    with pytest.raises(WeightUpdateError, match=culprit[0].replace(".", r"\.")):
        engine.update_weights(iter(items[1:] + [culprit]), bucket_bytes=16 * 1024)
    assert "begin_weight_update" not in fake.calls and "update_weights_from_tensor" not in fake.calls
    served, ref = fake.debug_checkpoint_state_dict(), ref_fake.debug_checkpoint_state_dict()
    assert served.keys() == ref.keys() and all(torch.equal(served[n], ref[n]) for n in ref)
    assert _greedy(engine) == _greedy(untouched)


def test_a_sync_failed_midway_blocks_generation_until_a_full_sync(ckpt, other_weights):
    """An engine that fails a bucket after earlier ones loaded (here the stand-in answers (False, msg) for the
    second bucket) leaves a mix of old and new weights (sglang's advice: discard them), so generate refuses until a
    sync completes."""
    engine, fake = make(ckpt)
    items = list(other_weights.items())
    params = SamplingParams(max_new_tokens=2)
    real, calls = fake.update_weights_from_tensor, []

    def second_fails(**kw):
        calls.append(1)
        return (False, "Failed to update: disk on fire") if len(calls) == 2 else real(**kw)

    fake.update_weights_from_tensor = second_fails
    with pytest.raises(WeightUpdateError, match="bucket 1 .*disk on fire"):
        engine.update_weights(iter(items), bucket_bytes=16 * 1024)
    assert len(calls) == 2 and fake.session is None
    with pytest.raises(RuntimeError, match="sglang engine 0: generate after a weight sync failed midway"):
        engine.generate(PROMPTS, params)
    fake.update_weights_from_tensor = real
    engine.update_weights(iter(items), bucket_bytes=16 * 1024, require_complete=True)
    assert len(engine.generate(PROMPTS, params)) == 2


def test_served_names_from_config_alone(ckpt, tmp_path):
    """Without safetensors (only config.json) the served names/shapes come from the config."""
    import shutil

    from megatron_s3ac.rollout.engines.sglang.engine import served_weight_shapes

    shutil.copy(f"{ckpt}/config.json", tmp_path / "config.json")
    assert served_weight_shapes(str(tmp_path)) == served_weight_shapes(ckpt)


def test_busy_flush_is_retried_then_refused(ckpt, other_weights):
    engine, fake = make(ckpt)
    fake.busy_flushes = 3
    engine.update_weights(other_weights.items())  # 3 refusals, then success
    assert fake.calls[-4:] == ["flush_cache"] * 4
    fake.busy_flushes = 100
    with pytest.raises(FlushCacheError, match="sglang engine 0: flush_cache\\(\\) failed 7 times"):
        engine.flush_cache()


def test_wake_resumes_only_released_tags(ckpt):
    engine, fake = make(ckpt)
    engine.sleep(["kv_cache"])
    engine.wake()  # only kv_cache was released: resuming all three would KeyError in sglang
    engine.wake(["kv_cache", "cuda_graph"])  # nothing released any more: no call
    assert fake.calls.count("resume_memory_occupation") == 1 and fake.dead is None
    assert fake.offload_tags == set()
    # the stand-in reproduces sglang: resuming a tag that was not released raises KeyError and kills the engine
    with pytest.raises(KeyError):
        fake.resume_memory_occupation(tags=["weights"])
    with pytest.raises(SchedulerDied):
        fake.flush_cache()
    # ... and, like sglang, resume without tags after a partial release means all three: what wake() avoids
    engine, fake = make(ckpt)
    fake.release_memory_occupation(tags=["kv_cache"])
    with pytest.raises(KeyError, match="weights"):
        fake.resume_memory_occupation(tags=None)
    with pytest.raises(SchedulerDied):
        fake.flush_cache()


def test_colocated_order_and_lost_weights(ckpt, other_weights):
    engine, fake = make(ckpt)
    engine.sleep()
    assert fake.offload_tags == {"kv_cache", "weights", "cuda_graph"}
    with pytest.raises(WeightUpdateError, match="wake\\(\\['weights'\\]\\)"):
        engine.update_weights(other_weights.items())
    engine.wake(["weights"])
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    engine.update_weights(other_weights.items())
    engine.wake(["kv_cache", "cuda_graph"])
    assert [c for c in fake.calls if "memory" in c] == ["release_memory_occupation", "resume_memory_occupation",
                                                        "resume_memory_occupation"]
    s = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=4))[0][0]
    assert np.isfinite(s.logprobs).all()
    # weights released without a CPU backup and not re-sent: refused rather than sampling garbage
    engine.sleep(["weights"])
    engine.wake()
    with pytest.raises(RuntimeError, match="sync the weights"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))


def test_aborted_requests_become_abort_samples(ckpt):
    engine, fake = make(ckpt)
    fake.abort_requests = {1}
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=5, seed=0), n_samples=2,
                          return_routed_experts=True)
    flat = [s for g in out for s in g]
    assert [s.finish_reason == "abort" for s in flat] == [False, True, False, False]
    assert flat[1].routed_experts is None and flat[0].routed_experts is not None
    assert len(flat[1].logprobs) == len(flat[1].response_ids) <= 1


def test_prompts_over_the_context_are_refused_up_front(ckpt):
    engine, fake = make(ckpt, context_length=16)
    fake.calls.clear()
    with pytest.raises(PromptTooLongError, match="prompt 1 has 12 tokens.*max_new_tokens=8.*20 > the context "
                                                 "length 16"):
        engine.generate([[4, 5], [4] * 12], SamplingParams(max_new_tokens=8))
    assert "generate" not in fake.calls
    with pytest.raises(ValueError, match="exceeds the model's maximum context length"):  # sglang: whole batch
        fake.generate(input_ids=[[4, 5], [4] * 12], sampling_params=[{"max_new_tokens": 8}] * 2)
    engine.context_length = None  # not known up front (e.g. an injected engine): sglang's refusal is translated
    with pytest.raises(PromptTooLongError, match="prompt 1 has 12 tokens"):
        engine.generate([[4, 5], [4] * 12], SamplingParams(max_new_tokens=8))


def test_qwen3_moe_with_dense_layers_is_refused(tmp_path):
    path = save_tiny_qwen3_moe(tmp_path, mlp_only_layers=[1])
    with pytest.raises(UnservableModelError, match="mlp_only_layers=\\[1\\].*every Qwen3-MoE layer sparse"):
        SGLangEngine(SGLangConfig(model_path=path), engine_cls=FakeSGLangEngine)
    # the stand-in (like sglang) builds layer 1 as MoE and skips the dense MLP tensors without a word
    fake = FakeSGLangEngine(model_path=path)
    assert not any(".mlp.gate_proj" in n for n in fake.served if ".layers.1." in n)


def test_routes_need_the_launch_flag(ckpt):
    engine = SGLangEngine(SGLangConfig(model_path=ckpt), engine_cls=FakeSGLangEngine)
    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        engine.generate(PROMPTS, SamplingParams(), return_routed_experts=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        engine.generate(PROMPTS, SamplingParams(stop_strings=("x",)))


GPU_READY = torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_READY, reason="needs a CUDA GPU and sglang==0.5.23 installed (pip install .[gpu]); "
                                          "tools/device_checks/sglang_smoke.py is the full check")
def test_sglang_engine_on_gpu(tmp_path, tokenizer):
    """Real sglang: log-probs and routes against transformers teacher-forced on the same weights."""
    # bf16 checkpoint served in bf16 (fp32 may be refused by the default attention backend on Hopper); the teacher
    # runs the same bf16 weights in fp32, so the gap is the engine's bf16 arithmetic only. Tolerances from
    # transformers bf16 vs fp32 on this architecture (CPU, 5 seeds x 2 prompts x 8 greedy tokens): per-token
    # |d log-prob| <= 0.14 (mean <= 0.03), router top-k agreement >= 0.976; a wrong weight / position is ~1-3.
    path = save_tiny_qwen3_moe(tmp_path, head_dim=64, hidden_size=256, num_attention_heads=4, dtype=torch.bfloat16)
    tokenizer.save_pretrained(path)
    engine = SGLangEngine(SGLangConfig(model_path=path, enable_return_routed_experts=True, mem_fraction_static=0.3,
                                       dtype="bfloat16", enable_deterministic_inference=True))
    try:
        out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8), return_routed_experts=True)
        for prompt, group in zip(PROMPTS, out):
            lp, routes = teacher(None, prompt, group[0].response_ids, ckpt_dir=path)
            np.testing.assert_allclose(group[0].logprobs, lp, atol=0.25)
            assert np.abs(group[0].logprobs - lp).mean() < 0.05
            assert (np.sort(group[0].routed_experts, -1) == np.sort(routes, -1)).mean() > 0.95
    finally:
        engine.shutdown()


def test_context_length_defaults_like_sglang():
    """utils/hf_transformers/common.py:677-694: the first length key (times the RoPE factor unless the config keeps
    the original length), else 2048; no config at all: unknown (None), sglang's own refusal is then named later."""
    from megatron_s3ac.rollout.engines.sglang.engine import _context_length

    assert _context_length({"max_position_embeddings": 4096}) == 4096
    assert _context_length({"seq_length": 1000, "max_position_embeddings": 4096}) == 1000
    assert _context_length({"max_position_embeddings": 4096, "rope_scaling": {"factor": 4.0}}) == 16384
    assert _context_length({"max_position_embeddings": 4096,
                            "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 1024}}) == 4096
    # transformers 5 writes rope_parameters (sglang reads it through the config's rope_scaling alias)
    assert _context_length({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "yarn", "factor": 2.0,
                                                                                 "rope_theta": 1e6}}) == 8192
    assert _context_length({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default"}}) == 4096
    assert _context_length({"hidden_size": 64}) == 2048
    assert _context_length({}) is None


def test_stand_in_pause_and_continue_as_sglang(ckpt):
    """fake_sglang.py item 10 (sglang 0.5.23 entrypoints/engine.py:343, 396, 528-542, managers/tokenizer_manager.py:
    938-941, 2267-2286, managers/scheduler.py:5685-5705, 5797-5813, managers/schedule_batch.py:332-345): the pause
    coroutine handed to the engine's loop while a batch runs returns the running request's tokens and log-probs so
    far with finish_reason "Aborted" (+ routes), the waiting ones empty with "Abort in waiting queue"; the loop stops
    with the generate's result before the pause coroutine ends (it is asleep in its poll) and finishes when the loop
    runs again; a generate sent while paused waits for continue_generation."""
    import asyncio
    import threading
    import types

    fake = FakeSGLangEngine(model_path=ckpt, enable_return_routed_experts=True, enable_deterministic_inference=True)
    tm, loop = fake.tokenizer_manager, fake.loop
    fake.cpu._decode_delay = 0.2
    sp = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("out", fake.generate(
        input_ids=PROMPTS, sampling_params=[sp, sp], return_logprob=True, return_routed_experts=True)))
    t.start()
    while tm.model_update_lock._readers == 0:  # the batch is past the is_pause check (tokenizer_manager.py:941)
        t.join(timeout=0.01)
    fut = asyncio.run_coroutine_threadsafe(tm.pause_generation(types.SimpleNamespace(mode="abort")), loop)
    t.join(timeout=60)
    assert not t.is_alive() and not fut.done()  # the loop stopped with the batch; the pause sleeps inside it
    loop.run_until_complete(asyncio.wrap_future(fut, loop=loop))
    assert fut.done() and tm.is_pause
    running, waiting = got["out"]
    assert running["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                                     "err_type": None}
    r = len(running["output_ids"])
    assert 0 < r < 10 and len(running["meta_info"]["output_token_logprobs"]) == r
    lp, _ = teacher(ckpt, PROMPTS[0], running["output_ids"])
    np.testing.assert_allclose([x[0] for x in running["meta_info"]["output_token_logprobs"]], lp, atol=1e-5)
    assert "routed_experts" in running["meta_info"]
    assert waiting["output_ids"] == [] and "routed_experts" not in waiting["meta_info"]
    assert waiting["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    late = {}
    t2 = threading.Thread(target=lambda: late.setdefault("out", fake.generate(
        input_ids=PROMPTS[1], sampling_params={**sp, "max_new_tokens": 3}, return_logprob=True)))
    t2.start()
    t2.join(timeout=0.5)
    assert t2.is_alive() and "out" not in late  # held while paused (tokenizer_manager.py:938-939)
    # t2's generate runs the loop: the continue coroutine handed to it runs there
    asyncio.run_coroutine_threadsafe(tm.continue_generation(types.SimpleNamespace(torch_empty_cache=True)),
                                     loop).result(timeout=30)
    t2.join(timeout=60)
    assert late["out"]["meta_info"]["finish_reason"]["type"] == "length" and len(late["out"]["output_ids"]) == 3
    with pytest.raises(NotImplementedError, match="'retract'"):
        loop.run_until_complete(tm.pause_generation(types.SimpleNamespace(mode="retract")))

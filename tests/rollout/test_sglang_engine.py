"""SGLangEngine's own logic (request building, decoding, buckets, flushes) on a fake sglang server,
plus a GPU-only end-to-end test that skips without CUDA + sglang."""
import base64
import importlib.util

import numpy as np
import pytest
import torch
from transformers.core_model_loading import revert_weight_conversion

from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.cpu_engine import CPUEngine
from megatron_s3ac.rollout.sglang_engine import (
    SGLangConfig, SGLangEngine, decode_routed_experts, to_sglang_sampling_params,
)

from rollout_fixtures import tiny_moe_config
from fake_sglang import FakeSGLangEngine

PROMPTS = [[4, 5, 13, 6, 7, 14], [8, 9, 14]]


def make(seed=0, **config):
    cpu = CPUEngine.from_config(tiny_moe_config(), seed=seed)
    fake = FakeSGLangEngine(cpu)
    cfg = SGLangConfig(model_path="unused", enable_return_routed_experts=True, **config)
    return SGLangEngine(cfg, num_layers=3, top_k=2, num_experts=8, engine=fake), cpu, fake


def test_decode_routed_experts():
    routes = np.random.default_rng(0).integers(0, 300, size=(7, 3, 2))
    payload = base64.b64encode(routes.astype("<i4").tobytes()).decode()
    out = decode_routed_experts(payload, 7, 3, 2, num_experts=300)
    assert out.dtype == np.int16 and np.array_equal(out, routes)
    assert np.array_equal(decode_routed_experts(torch.tensor(routes), 7, 3, 2, 300), routes)  # old builds
    with pytest.raises(ValueError, match="expected"):
        decode_routed_experts(payload, 8, 3, 2, 300)
    with pytest.raises(ValueError, match="outside"):
        decode_routed_experts(payload, 7, 3, 2, 100)


def test_sampling_params_conversion():
    sp = to_sglang_sampling_params(SamplingParams(temperature=0.6, top_k=0, seed=10, stop_strings=("\n",)), 3)
    assert sp["top_k"] == -1 and sp["sampling_seed"] == 13 and sp["stop"] == ["\n"]
    assert "sampling_seed" not in to_sglang_sampling_params(SamplingParams())


def test_generate_decodes_sglang_outputs():
    engine, cpu, fake = make()
    params = SamplingParams(temperature=0.8, max_new_tokens=10, seed=5)
    out = engine.generate(PROMPTS, params, n_samples=2, return_routed_experts=True)
    assert [len(g) for g in out] == [2, 2]
    k = 0
    for i, group in enumerate(out):
        for s in group:  # request k carries seed + k: compare with the CPU engine run directly
            ref = cpu.generate([PROMPTS[i]], SamplingParams(temperature=0.8, max_new_tokens=10, seed=5 + k),
                               return_routed_experts=True)[0][0]
            assert s.prompt_ids == PROMPTS[i] and s.response_ids == ref.response_ids
            assert s.finish_reason == ref.finish_reason
            np.testing.assert_allclose(s.logprobs, ref.logprobs, atol=1e-6)
            assert s.routed_experts.dtype == np.uint8 and np.array_equal(s.routed_experts, ref.routed_experts)
            k += 1
    assert out[0][0].response_ids != out[0][1].response_ids  # distinct seeds per sample


def test_update_weights_in_bounded_buckets_then_flush():
    engine, cpu, fake = make(seed=0)
    other = CPUEngine.from_config(tiny_moe_config(), seed=1)
    sd = revert_weight_conversion(other.model, dict(other.model.state_dict()))
    bucket_bytes = 8 * 1024
    engine.update_weights(sd.items(), bucket_bytes=bucket_bytes)
    updates = [size for name, size in fake.calls if name == "update_weights_from_tensor"]
    largest = max(t.numel() * t.element_size() for t in sd.values())
    assert len(updates) > 1 and all(size <= max(bucket_bytes, largest) for size in updates)
    assert sum(updates) == sum(t.numel() * t.element_size() for t in sd.values())
    assert fake.calls[-1] == ("flush_cache", None)  # one flush, after the last bucket
    assert [c for c, _ in fake.calls].count("flush_cache") == 1
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    assert cpu.generate(PROMPTS, greedy)[0][0].response_ids == other.generate(PROMPTS, greedy)[0][0].response_ids


def test_sleep_wake_tags():
    engine, _, fake = make()
    engine.sleep()
    engine.wake(["weights"])
    engine.wake(["kv_cache", "cuda_graph"])
    assert fake.calls == [("release_memory_occupation", None), ("resume_memory_occupation", ["weights"]),
                          ("resume_memory_occupation", ["kv_cache", "cuda_graph"])]
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.sleep(["kv"])
    no_saver, _, _ = make(enable_memory_saver=False)
    with pytest.raises(RuntimeError, match="enable_memory_saver"):
        no_saver.sleep()


def test_routes_need_the_launch_flag():
    cpu = CPUEngine.from_config(tiny_moe_config(), seed=0)
    engine = SGLangEngine(SGLangConfig(model_path="unused"), num_layers=3, top_k=2, num_experts=8,
                          engine=FakeSGLangEngine(cpu))
    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        engine.generate(PROMPTS, SamplingParams(), return_routed_experts=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        engine.generate(PROMPTS, SamplingParams(stop_strings=("x",)))


GPU_READY = torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_READY, reason="needs a CUDA GPU and sglang==0.5.23 installed (pip install .[gpu])")
def test_sglang_engine_on_gpu(tmp_path, tokenizer):
    """Real sglang: routed experts equal the CPU engine's teacher-forced top-k on the same weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_moe_config()).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = SGLangEngine(SGLangConfig(model_path=str(tmp_path), enable_return_routed_experts=True,
                                       mem_fraction_static=0.3, dtype="float32"))
    try:
        out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8), return_routed_experts=True)
        cpu = CPUEngine.from_pretrained(str(tmp_path), tokenizer=None)
        for prompt, group in zip(PROMPTS, out):
            s = group[0]
            ref = cpu.generate([prompt], SamplingParams(temperature=0, max_new_tokens=8), return_routed_experts=True)
            assert s.response_ids == ref[0][0].response_ids
            np.testing.assert_allclose(s.logprobs, ref[0][0].logprobs, atol=1e-3)
            agree = (np.sort(s.routed_experts, -1) == np.sort(ref[0][0].routed_experts, -1)).mean()
            assert agree > 0.99
        other = CPUEngine.from_config(tiny_moe_config(), seed=1).model
        engine.update_weights((k, v.cuda()) for k, v in revert_weight_conversion(other, dict(other.state_dict())).items())
        engine.sleep()
        engine.wake()
    finally:
        engine.shutdown()

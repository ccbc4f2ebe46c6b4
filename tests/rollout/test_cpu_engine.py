"""CPU engine: determinism, log-probs and routed experts vs a teacher-forced forward, stops, weights."""
import numpy as np
import pytest
import torch
from transformers import Qwen2Config
from transformers.core_model_loading import revert_weight_conversion

from megatron_s3ac.rollout.base import SamplingParams, routed_experts_dtype
from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine

from rollout_fixtures import tiny_moe_config

PROMPTS = [[4, 5, 13, 6, 7, 14], [8, 9, 14], [10]]  # "12+34=", "56=", "7"


def teacher_forced(engine, sample, temperature):
    """Log-probs [R] of the response and router top-k {layer: [P+R-1, K]} from one plain forward."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        out = engine.model(input_ids=ids, output_router_logits=True)
    P, R = len(sample.prompt_ids), len(sample.response_ids)
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(out.logits[0, P - 1:P + R - 1].float() / scale, -1)
    lp = logp.gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0].numpy()
    # router_logits: one [tokens, E] tensor per MoE layer, in layer order
    topk = {layer: torch.topk(logits.softmax(-1), engine.top_k, -1).indices[: P + R - 1].numpy()
            for layer, logits in zip(engine.moe_layers, out.router_logits)}
    return lp, topk


def test_compact_dtype():
    assert routed_experts_dtype(8) == np.uint8 and routed_experts_dtype(256) == np.uint8
    assert routed_experts_dtype(257) == np.int16 and routed_experts_dtype(32768) == np.int16
    assert routed_experts_dtype(40000) == np.int32


def test_same_seed_same_samples(moe_engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=123)
    a = moe_engine.generate(PROMPTS, params, n_samples=3)
    b = moe_engine.generate(PROMPTS, params, n_samples=3)
    c = moe_engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=12, seed=7), n_samples=3)
    flat = lambda out: [s.response_ids for group in out for s in group]
    assert flat(a) == flat(b)
    assert flat(a) != flat(c)
    assert [len(g) for g in a] == [3, 3, 3]
    assert all(s.prompt_ids == PROMPTS[i] for i, g in enumerate(a) for s in g)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_new_tokens=16, seed=1),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, seed=2),
    SamplingParams(temperature=0.0, max_new_tokens=8),
])
def test_logprobs_and_routes_match_teacher_forced(moe_engine, params):
    out = moe_engine.generate(PROMPTS, params, n_samples=4, return_routed_experts=True)
    for group in out:
        for s in group:
            lp, topk = teacher_forced(moe_engine, s, params.temperature)
            np.testing.assert_allclose(s.logprobs, lp, atol=1e-5, rtol=0)
            assert s.logprobs.dtype == np.float32
            P, R = len(s.prompt_ids), len(s.response_ids)
            assert s.routed_experts.shape == (P + R - 1, 3, 2)
            assert s.routed_experts.dtype == np.uint8
            for layer in (0, 2):  # MoE layers: exactly the router's top-k, in its order
                np.testing.assert_array_equal(s.routed_experts[:, layer], topk[layer])
            assert not s.routed_experts[:, 1].any()  # dense layer: zero rows, as SGLang


def test_greedy_is_argmax(moe_engine):
    s = moe_engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))[0][0]
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logits = moe_engine.model(input_ids=ids).logits[0]
    P = len(s.prompt_ids)
    assert s.response_ids == logits[P - 1:-1].argmax(-1).tolist()


def test_length_truncation(moe_engine):
    out = moe_engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, ignore_eos=True, seed=0), n_samples=2)
    for s in (s for g in out for s in g):
        assert s.finish_reason == "length" and len(s.response_ids) == 5 and len(s.logprobs) == 5


def test_stop_token(moe_engine):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, seed=3)
    free = moe_engine.generate([PROMPTS[0]], params)[0][0]
    stop = free.response_ids[4]
    first = free.response_ids.index(stop)
    stopped = moe_engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=20, ignore_eos=True, seed=3,
                                                               stop_token_ids=(stop,)))[0][0]
    assert stopped.finish_reason == "stop"
    assert stopped.response_ids == free.response_ids[: first + 1]  # the stop token is kept
    np.testing.assert_allclose(stopped.logprobs, free.logprobs[: first + 1], atol=1e-6)


def test_eos_stops_unless_ignored(tokenizer):
    # Same seed -> same weights; declare as EOS a token that greedy decoding emits at step 2.
    free = CPUEngine.from_config(tiny_moe_config(), seed=5).generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))[0][0]
    eos = free.response_ids[2]
    engine = CPUEngine.from_config(tiny_moe_config(eos_token_id=eos), seed=5)
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=8))[0][0]
    assert out.finish_reason == "stop" and out.response_ids == free.response_ids[: free.response_ids.index(eos) + 1]
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))[0][0]
    assert out.finish_reason == "length" and out.response_ids == free.response_ids


def test_stop_string(moe_engine, tokenizer):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, seed=11)
    free = moe_engine.generate([PROMPTS[1]], params)[0][0]
    text = free.response_text
    assert text == tokenizer.decode(free.response_ids, skip_special_tokens=True)
    stop = text[5:7]
    end = text.index(stop) + len(stop)
    stopped = moe_engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=24, ignore_eos=True, seed=11,
                                                               stop_strings=(stop,)))[0][0]
    assert stopped.finish_reason == "stop"
    assert stopped.response_text.endswith(stop) and stop not in stopped.response_text[:-1]
    assert stopped.response_text == text[:end]


def test_stop_string_needs_tokenizer():
    engine = CPUEngine.from_config(tiny_moe_config(), seed=0)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate([[3]], SamplingParams(stop_strings=("a",)))


def checkpoint_state_dict(engine):
    """The engine's weights under HF checkpoint names (per-expert), as a converter exports them."""
    return revert_weight_conversion(engine.model, dict(engine.model.state_dict()))


def test_update_weights_from_checkpoint_names(tokenizer):
    a = CPUEngine.from_config(tiny_moe_config(), tokenizer=tokenizer, seed=0)
    b = CPUEngine.from_config(tiny_moe_config(), tokenizer=tokenizer, seed=1)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    before, target = a.generate(PROMPTS, params), b.generate(PROMPTS, params)
    sd = checkpoint_state_dict(b)
    assert any(".experts.3.gate_proj.weight" in k for k in sd)  # per-expert names, not fused
    a.update_weights(sd.items())
    after = a.generate(PROMPTS, params)
    assert [s.response_ids for g in after for s in g] == [s.response_ids for g in target for s in g]
    assert [s.response_ids for g in after for s in g] != [s.response_ids for g in before for s in g]
    for x, y in zip(after, target):
        np.testing.assert_array_equal(x[0].logprobs, y[0].logprobs)


def test_update_weights_rejects_bad_names_and_shapes(moe_engine):
    with pytest.raises(KeyError, match="closest known names"):
        moe_engine.update_weights([("model.layers.0.mlp.experts.0.gate_prj.weight", torch.zeros(16, 32))])
    with pytest.raises(ValueError, match="shape mismatch"):
        moe_engine.update_weights([("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(32, 16))])
    with pytest.raises(ValueError, match="shape mismatch"):
        moe_engine.update_weights([("model.embed_tokens.weight", torch.zeros(3, 32))])


def _bad_updates():
    """(update list, error type, the tensor the error must name): a valid first tensor (the norm zeroed, a change
    that moves every log-prob) before the bad one, as in issue 26."""
    from megatron_s3ac.convert.fp8 import quantize_blockwise

    good = ("model.norm.weight", torch.zeros(32))
    w = torch.randn(32, 16)  # layer 0 is sparse: expert 0's down_proj [hidden 32, moe_intermediate 16]
    q, scale = quantize_blockwise(w)
    down = "model.layers.0.mlp.experts.0.down_proj.weight"
    return [
        ([good, ("model.layers.0.mlp.no_such_proj.weight", torch.zeros(16, 32))], KeyError,
         "model.layers.0.mlp.no_such_proj.weight"),
        ([good, ("model.layers.0.self_attn.q_proj.weight", torch.zeros(32, 31))], ValueError,
         "model.layers.0.self_attn.q_proj.weight"),
        ([good, ("model.layers.0.self_attn.k_proj.weight", torch.zeros(16, 32, dtype=torch.int64))], ValueError,
         "model.layers.0.self_attn.k_proj.weight"),
        ([good, (down, q), (down + "_scale_inv", torch.ones(scale.shape[0] + 1, scale.shape[1]))], ValueError,
         down + "_scale_inv"),
        ([good, ("model.layers.2.mlp.experts.7.up_proj.weight", torch.zeros(16, 32)),
          ("model.layers.2.mlp.experts.8.up_proj.weight", torch.zeros(16, 32))], KeyError,
         "model.layers.2.mlp.experts.8.up_proj.weight"),  # 8 experts: index 8 does not exist
    ]


@pytest.mark.parametrize("case", range(5))
def test_refused_update_loads_nothing(tokenizer, case):
    """All or nothing: an update with an unknown name, a wrong shape, a non-float dtype or a bad fp8 scale raises
    naming that tensor, and the engine then generates exactly what an untouched engine generates (tokens and
    log-probs, sampled and greedy) and holds the same weights; a valid update after it still loads."""
    named, err, culprit = _bad_updates()[case]
    engine = CPUEngine.from_config(tiny_moe_config(), tokenizer=tokenizer, seed=0)
    untouched = CPUEngine.from_config(tiny_moe_config(), tokenizer=tokenizer, seed=0)
    with pytest.raises(err, match=culprit.replace(".", r"\.")):
        engine.update_weights(named)
    for params in (SamplingParams(temperature=1.0, max_new_tokens=8, seed=5, ignore_eos=True),
                   SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)):
        got, ref = engine.generate(PROMPTS, params, n_samples=2), untouched.generate(PROMPTS, params, n_samples=2)
        assert [s.response_ids for g in got for s in g] == [s.response_ids for g in ref for s in g]
        for g, r in zip(got, ref):
            for x, y in zip(g, r):
                np.testing.assert_array_equal(x.logprobs, y.logprobs)
    for (n, a), b in zip(engine.model.state_dict().items(), untouched.model.state_dict().values()):
        assert torch.equal(a, b), n
    engine.update_weights([named[0]])  # the engine still takes a good update (no half-joined fp8 pair left)
    assert torch.equal(engine.model.model.norm.weight, torch.zeros(32))
    changed = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    assert [s.logprobs.tolist() for g in changed for s in g] != \
        [s.logprobs.tolist() for g in untouched.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8,
                                                                                 ignore_eos=True)) for s in g]


def test_check_weights_names_the_tensor(moe_engine):
    """check_weights (what RemoteEngine asks before streaming an update) refuses like update_weights, loading nothing;
    dtypes may come as names (the remote records' spelling)."""
    moe_engine.check_weights(["model.norm.weight", "lm_head.weight"], [(32,), (moe_engine.config.vocab_size, 32)],
                             ["float32", torch.bfloat16])
    with pytest.raises(KeyError, match="model.norm.weights"):
        moe_engine.check_weights(["model.norm.weights"], [(32,)])
    with pytest.raises(ValueError, match="dtype mismatch for model.norm.weight"):
        moe_engine.check_weights(["model.norm.weight"], [(32,)], ["bool"])


def test_tied_embeddings_dense_model():
    cfg = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    a, b = CPUEngine.from_config(cfg, seed=0), CPUEngine.from_config(cfg, seed=1)
    assert a.model.lm_head.weight is a.model.model.embed_tokens.weight
    a.update_weights(b.model.state_dict().items())  # in-memory names are accepted too
    assert torch.equal(a.model.lm_head.weight, b.model.lm_head.weight)
    with pytest.raises(ValueError, match="no MoE router"):
        a.generate([[3]], SamplingParams(max_new_tokens=2), return_routed_experts=True)


def test_sleep_wake(tokenizer):
    engine = CPUEngine.from_config(tiny_moe_config(), tokenizer=tokenizer, seed=0)
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    ref = engine.generate(PROMPTS, params)
    sd = checkpoint_state_dict(engine)
    sd = {k: v.clone() for k, v in sd.items()}

    engine.sleep(keep_cpu_backup=True)
    assert all(p.numel() == 0 for p in engine.model.parameters())  # storage really dropped
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, params)
    engine.wake()
    assert [s.response_ids for g in engine.generate(PROMPTS, params) for s in g] == \
        [s.response_ids for g in ref for s in g]

    engine.sleep()  # no backup: the values are gone, generation is refused until reloaded
    engine.wake()
    with pytest.raises(RuntimeError, match="not loaded"):
        engine.generate(PROMPTS, params)
    items = list(sd.items())
    engine.update_weights(items[: len(items) // 2])
    with pytest.raises(RuntimeError, match="not loaded"):
        engine.generate(PROMPTS, params)
    engine.update_weights(items[len(items) // 2:])
    assert [s.response_ids for g in engine.generate(PROMPTS, params) for s in g] == \
        [s.response_ids for g in ref for s in g]


def test_qwen3_5_moe_hybrid_routes_and_logprobs():
    """The router search is generic: Qwen3.5-MoE (Gated DeltaNet + attention, shared expert) works too,
    including dropping finished rows from its linear-attention cache."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(vocab_size=44, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                               shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                               linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                               linear_value_head_dim=8, eos_token_id=1, pad_token_id=0, initializer_range=0.2)
    engine = CPUEngine.from_config(cfg, seed=0)
    assert engine.moe_layers == [0, 1, 2, 3]
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=0), n_samples=2, return_routed_experts=True)
    for s in (s for g in out for s in g):
        lp, topk = teacher_forced(engine, s, 1.0)
        # 1e-4, not 1e-5: Gated DeltaNet uses a chunked kernel for the teacher-forced prefill and a
        # recurrent one for decoding; the two orders of summation differ by ~1e-5 in fp32.
        np.testing.assert_allclose(s.logprobs, lp, atol=1e-4, rtol=0)
        for layer in range(4):
            np.testing.assert_array_equal(s.routed_experts[:, layer], topk[layer])

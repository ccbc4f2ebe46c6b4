"""CPU engine on image prompts (tiny Qwen3.5-MoE VL, full model): behaviour log-probs and routed experts against
transformers' VL forward teacher-forced on the returned tokens (one unpadded sequence per sample, positions from
the model's own mRoPE), greedy tokens against transformers' VL ``generate``, mixed batches (image + text
prompts, left padding), the images coming back on the samples, and the refusals."""
import numpy as np
import pytest
import torch

from megatron_s3ac.models.multimodal import ImageInputs
from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
from megatron_s3ac.models.tiny_qwen3_5 import VL_TOKENS, save_tiny_qwen3_5_vl_full, tiny_image_prompt
from vl_reference import reference as _reference

IMG = VL_TOKENS["image_token_id"]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return save_tiny_qwen3_5_vl_full(str(tmp_path_factory.mktemp("vl")))


@pytest.fixture(scope="module")
def vl_engine(vl_dir):
    return CPUEngine.from_pretrained(vl_dir, multimodal=True, tokenizer=None)


def _prompt(seed, **kw):
    ids, pv, grid = tiny_image_prompt(seed, **kw)
    return ids[0].tolist(), ImageInputs(pv, grid)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_new_tokens=6, seed=3, ignore_eos=True),
                                    SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)])
def test_image_prompts_against_teacher_forced_vl_forward(vl_engine, params):
    p0, im0 = _prompt(0)
    p2, im2 = _prompt(1, text_before=(5,), text_after=(8, 9, 10, 11))
    prompts, images = [p0, [3, 4, 5], p2], [im0, None, im2]
    out = vl_engine.generate(prompts, params, n_samples=2, return_routed_experts=True, images=images)
    assert [len(g) for g in out] == [2, 2, 2]
    for group, prompt, im in zip(out, prompts, images):
        for s in group:
            assert s.prompt_ids == prompt and s.images is im
            P, R = len(prompt), len(s.response_ids)
            assert s.routed_experts.shape == (P + R - 1, vl_engine.num_layers, vl_engine.top_k)
            lp, topk = _reference(vl_engine.model, vl_engine.routers, prompt, s.response_ids, im, params.temperature)
            np.testing.assert_allclose(s.logprobs, lp, atol=2e-5, rtol=0)
            for layer, ids in topk.items():  # every prompt row, the image placeholder rows included
                np.testing.assert_array_equal(np.sort(s.routed_experts[:, layer], -1), np.sort(ids, -1))
    img_rows = [i for i, t in enumerate(p0) if t == IMG]
    assert len(img_rows) == im0.num_image_tokens(1) == 16


def test_greedy_equals_transformers_vl_generate(vl_engine):
    prompt, im = _prompt(2)
    out = vl_engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True),
                             images=[im])[0][0]
    ids = torch.tensor([prompt])
    ref = vl_engine.model.generate(input_ids=ids, pixel_values=im.pixel_values, image_grid_thw=im.image_grid_thw,
                                   mm_token_type_ids=(ids == IMG).int(), max_new_tokens=6, min_new_tokens=6,
                                   do_sample=False)
    assert out.response_ids == ref[0, len(prompt):].tolist()


def test_the_image_is_seen(vl_engine):
    """Same ids, other pixels: other log-probs (the vision tower's embeddings replace the placeholders)."""
    prompt, im = _prompt(0)
    _, other = _prompt(5)
    params = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    a = vl_engine.generate([prompt], params, images=[im])[0][0]
    b = vl_engine.generate([prompt], params, images=[other])[0][0]
    lp_b_tokens_a, _ = _reference(vl_engine.model, {}, prompt, a.response_ids, other, 0.0)
    assert not np.allclose(a.logprobs, lp_b_tokens_a, atol=1e-3)
    assert b.images is other


def test_refusals(vl_dir, vl_engine):
    prompt, im = _prompt(0)
    params = SamplingParams(temperature=0.0, max_new_tokens=2)
    text_only = CPUEngine.from_pretrained(vl_dir, tokenizer=None)  # AutoModelForCausalLM: no vision tower
    with pytest.raises(ValueError, match="text-only model.*multimodal=True"):
        text_only.generate([prompt], params, images=[im])
    with pytest.raises(ValueError, match="prompt 0 has 15 image tokens"):
        vl_engine.generate([prompt[:4] + prompt[5:]], params, images=[im])
    with pytest.raises(ValueError, match="prompt 1 has 16 image tokens .* take 0"):
        vl_engine.generate([[3, 4], prompt], params, images=[None, None])
    with pytest.raises(ValueError, match="prompt 0 has 16 image tokens .* take 0"):
        vl_engine.generate([prompt], params)  # placeholders without their image
    with pytest.raises(ValueError, match="1 entries for 2 prompts"):
        vl_engine.generate([[3, 4], prompt], params, images=[im])
    with pytest.raises(ValueError, match="not models.multimodal.ImageInputs"):
        vl_engine.generate([prompt], params, images=[{"pixel_values": im.pixel_values}])


def test_frozen_tower_survives_sleep(vl_dir):
    """EngineFactory(resident_prefixes=("model.visual.",)) (the trainer's frozen tower: never synced): sleep() frees
    the language model only; after wake() + a sync of the language model's weights alone the engine serves the
    image prompt exactly as before. Without the prefix the unsent tower is stale and generation is refused."""
    from megatron_s3ac.rollout.factory import make_engine_factory

    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    ids, im = _prompt(0, text_before=(5,), text_after=(6,))
    for resident in (("model.visual.",), ()):
        eng = make_engine_factory("cpu", model_dir=vl_dir, multimodal=True, resident_prefixes=resident)()
        ref = eng.generate([ids], params, images=[im])[0][0].response_ids
        text = {n: p.detach().clone() for n, p in eng.model.named_parameters() if not n.startswith("model.visual.")}
        tower = {n: p.detach().clone() for n, p in eng.model.named_parameters() if n.startswith("model.visual.")}
        eng.sleep()
        assert all(eng.model.get_parameter(n).numel() == 0 for n in text)
        assert all(eng.model.get_parameter(n).numel() > 0 for n in tower) == bool(resident)
        eng.wake()
        eng.update_weights(list(text.items()))
        if resident:
            assert all(torch.equal(eng.model.get_parameter(n), t) for n, t in tower.items())
            assert eng.generate([ids], params, images=[im])[0][0].response_ids == ref
        else:
            with pytest.raises(RuntimeError, match="not loaded since wake.*model.visual"):
                eng.generate([ids], params, images=[im])


def test_continuation_of_an_image_prompt_is_refused(tmp_path):
    """Partial rollout resumes prompt + partial response by ids only: an image prompt's prefix would lose its
    images, so the multimodal engine refuses it, naming the cause; a text prefix on the same engine is served."""
    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
    from megatron_s3ac.models.tiny_qwen3_5 import save_tiny_qwen3_5_vl_full, tiny_image_prompt

    engine = CPUEngine.from_pretrained(save_tiny_qwen3_5_vl_full(str(tmp_path / "vl")), multimodal=True,
                                       tokenizer=None)
    ids, _, _ = tiny_image_prompt(0)
    params = SamplingParams(temperature=0.0, max_new_tokens=2)
    with pytest.raises(ValueError, match="partial rollout of image prompts"):
        engine.generate_continuations([(ids[0].tolist() + [5], 2)], params)
    (s,) = engine.generate_continuations([([5, 6, 7], 2)], params)
    assert len(s.response_ids) == 2

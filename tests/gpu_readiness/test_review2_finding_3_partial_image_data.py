"""Second review, finding 3: partial rollout resumed an image prompt's response on SGLang with ``image_data=None``
(trainer/step/async_partial.py -> SGLangEngine.generate_continuations). sglang then skips its multimodal processor
(``contains_mm_input``, managers/io_struct.py:399-404; tokenizer_manager.py:1159-1163): the image pad tokens are
prefilled as text, and the tail is generated image-blind. A processor_output item with token ids keeps the ids
(base_processor.py:1293-1304) and finds the image at its pad tokens (1997-2004), mRoPE over the whole prefix
(processors/qwen_vl.py:1005-1140): so the continuation must carry the prompt's images, and with them it continues
exactly where the first piece stopped. Checked through the sglang stand-in (tests/rollout/fake_sglang.py item 11,
the CPU engine's VL forward behind it) and on the loop's resume."""
import os
import sys
import types

import numpy as np
import pytest

ROLLOUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollout")


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    from megatron_s3ac.models.tiny_qwen3_5 import save_tiny_qwen3_5_vl_full

    return save_tiny_qwen3_5_vl_full(str(tmp_path_factory.mktemp("vl")))


def test_sglang_continuation_of_an_image_prompt_sees_the_image(vl_ckpt):
    sys.path.insert(0, ROLLOUT)
    from fake_sglang import FakeSGLangEngine

    from megatron_s3ac.models.multimodal import ImageInputs
    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.engines.sglang.engine import SGLangConfig, SGLangEngine
    from megatron_s3ac.rollout.partial import merge
    from megatron_s3ac.models.tiny_qwen3_5 import tiny_image_prompt

    eng = SGLangEngine(SGLangConfig(model_path=vl_ckpt, enable_deterministic_inference=True),
                       engine_cls=FakeSGLangEngine)
    sent = []
    real = eng.engine.generate
    eng.engine.generate = lambda **kw: (sent.append(kw), real(**kw))[1]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, seed=0)
    for seed in range(8):  # an image whose greedy tail holds no vision token (the untrained model may draw one)
        ids, pv, grid = tiny_image_prompt(seed)
        prompt, image = ids[0].tolist(), ImageInputs(pv, grid)
        (full,), = eng.generate([prompt], greedy, images=[image])
        if max(full.response_ids) < 90:
            break
    (first,), = eng.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True, seed=0),
                             images=[image])
    (cont,) = eng.generate_continuations([(prompt + first.response_ids, 4)], greedy, images=[image])
    data = sent[-1]["image_data"]
    assert data[0][0]["format"] == "processor_output" and data[0][0]["image_grid_thw"].tolist() == grid.tolist()
    assert cont.images is image
    merged = merge(first, cont, 1)
    assert merged.response_ids == full.response_ids  # the same greedy tokens as one uninterrupted generation
    np.testing.assert_allclose(merged.logprobs, full.logprobs, atol=2e-5, rtol=0)


def test_resume_sends_each_continuation_its_prompts_images():
    """PartialRollout.resume (rank 0) passes the aborted samples' images with their continuations, in request
    order, and none for a text-only batch (engines without image prompts keep their three arguments)."""
    from megatron_s3ac.models.multimodal import ImageInputs
    from megatron_s3ac.rollout.base import PendingGeneration, Sample, SamplingParams
    from megatron_s3ac.trainer.step.async_partial import PartialRollout

    im = ImageInputs(np.zeros((4, 12), np.float32), np.array([[1, 2, 2]]))

    def sample(reason, images):
        return Sample(prompt_ids=[1, 2, 3], response_ids=[4], logprobs=np.zeros(1, np.float32),
                      finish_reason=reason, images=images)

    calls = []

    class Engine:
        supports_pause = True

        def continue_generation(self):
            pass

        def continue_async(self, requests, params, return_routed_experts=False, **kw):
            calls.append(kw)
            return PendingGeneration(lambda: [])

    for groups, want in (([[sample("abort", im), sample("stop", im)], [sample("abort", None)]], [im, None]),
                         ([[sample("abort", None)]], None)):
        tr = types.SimpleNamespace(rank=0, engine=Engine(), r3_on=False,
                                   cfg=types.SimpleNamespace(rollout=types.SimpleNamespace(max_new_tokens=8)))
        e = types.SimpleNamespace(pending=object(), version=0, step=0, rewards=None, collected=False)
        ar = types.SimpleNamespace(tr=tr, queue=[e], _result=lambda _e, g=groups: g,
                                   _params=lambda step: SamplingParams(temperature=1.0, max_new_tokens=8, seed=1))
        PartialRollout(ar, max_versions=4).resume(1)
        assert calls[-1].get("images") == want


def test_cpu_engine_continuation_of_an_image_prompt_sees_the_image(vl_ckpt):
    """The CPU engine (rollout.engine: cpu / hf) takes the images too and continues exactly; without them it still
    refuses a prefix holding image tokens rather than serve it as text."""
    from megatron_s3ac.models.multimodal import ImageInputs
    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
    from megatron_s3ac.rollout.partial import merge
    from megatron_s3ac.models.tiny_qwen3_5 import tiny_image_prompt

    eng = CPUEngine.from_pretrained(vl_ckpt, multimodal=True, tokenizer=None)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, seed=0)
    for seed in range(8):
        ids, pv, grid = tiny_image_prompt(seed)
        prompt, image = ids[0].tolist(), ImageInputs(pv, grid)
        (full,), = eng.generate([prompt], greedy, images=[image])
        if max(full.response_ids) < 90:
            break
    (first,), = eng.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True, seed=0),
                             images=[image])
    (cont,) = eng.generate_continuations([(prompt + first.response_ids, 4)], greedy, images=[image])
    merged = merge(first, cont, 1)
    assert merged.response_ids == full.response_ids
    np.testing.assert_allclose(merged.logprobs, full.logprobs, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="needs the prompt's images"):
        eng.generate_continuations([(prompt + first.response_ids, 4)], greedy)

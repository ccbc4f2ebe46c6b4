"""SGLangEngine on image prompts against the stand-in of sglang 0.5.23 (item 11 of tests/rollout/fake_sglang.py):
the wrapper sends the expanded ids + one processor_output dict per image request; log-probs and routes (image
rows included) against transformers' VL forward teacher-forced on the returned tokens; refusals."""
import numpy as np
import pytest

from megatron_s3ac.models.multimodal import ImageInputs
from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.sglang.engine import SGLangConfig, SGLangEngine, processor_output
from megatron_s3ac.testing.tiny_qwen3_5 import save_tiny_qwen3_5_vl_full, tiny_image_prompt

from fake_sglang import FakeSGLangEngine
from vl_reference import reference


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    return save_tiny_qwen3_5_vl_full(str(tmp_path_factory.mktemp("vl")))


def _prompt(seed, **kw):
    ids, pv, grid = tiny_image_prompt(seed, **kw)
    return ids[0].tolist(), ImageInputs(pv, grid)


def test_image_prompts_through_sglang_wrapper(vl_ckpt):
    cfg = SGLangConfig(model_path=vl_ckpt, enable_return_routed_experts=True, enable_deterministic_inference=True)
    eng = SGLangEngine(cfg, engine_cls=FakeSGLangEngine)
    sent = []
    real = eng.engine.generate
    eng.engine.generate = lambda **kw: (sent.append(kw), real(**kw))[1]
    p0, im0 = _prompt(0)
    prompts, images = [p0, [3, 4, 5]], [im0, None]
    out = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=5, seed=11), n_samples=2,
                       return_routed_experts=True, images=images)
    data = sent[0]["image_data"]
    assert [d is None for d in data] == [False, False, True, True]  # per request, prompt-major
    assert data[0][0]["format"] == "processor_output" and data[0][0]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert sent[0]["input_ids"][0] == p0  # the expanded ids are sent as they are
    model, routers = eng.engine.cpu.model, eng.engine.cpu.routers
    for group, prompt, im in zip(out, prompts, images):
        for s in group:
            assert s.images is im
            assert s.routed_experts.shape == (len(prompt) + len(s.response_ids) - 1, 8, 2)
            lp, topk = reference(model, routers, prompt, s.response_ids, im, 1.0)
            np.testing.assert_allclose(s.logprobs, lp, atol=2e-5, rtol=0)
            for layer, ids in topk.items():
                np.testing.assert_array_equal(np.sort(s.routed_experts[:, layer], -1), np.sort(ids, -1))


def test_stand_in_refusals(vl_ckpt):
    p0, im0 = _prompt(0)
    off = FakeSGLangEngine(model_path=vl_ckpt, enable_multimodal=False)
    with pytest.raises(ValueError, match="without multimodal"):
        off.generate(input_ids=[p0], sampling_params={"max_new_tokens": 2}, image_data=[[processor_output(im0)]])
    on = FakeSGLangEngine(model_path=vl_ckpt)
    with pytest.raises(ValueError, match="exactly one item"):
        on.generate(input_ids=[p0], sampling_params={"max_new_tokens": 2},
                    image_data=[[processor_output(im0), processor_output(im0)]])
    with pytest.raises(ValueError, match="equal to the batch size"):
        on.generate(input_ids=[p0, p0], sampling_params={"max_new_tokens": 2}, image_data=[[processor_output(im0)]])

"""SGLangEngine on image prompts against the stand-in of sglang 0.5.23 (item 11 of tests/rollout/fake_sglang.py):
the wrapper sends the expanded ids + one processor_output dict per image request; log-probs and routes (image
rows included) against transformers' VL forward teacher-forced on the returned tokens; refusals."""
import numpy as np
import pytest

from megatron_s3ac.models.multimodal import ImageInputs
from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.sglang.engine import SGLangConfig, SGLangEngine, processor_output
from megatron_s3ac.models.tiny_qwen3_5 import save_tiny_qwen3_5_vl_full, tiny_image_prompt

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
    # per request, prompt-major; a text request is [None] (sglang reads a batch's shape from its first entry)
    assert [d == [None] for d in data] == [False, False, True, True]
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


def _served_tower(eng):
    return {n: t.clone() for n, t in eng.engine.debug_checkpoint_state_dict().items() if n.startswith("model.visual.")}


def test_frozen_tower_survives_the_colocated_sleep(vl_ckpt):
    """The colocated cycle (sleep all -> wake weights -> sync -> wake kv_cache + cuda_graph) with a frozen tower:
    the sync sends the text tensors only and is complete; the factory started the engine with sglang's weights CPU
    backup (resident_prefixes), so the tower is the checkpoint's after wake and a seeded image-prompt generation
    equals the one before the sleep. Without the backup the stand-in's tower is gone (NaN, as sglang's
    torch_memory_saver frees the whole weights region), and the wrapper refuses that sleep when it knows the
    resident weights."""
    import os

    import torch
    from safetensors.torch import load_file

    from megatron_s3ac.rollout.factory import SGLangSettings, make_engine_factory

    def build(resident):
        return make_engine_factory("sglang", model_dir=vl_ckpt, settings=SGLangSettings(), engine_cls=FakeSGLangEngine,
                                   resident_prefixes=resident)()

    def cycle(eng):
        text = [(n, t) for f in sorted(os.listdir(vl_ckpt)) if f.endswith(".safetensors")
                for n, t in load_file(os.path.join(vl_ckpt, f)).items() if not n.startswith(("model.visual.", "mtp."))]
        eng.sleep()
        eng.wake(["weights"])
        eng.update_weights(text, require_complete=True)  # complete: the tower is not a tensor the sync must send
        eng.wake(["kv_cache", "cuda_graph"])
        return {n for n, _ in text}

    p0, im0 = _prompt(0)
    sp = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    eng = build(("model.visual.",))
    assert eng.config.enable_weights_cpu_backup and eng.engine.cpu_backup
    before, tower = eng.generate([p0], sp, images=[im0])[0][0], _served_tower(eng)
    sent = cycle(eng)
    assert tower and not any(n.startswith("model.visual.") for n in sent)
    after = eng.generate([p0], sp, images=[im0])[0][0]
    assert after.response_ids == before.response_ids
    np.testing.assert_array_equal(after.logprobs, before.logprobs)
    assert all(torch.equal(t, tower[n]) for n, t in _served_tower(eng).items())

    lost = build(())  # a trainable tower: no resident weights, no backup; a sync that skipped the tower loses it
    assert not lost.config.enable_weights_cpu_backup
    cycle(lost)
    assert all(torch.isnan(t).all() for t in _served_tower(lost).values())

    cfg = SGLangConfig(model_path=vl_ckpt, enable_weights_cpu_backup=False)
    refusing = SGLangEngine(cfg, engine_cls=FakeSGLangEngine, resident_prefixes=("model.visual.",))
    with pytest.raises(RuntimeError, match="without enable_weights_cpu_backup would lose the .* served tensors"):
        refusing.sleep()
    refusing.sleep(["kv_cache", "cuda_graph"])  # the KV cache may still go

"""Second review, finding 3 (issue 41): partial rollout of image prompts on SGLang was generated image-blind.

At ec9434d the asynchronous loop resumed an interrupted response with ``continue_async([(prefix ids, budget)])``
and ``SGLangEngine.generate_continuations`` sent the prefix (prompt ids with their image placeholders + partial
response) with ``image_data=None``; sglang then skips its multimodal processor (``managers/io_struct.py:399-404``,
``contains_mm_input``) and embeds the placeholders as plain tokens, so the tail was sampled without the image and
trained on as if it had been seen (the CPU engine already refused such prefixes). Now the trainer refuses
``rollout.partial_rollout`` with image prompts before any engine starts, and the SGLang wrapper refuses a
continuation holding the image placeholder before anything reaches sglang (the stand-in of sglang 0.5.23,
tests/rollout/fake_sglang.py item 11, would have served it).
"""
import pytest

from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.sglang.engine import SGLangConfig, SGLangEngine
from megatron_s3ac.testing.tiny_qwen3_5 import VL_TOKENS, save_tiny_qwen3_5_vl_full, tiny_image_prompt
from tests.rollout.fake_sglang import FakeSGLangEngine


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    return save_tiny_qwen3_5_vl_full(str(tmp_path_factory.mktemp("vl")))


def test_sglang_refuses_image_continuations_before_sending(vl_ckpt):
    eng = SGLangEngine(SGLangConfig(model_path=vl_ckpt), engine_cls=FakeSGLangEngine)
    sent = []
    real = eng.engine.generate
    eng.engine.generate = lambda **kw: (sent.append(kw), real(**kw))[1]
    ids, _, _ = tiny_image_prompt(0)
    prefix = ids[0].tolist() + [5, 6]  # an image prompt + two tokens of its interrupted response
    assert VL_TOKENS["image_token_id"] in prefix
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=1)
    with pytest.raises(ValueError, match=r"continuation 1 holds image tokens \(90\): partial rollout of image "
                                         r"prompts is not supported"):
        eng.generate_continuations([([3, 4, 5], 3), (prefix, 3)], params)
    assert sent == []  # nothing reached sglang
    out = eng.generate_continuations([([3, 4, 5], 3)], params)  # a text prefix is still served
    assert len(out) == 1 and len(sent) == 1 and sent[0].get("image_data") is None


def test_trainer_refuses_partial_rollout_with_image_prompts():
    from types import SimpleNamespace

    from megatron_s3ac.trainer import build as B
    from megatron_s3ac.trainer.config import ConfigError

    cfg = SimpleNamespace(rollout=SimpleNamespace(partial_rollout=True))
    text, image = SimpleNamespace(images=None), SimpleNamespace(images=object())
    B.check_partial_rollout_prompts(cfg, [text, text])
    with pytest.raises(ConfigError, match=r"rollout\.partial_rollout=true with image prompts"):
        B.check_partial_rollout_prompts(cfg, [text, image])
    cfg.rollout.partial_rollout = False
    B.check_partial_rollout_prompts(cfg, [text, image])

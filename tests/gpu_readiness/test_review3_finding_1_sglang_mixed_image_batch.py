"""Third review, finding 1: a batch whose FIRST request is a text prompt and a later one an image prompt reached
sglang as ``image_data=[None, [processor_output]]``. sglang 0.5.23 picks the batch's shape from the first entry
(``GenerateReqInput._normalize_image_data``, managers/io_struct.py:664-684): not a list, so it wraps every entry
again, the image request gets ``[[processor_output]]``, which is not a preprocessed item (base_processor.py:1088-1101)
and fails to load as an image (1028-1058). The reference here is sglang's own normalisation, compiled from the
wheel's source (sglang itself does not import without its server dependencies); each request's normalised images must
be either no image at all (mm_utils.has_valid_data false) or exactly its one processor_output item."""
import ast
import glob
import os
import sys
import types
import zipfile

import pytest

ROLLOUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollout")
WHEELS = glob.glob(os.path.expanduser("~/.cache/megatron_s3ac/sglang-0.5.23-*.whl"))


def _sglang_normalize():
    """sglang 0.5.23's ``GenerateReqInput._normalize_image_data``, taken from the wheel."""
    with zipfile.ZipFile(WHEELS[0]) as z:
        src = z.read("sglang/srt/managers/io_struct.py").decode()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_normalize_image_data")
    ns: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "io_struct.py", "exec"), ns)
    return ns["_normalize_image_data"]


def _flat(x):
    return [y for v in x for y in _flat(v)] if isinstance(x, list) else [x]


@pytest.mark.skipif(not WHEELS, reason="the sglang 0.5.23 wheel is not in ~/.cache/megatron_s3ac")
def test_text_first_mixed_batch_keeps_each_image_request_preprocessed(tmp_path):
    sys.path.insert(0, ROLLOUT)
    from fake_sglang import FakeSGLangEngine

    from megatron_s3ac.models.multimodal import ImageInputs
    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.engines.sglang.engine import SGLangConfig, SGLangEngine
    from megatron_s3ac.models.tiny_qwen3_5 import save_tiny_qwen3_5_vl_full, tiny_image_prompt

    eng = SGLangEngine(SGLangConfig(model_path=save_tiny_qwen3_5_vl_full(str(tmp_path)),
                                    enable_deterministic_inference=True), engine_cls=FakeSGLangEngine)
    sent = []
    real = eng.engine.generate
    eng.engine.generate = lambda **kw: (sent.append(kw), real(**kw))[1]
    ids, pv, grid = tiny_image_prompt(0)
    image_prompt, image = ids[0].tolist(), ImageInputs(pv, grid)
    text_prompt = [5, 6, 7, 8]
    p = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True, seed=0)
    eng.generate([text_prompt, image_prompt], p, images=[None, image])
    eng.generate_continuations([(text_prompt, 2), (image_prompt, 2)], p, images=[None, image])

    normalize = _sglang_normalize()
    for kw in sent:
        req = types.SimpleNamespace(image_data=kw["image_data"], batch_size=len(kw["input_ids"]),
                                    parallel_sample_num=1, modalities=None)
        normalize(req, len(kw["input_ids"]))
        text_row, image_row = req.image_data
        assert all(x is None for x in _flat(text_row)), text_row  # has_valid_data false: no mm processing
        assert isinstance(image_row, list) and len(image_row) == 1, image_row
        item = image_row[0]
        assert isinstance(item, dict) and item["format"] == "processor_output", type(item)
        assert item["image_grid_thw"].tolist() == grid.tolist()

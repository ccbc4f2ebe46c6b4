"""Image benchmarks: the MathVista / MathVision / MMMU-Pro layouts (multiple choice vs free form, images by path or
embedded bytes, MMMU-Pro's "<image k>" markers and string-literal options) and ``s3ac-eval`` on the tiny VL
checkpoint with an image benchmark, scored against the same greedy answers generated independently (transformers'
VL model through the CPU engine on ids and pixels built by hand) and scored by hand."""
import io
import json
import os

import pytest
import torch

from megatron_s3ac.eval.benchmarks import EvalInputError, load_benchmark
from megatron_s3ac.tasks.vision import digit_image


def _png(a, b):
    buf = io.BytesIO()
    digit_image(a, b).save(buf, format="PNG")
    return buf.getvalue()


def test_layouts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "images").mkdir()
    digit_image(1, 2).save(tmp_path / "images" / "1.png")
    vista = [{"pid": "1", "question": "Which is larger?", "image": "images/1.png", "decoded_image": None,
              "choices": ["left", "right"], "answer": "right", "question_type": "multi_choice",
              "answer_type": "text", "unit": None},
             {"pid": "2", "question": "Sum?", "image": "images/1.png",
              "decoded_image": {"bytes": _png(3, 4), "path": None}, "choices": None, "answer": "7",
              "question_type": "free_form", "answer_type": "integer", "unit": "cm"}]
    pq.write_table(pa.Table.from_pylist(vista), tmp_path / "mathvista.parquet")
    b = load_benchmark("mathvista", str(tmp_path / "mathvista.parquet"))
    mc, ff = b.items
    assert (mc.kind, mc.reference, mc.choices, mc.images) == ("choice", "B", ("left", "right"), ("images/1.png",))
    assert mc.prompt.startswith("<image>Which is larger?") and mc.image_dir == str(tmp_path)
    assert (ff.kind, ff.reference, ff.prompt) == ("math", "7", "<image>Sum? (unit: cm)")
    assert ff.images[0]["bytes"] == _png(3, 4)  # the decoded image wins over the path

    vision = [{"id": "1", "question": "<image1>How many?", "options": [], "image": "images/1.png", "answer": "3"},
              {"id": "2", "question": "Pick", "options": ["1", "2", "3", "4", "5"], "image": "images/1.png",
               "answer": "D"}]
    with open(tmp_path / "mv.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in vision)
    ff, mc = load_benchmark("mathvision", str(tmp_path / "mv.jsonl")).items
    assert (ff.kind, ff.reference, ff.prompt) == ("math", "3", "<image>How many?")
    assert (mc.kind, mc.reference, len(mc.choices)) == ("choice", "D", 5)

    pro = [{"id": "a", "question": "Compare <image 2> with <image 1>.", "options": "['x <image 1>', 'y', 'z', 'w']",
            "explanation": "", "image_1": {"bytes": _png(1, 1), "path": None},
            "image_2": {"bytes": _png(2, 2), "path": None}, "image_3": None, "img_type": "['x']", "answer": "C",
            "topic_difficulty": "Easy", "subject": "Math"}]
    pq.write_table(pa.Table.from_pylist(pro), tmp_path / "pro.parquet")
    (it,) = load_benchmark("mmmu_pro", str(tmp_path / "pro.parquet")).items
    assert it.kind == "choice" and it.reference == "C" and it.choices[0] == "x (image 1)"
    assert it.prompt.startswith("Compare <image> with <image>.")
    assert [e["bytes"] for e in it.images] == [_png(2, 2), _png(1, 1)]  # in order of first mention
    pq.write_table(pa.Table.from_pylist([{"id": "v", "image": {"bytes": _png(5, 5), "path": None},
                                          "options": "['a', 'b']", "answer": "A", "subject": "Art"}]),
                   tmp_path / "prov.parquet")
    (it,) = load_benchmark("mmmu_pro", str(tmp_path / "prov.parquet")).items
    assert it.reference == "A" and len(it.images) == 1

    with pytest.raises(EvalInputError, match="missing column.*question_type"):
        load_benchmark("mathvista", [{"pid": "1", "question": "q", "image": "i.png", "answer": "1"}])
    with pytest.raises(EvalInputError, match="image/decoded_image"):
        load_benchmark("mathvision", [{"id": "1", "question": "q", "options": [], "answer": "1"}])


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    from megatron_s3ac.tasks.vision import save_vision_miniature

    return save_vision_miniature(str(tmp_path_factory.mktemp("mini")), num_prompts=2, eval_prompts=2)["model"]


def test_s3ac_eval_on_image_benchmark_equals_hand_scoring(vl_model, tmp_path):
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from megatron_s3ac.eval.cli import main
    from megatron_s3ac.models.multimodal import ImageInputs
    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
    from megatron_s3ac.rollout.rewards import register_reward, registered_rewards
    from megatron_s3ac.models.tiny_qwen3_5 import IMAGE_PROCESSOR, VL_TOKENS

    if "vl_test_exact" not in registered_rewards():
        register_reward("vl_test_exact", isolate=False)(lambda r, ref: 1.0 if r == ref else -1.0)
    pairs = [(1, 2), (3, 4), (5, 6), (7, 8)]
    # independent greedy answers: ids written by hand, pixels straight from the image processor
    tok = AutoTokenizer.from_pretrained(vl_model)
    eng = CPUEngine.from_pretrained(vl_model, multimodal=True, tokenizer=tok)
    proc = Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR)
    t = VL_TOKENS
    answers = []
    for a, b in pairs:
        out = proc(images=[digit_image(a, b)], return_tensors="pt")
        ids = [t["vision_start_token_id"]] + [t["image_token_id"]] * 32 + [t["vision_end_token_id"]] + tok("=", add_special_tokens=False)["input_ids"]
        s = eng.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=3),
                         images=[ImageInputs(out["pixel_values"], out["image_grid_thw"])])[0][0]
        answers.append(tok.decode(s.response_ids, skip_special_tokens=True))
    right = [True, False, True, False]  # hand scoring: rows 0 and 2 carry the model's answer, 1 and 3 another
    rows = [{"pid": str(i), "question": "=", "image": None, "decoded_image": {"bytes": _png(a, b), "path": None},
             "choices": None, "answer": ans if ok else ans + "#", "question_type": "free_form", "answer_type": "text"}
            for i, ((a, b), ans, ok) in enumerate(zip(pairs, answers, right))]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "vista.parquet")
    report = tmp_path / "report.json"
    rc = main(["--model", vl_model, "--bench", f"mathvista={tmp_path / 'vista.parquet'}", "--k", "1",
               "--temperature", "0", "--max-new-tokens", "3", "--template", "raw", "--reward", "vl_test_exact",
               "--save-samples", "--out", str(report)])
    assert rc == 0
    got = json.load(open(report))["benchmarks"]["mathvista"]
    assert [s["responses"][0] for s in got["samples"]] == answers
    assert [s["correct"][0] for s in got["samples"]] == right
    assert got["avg_at_k"] == pytest.approx(sum(right) / len(right))


def test_text_only_model_refuses_image_benchmark(tmp_path):
    from megatron_s3ac.eval.runner import evaluate
    from megatron_s3ac.rollout.base import SamplingParams

    rows = [{"pid": "1", "question": "=", "image": "x.png", "choices": None, "answer": "1",
             "question_type": "free_form"}]
    with pytest.raises(EvalInputError, match="text-only"):
        evaluate(engine=None, tokenizer=None, benchmarks={"mathvista": rows}, params=SamplingParams())

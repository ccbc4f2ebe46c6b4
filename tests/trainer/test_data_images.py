"""Data rows with images (jsonl paths, parquet bytes, HF datasets.Image dicts, chat image entries) -> prompt ids
with expanded placeholders + ImageInputs, against a hand-built reference: the drawn image through transformers'
Qwen2-VL image processor directly and the ids written out by hand; the refusals."""
import json
import os

import pytest
import torch

from megatron_s3ac.models.tiny_qwen3_5 import IMAGE_PROCESSOR, VL_TOKENS, save_tiny_qwen3_5
from megatron_s3ac.data.prompts import CharVocab, VisionProcessor, load_math_prompts
from megatron_s3ac.tasks.vision import digit_image, digit_pairs, save_vision_miniature, write_vision_set


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    from transformers import AutoTokenizer

    paths = save_vision_miniature(str(tmp_path_factory.mktemp("mini")), num_prompts=6, eval_prompts=3, seed=0)
    return paths, AutoTokenizer.from_pretrained(paths["model"]), VisionProcessor.from_pretrained(paths["model"])


def _expected(a, b, jitter):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR)(images=[digit_image(a, b, jitter)], return_tensors="pt")
    t = VL_TOKENS
    ids = [t["vision_start_token_id"]] + [t["image_token_id"]] * 32 + [t["vision_end_token_id"]] + CharVocab().encode("=")
    return ids, out["pixel_values"], out["image_grid_thw"]


def test_jsonl_rows_with_image_paths(mini):
    paths, tok, vision = mini
    prompts, stats = load_math_prompts(paths["train"], tok, 64, vision=vision)
    assert stats["kept"] == stats["with_images"] == 6 and stats["malformed"] == 0
    rows = [json.loads(line) for line in open(paths["train"])]
    pairs = digit_pairs(6, 0, exclude=set(digit_pairs(3, 1)))
    for p, row, (a, b, jit) in zip(prompts, rows, pairs):
        ids, pv, grid = _expected(a, b, jit)
        assert p.ids == ids and p.reference == str(a + b) == row["answer"]
        assert torch.equal(p.images.image_grid_thw, grid) and grid.tolist() == [[1, 4, 8]]
        torch.testing.assert_close(p.images.pixel_values, pv, rtol=0, atol=0)
        assert not os.path.isabs(row["images"][0])  # relative to the data file


def test_parquet_bytes_and_hf_image_dicts_and_chat_entries(mini, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths, tok, vision = mini
    pairs = [(3, 4, (0, 0)), (9, 1, (2, 3))]
    ref, _ = load_math_prompts(write_vision_set(str(tmp_path / "a.jsonl"), pairs), tok, 64, vision=vision)
    emb, _ = load_math_prompts(write_vision_set(str(tmp_path / "b.parquet"), pairs), tok, 64, vision=vision)
    # HF datasets.Image layout with a path only, and chat messages with {"type": "image"} entries
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "="}]}],
             "answer": str(a + b), "images": [{"bytes": None, "path": f"a_images/{i:05d}_{a}{b}.png"}]}
            for i, (a, b, _) in enumerate(pairs)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    tok.chat_template = ("{% for m in messages %}{% for e in m['content'] %}{% if e['type'] == 'image' %}"
                         "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ e['text'] }}{% endif %}"
                         "{% endfor %}{% endfor %}")
    try:
        chat, _ = load_math_prompts(str(tmp_path / "c.parquet"), tok, 64, vision=vision)
    finally:
        tok.chat_template = None
    for other in (emb, chat):
        for p, q in zip(ref, other):
            assert p.ids == q.ids and torch.equal(p.images.pixel_values, q.images.pixel_values)


def test_refusals(mini, tmp_path):
    paths, tok, vision = mini
    def rows(path, *rs):
        with open(path, "w") as f:
            for r in rs:
                f.write(json.dumps(r) + "\n")
        return str(path)
    missing = rows(tmp_path / "m.jsonl", {"prompt": "<image>=", "answer": "1", "images": ["nope.png"]})
    with pytest.raises(ValueError, match="row 0 image 0: image file .*nope.png not found"):
        load_math_prompts(missing, tok, 64, vision=vision)
    (tmp_path / "bad.png").write_bytes(b"not a png at all")
    bad = rows(tmp_path / "u.jsonl", {"prompt": "<image>=", "answer": "1", "images": ["bad.png"]})
    with pytest.raises(ValueError, match="unreadable image"):
        load_math_prompts(bad, tok, 64, vision=vision)
    with pytest.raises(ValueError, match="text-only"):
        load_math_prompts(paths["train"], tok, 64, vision=None)
    two = rows(tmp_path / "t.jsonl", {"prompt": "<image><image>=", "answer": "1",
                                      "images": [os.path.relpath(paths["train"].replace(".jsonl", "_images"), tmp_path)
                                                 + "/" + sorted(os.listdir(paths["train"].replace(".jsonl", "_images")))[0]]})
    with pytest.raises(ValueError, match="2 image placeholder"):
        load_math_prompts(two, tok, 64, vision=vision)
    text_ckpt = save_tiny_qwen3_5(str(tmp_path / "text"), variant="text")
    assert VisionProcessor.from_pretrained(text_ckpt) is None


def test_read_task_split_and_drawings(tmp_path):
    """The "read" difficulty: one digit, answer = the digit; held-out pictures none of train's; a scale-2 drawing is
    the scale-1 one with every pixel a 2 x 2 block; the original sum drawings unchanged (two 8 x 8 cells)."""
    import numpy as np

    from megatron_s3ac.tasks.vision import VISION_TASKS, VisionTask, draw_digits, task_split

    read = VISION_TASKS["read"]
    assert len(read.pictures()) == 10 * 12
    train, held = task_split(read, 200, 300, seed=0)
    assert len(held) == 30 == len(set(held)) and len(train) == 200
    assert not set(held) & set(train) and len(set(train)) == 90  # every other picture, repeated
    one = np.asarray(draw_digits((7,), (1, 2)))
    assert one.shape == (8, 8, 3) and np.array_equal(np.kron(one[..., 0], np.ones((2, 2), np.uint8)),
                                                     np.asarray(draw_digits((7,), (1, 2), scale=2))[..., 0])
    two = np.asarray(digit_image(7, 3, (1, 2)))
    assert np.array_equal(two[:, :8], one) and np.array_equal(two[:, 8:], np.asarray(draw_digits((3,), (1, 2))))
    assert one[1 + 1, 1 + 2:1 + 2 + 3, 0].tolist() == [255, 255, 255]  # "7": top row "###" at row 1+dy, col 1+dx
    rows = [json.loads(line) for line in open(write_vision_set(str(tmp_path / "r.jsonl"), held[:4], task="read"))]
    assert [r["answer"] for r in rows] == [str(d[0]) for d, _ in held[:4]]
    with pytest.raises(ValueError, match="unknown vision task"):
        write_vision_set(str(tmp_path / "x.jsonl"), held[:1], task="nope")
    with pytest.raises(ValueError, match="digits must be 1 or 2"):
        VisionTask("x", digits=3)


def test_read_noisy_variants(tmp_path):
    """The "read_noisy" difficulty: every drawing its own picture. Each pixel of variant v lies within ``noise`` of
    the clean drawing, towards grey (glyph 255 -> [159, 255], background 0 -> [0, 96]); a variant is the same on
    every call and differs from the others; task_split returns the sizes asked, held-out variants none of train's
    (as pictures: no held-out array equals a training one); the written PNGs decode to those arrays."""
    import numpy as np
    from PIL import Image

    from megatron_s3ac.tasks.vision import VISION_TASKS, draw_digits, task_split

    t = VISION_TASKS["read_noisy"]
    assert t.noise == 96 and t.digits == 1
    clean = np.asarray(draw_digits((4,), (2, 1))).astype(int)
    a, b = (np.asarray(t.image((4,), (2, 1), v)).astype(int) for v in (0, 1))
    assert np.array_equal(a, np.asarray(t.image((4,), (2, 1), 0)))
    assert not np.array_equal(a, b)
    lit = clean > 0
    assert ((a[lit] >= 255 - 96) & (a[lit] <= 255)).all() and ((a[~lit] >= 0) & (a[~lit] <= 96)).all()
    assert (a[..., 0] == a[..., 1]).all() and (a != clean).mean() > 0.9  # grey noise on (nearly) every pixel
    train, held = task_split(t, 300, 200, seed=0)
    assert len(train) == 300 and len(held) == 200
    assert max(v for *_, v in train) < 1_000_000 <= min(v for *_, v in held)
    pics = lambda draws: {np.asarray(t.image(d, j, v)).tobytes() for d, j, v in draws}  # noqa: E731
    assert len(pics(held)) == 200 and not pics(held) & pics(train)
    path = write_vision_set(str(tmp_path / "n.jsonl"), held[:3], task="read_noisy")
    rows = [json.loads(line) for line in open(path)]
    for r, (d, j, v) in zip(rows, held[:3]):
        got = np.asarray(Image.open(tmp_path / r["images"][0]).convert("RGB"))
        assert r["answer"] == str(d[0]) and np.array_equal(got, np.asarray(t.image(d, j, v)))

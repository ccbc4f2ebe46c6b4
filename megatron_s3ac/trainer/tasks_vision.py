"""The multimodal miniature: "add the numbers in the image".

Each prompt is one locally drawn image of two digits side by side (a 3 x 5 bitmap glyph per digit, white on
black, 8 x 16 pixels: a 1 x 4 x 8 grid of the tiny vision tower's 2 x 2 patches = 32 image tokens) followed by
"="; the answer is their sum ("a+b" written out, 1-2 digits). ``write_vision_set`` writes such a set as a jsonl
file with an ``images`` column (paths relative to the file, the HF datasets / verl convention) or a parquet file
with embedded PNG bytes ({"bytes", "path"} as HF ``datasets.Image`` stores them); ``load_math_prompts`` with the
model's ``VisionProcessor`` reads either back into prompts with ``ImageInputs``. ``save_vision_miniature`` writes
the tiny Qwen3.5-MoE VL checkpoint (``testing.tiny_qwen3_5.save_tiny_qwen3_5_vl_full``) with the character
tokenizer of the task, and the train / held-out sets: what ``examples/cpu_demo_vl.yaml`` points at.
"""
from __future__ import annotations

import io
import json
import os
import string

import numpy as np

# 3 x 5 glyphs, rows top to bottom ("#" = lit)
GLYPHS = {
    "0": ["###", "#.#", "#.#", "#.#", "###"], "1": [".#.", "##.", ".#.", ".#.", "###"],
    "2": ["###", "..#", "###", "#..", "###"], "3": ["###", "..#", "###", "..#", "###"],
    "4": ["#.#", "#.#", "###", "..#", "..#"], "5": ["###", "#..", "###", "..#", "###"],
    "6": ["###", "#..", "###", "#.#", "###"], "7": ["###", "..#", "..#", ".#.", ".#."],
    "8": ["###", "#.#", "###", "#.#", "###"], "9": ["###", "#.#", "###", "..#", "###"],
}
HEIGHT, WIDTH = 8, 16
# The task's character vocabulary filled up to the tiny VL model's 96 ids (digits, '+', '=' at 3-14 as in the
# text demo, then placeholder characters), so every id the model can emit decodes (ids 90-93, the vision tokens,
# decode to placeholders too: they only ever stand in prompts).
# ASCII letters and punctuation (byte-level tokenizers, as AutoTokenizer makes of a Qwen3.5 directory, keep them as
# they are).
VISION_CHARS = ("0123456789+=" + "".join(c for c in string.ascii_letters + string.punctuation if c not in "+="))[:93]
PROMPT_TEXT = "<image>="  # the image, then "=": the answer is the sum of its two digits


def digit_image(a: int, b: int, jitter: tuple[int, int] = (0, 0)):
    """An 8 x 16 RGB PIL image of digits ``a`` and ``b`` (0-9), the glyphs at rows 1+dy, columns 1+dx and 9+dx."""
    from PIL import Image

    if not (0 <= a <= 9 and 0 <= b <= 9):
        raise ValueError(f"digits must be 0-9, got {a}, {b}")
    px = np.zeros((HEIGHT, WIDTH, 3), dtype=np.uint8)
    dy, dx = jitter
    for d, x0 in ((a, 1 + dx), (b, 9 + dx)):
        for r, row in enumerate(GLYPHS[str(d)]):
            for c, ch in enumerate(row):
                if ch == "#":
                    px[1 + dy + r, x0 + c] = 255
    return Image.fromarray(px)


def digit_pairs(n: int, seed: int, exclude: set | None = None) -> list[tuple[int, int, tuple[int, int]]]:
    """n distinct (a, b, jitter) draws, seeded (jitter dy in 0..2, dx in 0..3: 120 distinct pictures x 100 pairs)."""
    rng = np.random.default_rng(seed)
    seen, out = set(exclude or ()), []
    while len(out) < n and len(seen) < 100 * 12:
        a, b, dy, dx = (int(v) for v in (rng.integers(10), rng.integers(10), rng.integers(3), rng.integers(4)))
        key = (a, b, (dy, dx))
        if key in seen:
            continue
        seen.add(key)
        out.append(key)
    return out


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def write_vision_set(path: str, pairs, embed: bool = False) -> str:
    """Write the prompt set ``pairs`` (from ``digit_pairs``): ``path`` ending in .jsonl -> rows {prompt, answer,
    images: [relative path]} with PNGs under ``<stem>_images/``; ending in .parquet -> rows whose images are
    {"bytes": png, "path": None} (``embed`` is implied). Returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    rows = []
    parquet = path.endswith(".parquet")
    img_dir = os.path.splitext(path)[0] + "_images"
    for i, (a, b, jitter) in enumerate(pairs):
        img = digit_image(a, b, tuple(jitter))
        if parquet or embed:
            entry = {"bytes": _png(img), "path": None}
        else:
            os.makedirs(img_dir, exist_ok=True)
            name = f"{i:05d}_{a}{b}.png"
            img.save(os.path.join(img_dir, name))
            entry = os.path.join(os.path.basename(img_dir), name)
        rows.append({"prompt": PROMPT_TEXT, "answer": str(a + b), "images": [entry]})
    if parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        if embed:
            raise ValueError("jsonl cannot hold raw bytes: write a .parquet file to embed the images")
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return path


def legible_tower(model_dir: str) -> int:
    """Zero the vision tower's biases (``model.visual.*bias``) in the checkpoint at ``model_dir``, as transformers'
    own init leaves them (``Qwen3_5MoePreTrainedModel._init_weights``: Linear / LayerNorm biases zero). Why: the test
    fixture randomises every tower tensor (so that a mapping error shows in the round trips); its random biases add
    an image-independent vector ~7x the image-dependent part to every image token (measured on the held-out
    drawings: feature norm 1.86, spread across images 0.28), which the decoder's RMSNorm divides the picture away
    with; with zero biases the features are norm ~0.27 with a spread of ~0.21 across pictures, the scale of the
    text embeddings. Returns the number of tensors zeroed."""
    from safetensors.torch import load_file, save_file

    n = 0
    for fn in sorted(os.listdir(model_dir)):
        if not fn.endswith(".safetensors"):
            continue
        path = os.path.join(model_dir, fn)
        t = load_file(path)
        hit = [k for k in t if k.startswith("model.visual.") and k.endswith(".bias")]
        if hit:
            for k in hit:
                t[k] = t[k].new_zeros(t[k].shape)
            save_file(t, path, metadata={"format": "pt"})
            n += len(hit)
    if n == 0:
        raise RuntimeError(f"{model_dir}: no model.visual.*bias tensors to zero")
    return n


def save_vision_miniature(out_dir: str, num_prompts: int = 1000, eval_prompts: int = 300, seed: int = 0,
                          convert: bool = False) -> dict:
    """The miniature on disk: ``model/`` (tiny Qwen3.5-MoE VL checkpoint, its tower's biases zeroed by
    ``legible_tower``, + the task's character tokenizer:
    ``VISION_CHARS``: digits, '+', '=' at ids 3-14; the image token ids 90-93 of the tiny config), ``train.jsonl`` and
    ``heldout.jsonl`` (disjoint pictures). ``convert``: also ``mcore/``, the checkpoint through hf_to_mcore (what
    ``model.actor_init`` of examples/cpu_demo_vl.yaml names: the actor's vision tower comes from its carried
    ``model.visual.*``). Returns the paths."""
    from megatron_s3ac.testing.tiny_qwen3_5 import save_tiny_qwen3_5_vl_full
    from transformers import AutoTokenizer

    from megatron_s3ac.trainer.char_tokenizer import char_vocab_tokenizer
    from megatron_s3ac.trainer.data import CharVocab

    model = os.path.join(out_dir, "model")
    save_tiny_qwen3_5_vl_full(model, seed=seed)
    legible_tower(model)
    vocab = CharVocab(VISION_CHARS)
    char_vocab_tokenizer(vocab).save_pretrained(model)
    # AutoTokenizer loads it as the config's tokenizer class (Qwen3.5's), which keeps the ids: check them
    back = AutoTokenizer.from_pretrained(model)
    if back(vocab.chars, add_special_tokens=False)["input_ids"] != vocab.encode(vocab.chars):
        raise RuntimeError(f"{model}: the saved tokenizer does not reproduce the character vocabulary's ids")
    held = digit_pairs(eval_prompts, seed + 1)
    train = digit_pairs(num_prompts, seed, exclude=set(held))
    out = {"model": model, "train": write_vision_set(os.path.join(out_dir, "train.jsonl"), train),
           "heldout": write_vision_set(os.path.join(out_dir, "heldout.jsonl"), held)}
    # the held-out set again in MathVista's layout (free-form rows), for s3ac-eval --bench mathvista=...
    vista = os.path.join(out_dir, "heldout_mathvista.jsonl")
    with open(out["heldout"]) as f, open(vista, "w") as g:
        for i, line in enumerate(f):
            r = json.loads(line)
            g.write(json.dumps({"pid": str(i), "question": r["prompt"][len("<image>"):], "image": r["images"][0],
                                "choices": None, "answer": r["answer"], "question_type": "free_form",
                                "answer_type": "integer"}) + "\n")
    out["heldout_mathvista"] = vista
    if convert:
        from megatron_s3ac.convert import hf_to_mcore

        out["mcore"] = os.path.join(out_dir, "mcore")
        hf_to_mcore(model, out["mcore"], progress=False)
    return out

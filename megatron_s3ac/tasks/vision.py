"""The multimodal miniature: "add the numbers in the image" (``task="sum"``) or "which digit is in the image"
(``task="read"``, the variant the tiny model learns within minutes on CPU, and ``task="read_noisy"``, every drawing
a noisy picture of its own: what examples/cpu_demo_vl.yaml trains; see ``VISION_TASKS``).

Each prompt is one locally drawn image of two digits side by side (a 3 x 5 bitmap glyph per digit, white on
black, 8 x 16 pixels: a 1 x 4 x 8 grid of the tiny vision tower's 2 x 2 patches = 32 image tokens) followed by
"="; the answer is their sum ("a+b" written out, 1-2 digits). ``write_vision_set`` writes such a set as a jsonl
file with an ``images`` column (paths relative to the file, the HF datasets / verl convention) or a parquet file
with embedded PNG bytes ({"bytes", "path"} as HF ``datasets.Image`` stores them); ``load_math_prompts`` with the
model's ``VisionProcessor`` reads either back into prompts with ``ImageInputs``. ``save_vision_miniature`` writes
the tiny Qwen3.5-MoE VL checkpoint (``models.tiny_qwen3_5.save_tiny_qwen3_5_vl_full``) with the character
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
    return draw_digits((a, b), jitter)


def draw_digits(digits, jitter: tuple[int, int] = (0, 0), scale: int = 1):
    """An RGB PIL image of ``digits`` (each 0-9) side by side, white on black: one 8 x 8 cell per digit with its
    3 x 5 glyph at row 1+dy, column 1+dx of the cell (dy 0..2, dx 0..3), every glyph pixel a ``scale`` x ``scale``
    block; size (8 scale) x (8 scale len(digits)) pixels."""
    from PIL import Image

    digits = tuple(int(d) for d in digits)
    if not digits or not all(0 <= d <= 9 for d in digits):
        raise ValueError(f"digits must be 1+ values in 0-9, got {digits}")
    dy, dx = jitter
    if not (0 <= dy <= 2 and 0 <= dx <= 3) or scale < 1:
        raise ValueError(f"jitter must be (0..2, 0..3) and scale >= 1, got {jitter}, {scale}")
    px = np.zeros((8 * scale, 8 * scale * len(digits), 3), dtype=np.uint8)
    for k, d in enumerate(digits):
        for r, row in enumerate(GLYPHS[str(d)]):
            for c, ch in enumerate(row):
                if ch == "#":
                    y, x = (1 + dy + r) * scale, (1 + dx + c + 8 * k) * scale
                    px[y:y + scale, x:x + scale] = 255
    return Image.fromarray(px)


JITTERS = [(dy, dx) for dy in range(3) for dx in range(4)]


class VisionTask:
    """A difficulty setting of the miniature: ``digits`` glyphs (1: answer = the digit, "which digit is in the
    image"; 2: answer = their sum) drawn from 0..``max_digit``, at ``scale`` (pixels per glyph pixel; the tower's
    patch is 2 x 2, so scale 2 = one glyph pixel per patch), with the 12 glyph offsets (``jitter``) or none.
    ``pictures()`` lists every distinct (digits, jitter)."""

    def __init__(self, name: str, digits: int, max_digit: int = 9, scale: int = 1, jitter: bool = True,
                 noise: int = 0):
        if digits not in (1, 2) or not 0 < max_digit <= 9 or scale < 1 or not 0 <= noise < 128:
            raise ValueError(f"task {name!r}: digits must be 1 or 2, max_digit 1-9, scale >= 1, noise 0-127")
        self.name, self.digits, self.max_digit, self.scale, self.jitter = name, digits, max_digit, scale, jitter
        self.noise = noise

    def pictures(self) -> list:
        import itertools

        return [(ds, j) for ds in itertools.product(range(self.max_digit + 1), repeat=self.digits)
                for j in (JITTERS if self.jitter else [(0, 0)])]

    def image(self, digits, jitter, variant: int = 0):
        """The drawing of ``digits`` at ``jitter``; with ``noise``, drawing number ``variant`` of it: every pixel
        moved towards grey by a seeded uniform 0..noise (background up, glyph down), so each variant is a
        distinct picture of the same digits (seeded by (digits, jitter, variant): the same on every call)."""
        img = draw_digits(digits, jitter, self.scale)
        if not self.noise:
            return img
        from PIL import Image

        px = np.asarray(img).astype(np.int16)
        seed = [int(variant), *map(int, digits), *map(int, jitter)]
        d = np.random.default_rng(seed).integers(0, self.noise + 1, size=px.shape[:2])[..., None]
        return Image.fromarray(np.where(px > 0, px - d, px + d).astype(np.uint8))

    def answer(self, digits) -> str:
        return str(sum(digits))

    def __repr__(self):
        return (f"VisionTask({self.name!r}, digits={self.digits}, max_digit={self.max_digit}, scale={self.scale}, "
                f"jitter={self.jitter}, noise={self.noise})")


# "sum": the "add the numbers in the image" (8 x 16 px, 32 image tokens, 1,200 pictures); the tiny model
# stays image-blind on it in plain transformers (docs/data.md). "read": one digit 0-9 (8 x 8 px, 16 image tokens,
# 120 pictures), which it learns in ~100-300 steps, the held-out pictures (other offsets of the digits) included.
# "read_noisy": "read" with every drawing a distinct noisy picture (``noise`` 96 of 255; ``task_split`` draws fresh
# variants, so the held-out set can be as large as asked and no held-out picture is a training picture).
VISION_TASKS = {"sum": VisionTask("sum", digits=2), "read": VisionTask("read", digits=1),
                "read_noisy": VisionTask("read_noisy", digits=1, noise=96)}


def vision_task(task) -> VisionTask:
    if isinstance(task, VisionTask):
        return task
    if task not in VISION_TASKS:
        raise ValueError(f"unknown vision task {task!r}: one of {sorted(VISION_TASKS)}")
    return VISION_TASKS[task]


def task_split(task, n_train: int, n_eval: int, seed: int = 0):
    """(train draws, held-out draws) of ``task``, each a list of (digits, jitter). Held-out: ``n_eval`` distinct
    pictures, at most a quarter of all pictures (seeded), none of them in train; train: ``n_train`` draws of
    the other pictures, each picture once while they last, then again in a fresh order (a small task's train
    set repeats pictures). A task with ``noise``: (digits, jitter, variant) draws, ``n_train`` and ``n_eval`` of
    them, every one a picture of its own (below)."""
    t = vision_task(task)
    pics = t.pictures()
    rng = np.random.default_rng(seed)
    if t.noise:
        # noisy drawings, each a (digits, jitter, variant) of its own: held-out variants are numbered from
        # 1,000,000 up, train's below, so the two sets share no picture whatever their sizes (they do share the
        # clean (digits, jitter) under the noise: the held-out set measures reading unseen drawings of them)
        def draws(n, first):
            return [(*pics[i], first + k) for k, i in enumerate(rng.integers(0, len(pics), n).tolist())]

        return draws(n_train, 0), draws(n_eval, 1_000_000)
    perm = rng.permutation(len(pics)).tolist()
    nh = min(n_eval, len(pics) // 4)
    held = [pics[i] for i in perm[:nh]]
    rest = perm[nh:]
    train = []
    while len(train) < n_train:
        train += [pics[i] for i in rng.permutation(rest).tolist()]
    return train[:n_train], held


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


def write_vision_set(path: str, pairs, embed: bool = False, task="sum") -> str:
    """Write the prompt set ``pairs`` (from ``digit_pairs``: (a, b, jitter); or ``task_split``: (digits,
    jitter)) of ``task`` (a ``VISION_TASKS`` name or a ``VisionTask``): ``path`` ending in .jsonl -> rows {prompt,
    answer, images: [relative path]} with PNGs under ``<stem>_images/``; ending in .parquet -> rows whose images
    are {"bytes": png, "path": None} (``embed`` is implied). Returns ``path``."""
    t = vision_task(task)
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    rows = []
    parquet = path.endswith(".parquet")
    img_dir = os.path.splitext(path)[0] + "_images"
    for i, pair in enumerate(pairs):
        if isinstance(pair[0], (tuple, list)):  # task_split: (digits, jitter[, variant])
            digits, jitter, variant = tuple(pair[0]), pair[1], (pair[2] if len(pair) > 2 else 0)
        else:  # digit_pairs: (a, b, jitter)
            digits, jitter, variant = tuple(pair[:2]), pair[2], 0
        img = t.image(digits, tuple(jitter), variant)
        if parquet or embed:
            entry = {"bytes": _png(img), "path": None}
        else:
            os.makedirs(img_dir, exist_ok=True)
            name = f"{i:05d}_{''.join(map(str, digits))}.png"
            img.save(os.path.join(img_dir, name))
            entry = os.path.join(os.path.basename(img_dir), name)
        rows.append({"prompt": PROMPT_TEXT, "answer": t.answer(digits), "images": [entry]})
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


def _special_ids(model_dir: str, tok) -> None:
    """Write the tokenizer's eos / bos / pad ids into ``config.json`` (top level and ``text_config``) and
    ``generation_config.json``, as the published Qwen3.5 checkpoints carry them. Why: the engines stop on the
    model's eos (the CPU engine reads ``generation_config.eos_token_id``, then ``config.eos_token_id``); without
    it they never stop, and a warm-up-trained "7" + EOS came back as "7" + EOS + one more token, "7x", scored
    wrong (the held-out pass rate read ~0-7% while transformers' greedy on the same weights, stopped at EOS,
    passed 57-67%)."""
    ids = {"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id}
    if ids["eos_token_id"] is None:
        raise RuntimeError(f"{model_dir}: the task tokenizer has no eos token")
    ids = {k: int(v) for k, v in ids.items() if v is not None}
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(ids)
    cfg.setdefault("text_config", {}).update(ids)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    gpath = os.path.join(model_dir, "generation_config.json")
    gen = {}
    if os.path.isfile(gpath):
        with open(gpath) as f:
            gen = json.load(f)
    gen.update(ids)
    with open(gpath, "w") as f:
        json.dump(gen, f, indent=2)


def save_vision_miniature(out_dir: str, num_prompts: int = 1000, eval_prompts: int = 300, seed: int = 0,
                          convert: bool = False, task="sum") -> dict:
    """The miniature on disk: ``model/`` (tiny Qwen3.5-MoE VL checkpoint, its tower's biases zeroed by
    ``legible_tower``, + the task's character tokenizer:
    ``VISION_CHARS``: digits, '+', '=' at ids 3-14; the image token ids 90-93 of the tiny config), ``train.jsonl`` and
    ``heldout.jsonl`` (disjoint pictures). ``task``: ``"sum"`` (two digits, their sum; held-out = ``eval_prompts``
    random drawings, train = ``num_prompts`` others) or ``"read"`` (one digit; ``task_split``: the held-out set
    is at most a quarter of the 120 pictures, 30) or ``"read_noisy"`` (one digit, every drawing a noisy picture of
    its own: ``num_prompts`` / ``eval_prompts`` of them as asked). ``convert``: also ``mcore/``, the checkpoint through hf_to_mcore (what
    ``model.actor_init`` of examples/cpu_demo_vl.yaml names: the actor's vision tower comes from its carried
    ``model.visual.*``). Returns the paths."""
    from megatron_s3ac.models.tiny_qwen3_5 import save_tiny_qwen3_5_vl_full
    from transformers import AutoTokenizer

    from megatron_s3ac.data.char_tokenizer import char_vocab_tokenizer
    from megatron_s3ac.data.prompts import CharVocab

    model = os.path.join(out_dir, "model")
    save_tiny_qwen3_5_vl_full(model, seed=seed)
    legible_tower(model)
    vocab = CharVocab(VISION_CHARS)
    char_vocab_tokenizer(vocab).save_pretrained(model)
    # AutoTokenizer loads it as the config's tokenizer class (Qwen3.5's), which keeps the ids: check them
    back = AutoTokenizer.from_pretrained(model)
    if back(vocab.chars, add_special_tokens=False)["input_ids"] != vocab.encode(vocab.chars):
        raise RuntimeError(f"{model}: the saved tokenizer does not reproduce the character vocabulary's ids")
    _special_ids(model, back)
    t = vision_task(task)
    if t.name == "sum" and t is VISION_TASKS["sum"]:  # the original draw (kept: its sets are unchanged)
        held = digit_pairs(eval_prompts, seed + 1)
        train = digit_pairs(num_prompts, seed, exclude=set(held))
    else:
        train, held = task_split(t, num_prompts, eval_prompts, seed)
    out = {"model": model, "train": write_vision_set(os.path.join(out_dir, "train.jsonl"), train, task=t),
           "heldout": write_vision_set(os.path.join(out_dir, "heldout.jsonl"), held, task=t)}
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

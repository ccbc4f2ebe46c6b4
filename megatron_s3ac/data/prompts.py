"""Prompt sets: the synthetic "a+b=" task (character vocabulary) and math sets from jsonl/parquet, with images.

A prompt set is a list of ``Prompt(ids, text, reference, images)``; ``images`` is the prompt's
``models.multimodal.ImageInputs`` (None for a text prompt), its placeholders already expanded in ``ids``.
Rows with images follow the HF datasets / verl convention (see ``VisionProcessor``). ``PromptStream`` yields prompt indices
in a seeded order (one permutation per epoch); its state is two ints, so a checkpoint restores it.
torch is imported where prompts are drawn, not at import: tasks/ (which the reward workers load) imports this.
"""
from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

# ---- the CPU demo's task ---------------------------------------------------------------------
ARITH_CHARS = "0123456789+="
PAD, BOS, EOS = 0, 1, 2  # special ids; characters start at 3


class CharVocab:
    """Tokenizer-free vocabulary for the arithmetic task: 3 specials + digits, '+', '=' (15 ids)."""

    def __init__(self, chars: str = ARITH_CHARS):
        self.chars = chars
        self.size = 3 + len(chars)
        self._ids = {c: 3 + i for i, c in enumerate(chars)}

    def encode(self, s: str) -> list[int]:
        return [self._ids[c] for c in s]

    def decode(self, ids) -> str:
        return "".join(self.chars[i - 3] for i in ids if 3 <= i < self.size)


@dataclass
class Prompt:
    ids: list[int]
    text: str
    reference: str
    images: Optional[object] = None  # models.multimodal.ImageInputs of an image prompt (ids hold its placeholders)
    solution: Optional[str] = None  # the row's worked solution (a ``solution`` column): the critic's, never the actor's


# ---- math prompt sets (DAPO-Math-17k, MATH-1460) -----------------------------------------------
def _read_rows(path: str) -> list[dict]:
    """The rows of a jsonl or parquet file; a jsonl line that is not JSON becomes None (counted as malformed).
    ValueError naming the file (and line) when the file itself cannot be read: not parquet, not UTF-8 text."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001  (pyarrow raises ArrowInvalid, OSError, ... for a damaged file)
            raise ValueError(f"{path}: not a readable parquet file ({e})") from None
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} line {n}: not UTF-8 text ({e})") from None
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                rows.append(None)  # counted as malformed below
    return rows


def row_reference(row: dict):
    """A row's reference answer field of either schema (answer / solution_answer / reward_model.ground_truth)."""
    ref = row.get("answer", row.get("solution_answer"))
    if ref is None and isinstance(row.get("reward_model"), dict):
        ref = row["reward_model"].get("ground_truth")
    return ref


def _extract(row) -> tuple[object, str] | None:
    """(prompt: str or chat messages, reference) from one row of either schema, or None.

    DAPO-Math-17k (verl layout): prompt = [{"role": "user", "content": ...}],
    reward_model = {"ground_truth": ...}. MATH-1460 style: problem / answer (or question / answer).
    """
    if not isinstance(row, dict):
        return None
    prompt = row.get("prompt", row.get("problem", row.get("question")))
    ref = row_reference(row)
    if isinstance(prompt, str):
        ok = bool(prompt.strip())
    elif isinstance(prompt, (list, tuple)):
        ok = len(prompt) > 0 and all(isinstance(m, dict) and _is_content(m.get("content")) for m in prompt)
    else:
        ok = False
    # a reference is text or a number; str() of a list or object would be scored as if it were the answer
    if not ok or type(ref) not in (str, int, float) or str(ref).strip() == "":
        return None
    return prompt, str(ref)


def _is_content(c) -> bool:
    """A chat message's content: a string or a list of {"type": "text", "text": ...} / {"type": "image"} entries."""
    return isinstance(c, str) or (isinstance(c, list) and all(
        isinstance(e, dict) and (e.get("type") == "image" or isinstance(e.get("text"), str)) for e in c))


def load_math_prompts(path: str, tokenizer, max_prompt_tokens: int, apply_chat_template: bool = True,
                      vision: Optional["VisionProcessor"] = None, expand_images: bool = True
                      ) -> tuple[list[Prompt], dict]:
    """Prompts from a local jsonl/parquet file; malformed or too-long rows are skipped and counted, but a file
    with no usable row, or a row the tokenizer cannot encode, raises ValueError naming the file (and row).
    ``expand_images=False`` (the CLI's input check, trainer.inputs): image rows are tokenized as text, their images
    not read.

    A row with an ``images`` column (a list of images) needs ``vision`` (the model's ``VisionProcessor``): each
    image stands where its placeholder is (``<image>`` in the text, or a ``{"type": "image"}`` chat content entry),
    expanded to vision_start, n x image_token, vision_end. A missing or unreadable image file, a placeholder count
    that does not match the images, or images for a text-only model (``vision`` None) raise ``ValueError`` naming
    the row: bad data is an error, not a skipped row."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such prompt file" + (" (a directory)" if os.path.isdir(path) else ""))
    rows = _read_rows(path)
    base_dir = os.path.dirname(os.path.abspath(path))
    prompts, stats = [], {"rows": len(rows), "malformed": 0, "too_long": 0, "with_images": 0}
    first_bad = None
    for i, row in enumerate(rows):
        got = _extract(row)
        if got is None:
            stats["malformed"] += 1
            if first_bad is None:
                first_bad = f"row {i} is not JSON" if row is None else (
                    f"row {i} has no prompt text and answer of the DAPO / MATH schema")
            continue
        prompt, ref = got
        images = row.get("images") if isinstance(row, dict) else None
        if images is not None and not isinstance(images, (list, tuple)):
            images = [images]
        images = list(images) if images else []
        where = f"{path} row {i}"
        if images and vision is None:
            raise ValueError(f"{where} has {len(images)} image(s) but the model is text-only (no vision_config / "
                             f"image processor in its checkpoint): use a vision-language model or drop the images")
        msgs = prompt if isinstance(prompt, (list, tuple)) else [{"role": "user", "content": prompt}]
        chat = apply_chat_template and getattr(tokenizer, "chat_template", None)
        if chat:
            text = tokenizer.apply_chat_template(_image_entries(list(msgs)) if images else list(msgs), tokenize=False,
                                                 add_generation_prompt=True)
        else:
            text = "\n".join(_content_text(m["content"]) for m in msgs)
        image_inputs = None
        if images and expand_images:
            pil = [load_image(im, base_dir, f"{where} image {j}") for j, im in enumerate(images)]
            ids, image_inputs = vision.expand(text, pil, tokenizer, where)
            stats["with_images"] += 1
        else:
            try:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            except Exception as e:  # noqa: BLE001  (tokenizers raises its own Exception: "Missing [UNK] token")
                raise ValueError(f"{where}: the tokenizer cannot encode the prompt {text[:60]!r} ({e})") from None
        if len(ids) > max_prompt_tokens:
            stats["too_long"] += 1
            continue
        sol = row.get("solution") if isinstance(row.get("solution"), str) and row["solution"].strip() else None
        prompts.append(Prompt(list(ids), text, ref, image_inputs, sol))
    stats["kept"] = len(prompts)
    if not prompts:
        why = f"; {first_bad}" if first_bad else ""
        raise ValueError(f"{path}: no usable prompt in {stats['rows']} row(s) ({stats['malformed']} malformed, "
                         f"{stats['too_long']} longer than max_prompt_tokens={max_prompt_tokens}){why}")
    return prompts, stats


# ---- image rows ------------------------------------------------------------------------------
# Where an image stands in a prompt's text: the legacy ``<image>`` marker (verl's RLHFDataset._build_messages
# splits content on it) or what a Qwen-VL chat template renders for a {"type": "image"} entry; both spellings as
# sglang's Qwen-VL processor matches them (multimodal/processors/qwen_vl.py:396-402 in sglang 0.5.23).
IMAGE_MARK = "<image>"
_PLACEHOLDER = re.compile(r"<\|vision_start\|>(?:<\|image_pad\|>)*<\|vision_end\|>|<image>")


def _content_text(content) -> str:
    """A message's content as text: a string, or chat content entries (text kept, each image as ``<image>``)."""
    if isinstance(content, str):
        return content
    return "".join(e.get("text", "") if e.get("type") == "text" else IMAGE_MARK for e in content)


def _image_entries(msgs: list) -> list:
    """Messages with each ``<image>`` in string content turned into a {"type": "image"} chat entry (what verl's
    RLHFDataset._build_messages does), so a VL chat template renders its own image markers."""
    out = []
    for m in msgs:
        c = m["content"]
        if isinstance(c, str) and IMAGE_MARK in c:
            parts = []
            for j, seg in enumerate(c.split(IMAGE_MARK)):
                if j:
                    parts.append({"type": "image"})
                if seg:
                    parts.append({"type": "text", "text": seg})
            m = {**m, "content": parts}
        out.append(m)
    return out


def load_image(item, base_dir: str, where: str):
    """One entry of a row's ``images`` list as an RGB PIL image. Accepted, as HF ``datasets.Image`` stores images
    and verl's ``vision_utils.process_image`` reads them: a path (relative to the data file's directory), raw bytes,
    or a dict ``{"bytes": ..., "path": ...}`` (bytes win; a path alone is read from disk). ValueError naming
    ``where`` for a missing file or bytes PIL cannot decode."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, dict):
        data, path = item.get("bytes"), item.get("path")
    elif isinstance(item, (bytes, bytearray)):
        data, path = bytes(item), None
    elif isinstance(item, str):
        data, path = None, item
    else:
        raise ValueError(f"{where}: an image must be a path, bytes or {{'bytes', 'path'}}, got {type(item).__name__}")
    if data is None:
        if not path:
            raise ValueError(f"{where}: image entry has neither bytes nor a path")
        full = path if os.path.isabs(path) else os.path.join(base_dir, path)
        if not os.path.isfile(full):
            raise ValueError(f"{where}: image file {full} not found")
        with open(full, "rb") as f:
            data = f.read()
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"{where}: unreadable image ({path or f'{len(data)} bytes'}): {err}") from err
    return img.convert("RGB")


class VisionProcessor:
    """The image side of a vision-language checkpoint's processor: transformers' Qwen2-VL image processor (PIL
    backend, the one Qwen3.5 uses; torchvision does not load with the CPU torch wheel here) from the checkpoint's
    ``preprocessor_config.json`` + the config's image token ids. ``expand`` turns a prompt text with image
    placeholders into ids with each image expanded to vision_start, n x image_token_id, vision_end
    (n = t * h * w / merge_size**2), as the model's processor does, plus the ``ImageInputs``."""

    def __init__(self, image_processor, image_token_id: int, vision_start_token_id: int, vision_end_token_id: int,
                 merge_size: int):
        self.image_processor = image_processor
        self.image_token_id, self.merge_size = int(image_token_id), int(merge_size)
        self.vision_start_token_id, self.vision_end_token_id = int(vision_start_token_id), int(vision_end_token_id)

    @classmethod
    def from_pretrained(cls, model_dir: str) -> Optional["VisionProcessor"]:
        """The checkpoint's processor, or None for a text-only checkpoint (no ``vision_config`` in config.json)."""
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        if not cfg.get("vision_config"):
            return None
        pre = os.path.join(model_dir, "preprocessor_config.json")
        if not os.path.isfile(pre):
            raise ValueError(f"{model_dir} is a vision-language checkpoint without preprocessor_config.json: its "
                             f"images cannot be processed as the model was trained to see them")
        from transformers import AutoConfig
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        with open(pre) as f:
            pcfg = json.load(f)
        keep = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "size", "image_mean",
                "image_std", "do_resize", "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb")
        proc = Qwen2VLImageProcessorPil(**{k: v for k, v in pcfg.items() if k in keep})
        merge = int(cfg["vision_config"].get("spatial_merge_size", pcfg.get("merge_size", 2)))
        ids = AutoConfig.from_pretrained(model_dir)  # the token ids as the model reads them: its class's defaults
        return cls(proc, ids.image_token_id, ids.vision_start_token_id, ids.vision_end_token_id, merge)

    def expand(self, text: str, images: list, tokenizer, where: str = "prompt"):
        """(ids, ImageInputs): ``text`` split at its image placeholders, each text part tokenized
        (add_special_tokens=False) and each image replaced by its expanded tokens."""
        from megatron_s3ac.models.multimodal import ImageInputs

        parts = _PLACEHOLDER.split(text)
        if len(parts) - 1 != len(images):
            raise ValueError(f"{where}: {len(parts) - 1} image placeholder(s) ({IMAGE_MARK} or chat image entries) "
                             f"for {len(images)} image(s)")
        out = self.image_processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"].long()
        ids: list[int] = []
        for j, seg in enumerate(parts):
            if seg:
                ids.extend(tokenizer(seg, add_special_tokens=False)["input_ids"])
            if j < len(images):
                n = int(grid[j].prod()) // self.merge_size ** 2
                ids += [self.vision_start_token_id] + [self.image_token_id] * n + [self.vision_end_token_id]
        return ids, ImageInputs(out["pixel_values"].float(), grid)


class PromptStream:
    """Endless seeded stream of prompt indices: a fresh permutation every epoch. State = (epoch, pos)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0
        self._perm = self._make_perm()

    def _make_perm(self) -> torch.Tensor:
        import torch

        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100003 + self.epoch))

    def take(self, k: int) -> torch.Tensor:
        import torch

        out = []
        while k > 0:
            chunk = self._perm[self.pos:self.pos + k]
            out.append(chunk)
            self.pos += len(chunk)
            k -= len(chunk)
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._make_perm()
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, s: dict) -> None:
        self.epoch, self.pos = int(s["epoch"]), int(s["pos"])
        self._perm = self._make_perm()


# ---- coverage data (value pretraining) -------------------------------------------------------
def write_coverage(path: str, records: list[dict]) -> None:
    """jsonl rows {prompt_ids, response_ids, reward, source}; appended atomically per call."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _coverage_problem(r) -> str:
    """Why a coverage row is unusable, or "" (token ids: non-empty lists of ints >= 0; reward: -1 or 1)."""
    if not isinstance(r, dict):
        return f"a row must be an object, got {type(r).__name__}"
    for key in ("prompt_ids", "response_ids"):
        ids = r.get(key)
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                           for t in ids):
            return f"{key} must be a non-empty list of token ids, got {json.dumps(ids)[:40]}"
    if isinstance(r.get("reward"), bool) or r.get("reward") not in (-1, 1):
        return f"reward must be -1 or 1, got {json.dumps(r.get('reward'))[:20]}"
    return ""


def read_coverage(path: str) -> tuple[list[dict], dict]:
    """The usable rows of a coverage jsonl and {rows, malformed}; malformed rows are skipped and counted. ValueError
    naming the file and its first bad line when no row is usable (an empty file included)."""
    rows, bad, first = [], 0, ""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                why = _coverage_problem(json.loads(line))
            except json.JSONDecodeError as err:
                why = f"not JSON: {err.msg} at column {err.colno}"
            if not why:
                rows.append(json.loads(line))
                continue
            bad += 1
            first = first or f"line {n}: {why}"
    if not rows:
        raise ValueError(f"{path}: no usable coverage row ({bad} malformed{'; ' + first if first else ''}); "
                         f"rows are {{prompt_ids, response_ids, reward: -1 | 1}}")
    return rows, {"rows": len(rows), "malformed": bad}

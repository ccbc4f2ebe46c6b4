"""Benchmark files -> normalised items (prompt text, reference, kind), and the prompt template.

Accepted row schemas (auto-detected per row; keys are matched case-insensitively):
- MATH500, AIME 2024/2025, AMC23:  problem | question | prompt   +  answer | reference
- OlympiadBench:                   question  +  final_answer (list; several answers are joined by ", ")
- Minerva:                         problem   +  answer, or solution (its last \\boxed{} is the answer)
- multiple choice (GPQA style):    question + choices | options (list, or dict letter -> text)
                                   + answer (letter "C", 0-based index, or the correct choice's text)
- GPQA raw (Idavidrein/gpqa):      Question + Correct Answer + Incorrect Answer 1..3; the four choices
                                   are shuffled with a per-question seed, so the correct one is not
                                   always A and every run sees the same order.
Named releases (a benchmark named after one, or BenchmarkSpec(schema=...) / --schema NAME=SCHEMA): the
file must have every column of the release as published (see SCHEMAS, each citing where its layout was
read), else it is refused naming the missing columns:
- aime26:           MathArena/aime_2026 (parquet)        problem_idx, problem, answer
- hmmt26:           MathArena/hmmt_feb_2026 (parquet)    problem_idx, problem, answer, problem_type
- imo_answerbench:  google-deepmind/superhuman imobench/answerbench.csv
                    Problem ID, Problem, Short Answer, Category, Subcategory, Source (Level optional)
Multimodal releases (the image benchmarks of the Qwen3.5 / Intern-S2 papers; ``VISION_SCHEMAS``, each citing its
layout): the item's prompt holds one ``<image>`` marker per image (``Item.images``: the raw entries, a path relative
to the file or bytes / {"bytes", "path"} as HF ``datasets.Image`` stores them), evaluated on a vision-language model
(``--engine cpu`` loads it multimodal):
- mathvista:   AI4Math/MathVista (testmini)  pid, question, image, decoded_image, choices, answer, question_type,
               answer_type (+ query, unit, precision, metadata); question_type "multi_choice" -> choice (the answer is
               the correct choice's text), "free_form" -> math
- mathvision:  MathLLMs/MathVision  id, question, options, image (+ decoded_image, answer, solution, level, subject);
               options non-empty -> choice (answer letter), empty -> math
- mmmu_pro:    MMMU/MMMU_Pro  "standard (4/10 options)": id, question, options (a Python-literal list in a string),
               image_1 .. image_7, answer (letter), subject, ...; "<image k>" in the question marks image_k;
               "vision": id, image (question and options are inside it), options, answer, subject
Any row may also carry "prompt_ids" (a list of token ids): it is then fed to the model exactly, with
no template; the trainer uses this for its held-out split, so eval sees the prompts as training does.

The reward a benchmark is scored with can be declared by the file: a "reward" field on its rows (one
registered reward name, the same on every row that has it) or a sidecar ``<file>.meta.json`` holding
{"reward": NAME}. A pre-tokenized file (rows with "prompt_ids", i.e. written by a trainer for its own
task) that declares none cannot be scored without the caller naming the reward: the default math
verifier would silently score a task it does not know (see runner.resolve_reward).
Files: .jsonl / .json (list of rows) / .parquet / .csv (header row). A row that fits no schema, has an empty field or
an answer outside its choices is skipped and counted by reason in `Benchmark.skipped`.

Kinds: "math" (scored by the rollout's math-verify reward) or "choice" (letter extraction).
"""
from __future__ import annotations

import collections
import csv
import dataclasses
import json
import os
import random
import string
from typing import Any, Iterable, Optional, Union

from megatron_s3ac.rollout.rewards import extract_last_boxed

KINDS = ("math", "choice")
LETTERS = string.ascii_uppercase
GPQA_SHUFFLE_SEED = 0

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CHOICE_INSTRUCTION = "Please reason step by step, and put the letter of the correct choice within \\boxed{}."
# Without a chat template: the instruction-bearing text followed by an answer cue.
PLAIN_TEMPLATE = "{prompt}\n\nAnswer:"


class EvalInputError(ValueError):
    """Input that cannot be scored honestly (undeclared or conflicting reward, undecodable responses):
    the evaluation stops instead of reporting a wrong number; the CLI exits 2 with this message."""


@dataclasses.dataclass(frozen=True)
class Item:
    """One benchmark question. For kind "choice", reference is a letter and choices holds the options."""

    prompt: str  # question text (choices listed "A) ..." for kind "choice"), without instruction
    reference: str
    kind: str
    choices: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()  # pre-tokenized prompt (row field "prompt_ids"): used as is
    images: tuple = ()  # image benchmarks: the raw image entries, one per "<image>" in prompt, in order
    image_dir: str = ""  # where relative image paths are resolved (the benchmark file's directory)


@dataclasses.dataclass
class Benchmark:
    """A loaded benchmark: its items and the rows skipped while loading ({reason: count})."""

    name: str
    items: list[Item]
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    reward: Optional[str] = None  # the reward the file declares (row field "reward" or sidecar), if any
    source: str = "<rows>"  # the file it came from, for error messages

    @property
    def pretokenized(self) -> bool:
        """True when any item carries its own token ids (a trainer-written set)."""
        return any(it.token_ids for it in self.items)

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())


# ----------------------------------------------------------------------------------------------
# Reading files
# ----------------------------------------------------------------------------------------------
def read_rows(path: str) -> tuple[list[Any], dict[str, int]]:
    """Rows of a .jsonl / .json / .parquet file; undecodable jsonl lines are counted, not raised."""
    skipped: collections.Counter = collections.Counter()
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist(), {}
    if ext == ".json":
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as err:
                raise EvalInputError(f"{path}: not JSON ({err.msg} at line {err.lineno}, column {err.colno})") \
                    from None
        if not isinstance(data, list):
            raise EvalInputError(f"{path}: a .json benchmark must hold a list of rows, got {type(data).__name__}")
        return data, {}
    if ext == ".csv":  # IMO-AnswerBench's release format; quoted cells may span lines
        with open(path, encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f)), {}
    if ext != ".jsonl":
        raise ValueError(f"{path}: unsupported benchmark file type {ext!r} (jsonl, json, parquet, csv)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                skipped["bad_json"] += 1
    return rows, dict(skipped)


SIDECAR_SUFFIX = ".meta.json"


def sidecar_path(path: str) -> str:
    """The metadata file next to a benchmark file: ``heldout.jsonl`` -> ``heldout.jsonl.meta.json``."""
    return path + SIDECAR_SUFFIX


def declared_reward(rows: list[Any], path: Optional[str] = None) -> Optional[str]:
    """The reward name the rows' "reward" field and/or the sidecar of `path` declare, else None.

    Raises ValueError when they disagree (two names on the rows, or rows vs sidecar): a file that
    names two verifiers cannot be scored by one.
    """
    where = path or "rows"
    names = {str(r.get("reward")).strip() for r in rows if isinstance(r, dict) and r.get("reward") is not None}
    if len(names) > 1:
        raise EvalInputError(f"{where}: rows declare different rewards {sorted(names)}; a benchmark is scored by one")
    declared = names.pop() if names else None
    if path is not None and os.path.isfile(sidecar_path(path)):
        try:
            with open(sidecar_path(path), encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise EvalInputError(f"{sidecar_path(path)}: unreadable benchmark metadata ({e})") from None
        side = meta.get("reward") if isinstance(meta, dict) else None
        if side is not None and not (isinstance(side, str) and side.strip()):
            raise EvalInputError(f"{sidecar_path(path)}: 'reward' must be a reward name, got {side!r}")
        if side is not None:
            if declared is not None and side.strip() != declared:
                raise EvalInputError(f"{where}: rows declare reward {declared!r} but {sidecar_path(path)} says {side!r}")
            declared = side.strip()
    if declared == "":
        raise EvalInputError(f"{where}: empty 'reward' field")
    return declared


# ----------------------------------------------------------------------------------------------
# Named releases
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Schema:
    """A benchmark release's column layout, as published. columns: every column a file must have (matched
    case-insensitively, reported as the release spells them); question / answer: the two read."""

    name: str
    columns: tuple[str, ...]
    question: str
    answer: str
    source: str  # where the layout was read


SCHEMAS = {s.name: s for s in (
    # huggingface.co/datasets/MathArena/aime_2026, README.md dataset_info (commit 2548a41): features
    # problem_idx int64, answer int64, problem string; one split "train", 30 rows, parquet.
    Schema("aime26", ("problem_idx", "problem", "answer"), "problem", "answer",
           "MathArena/aime_2026 (Hugging Face dataset card: problem_idx, problem, answer)"),
    # huggingface.co/datasets/MathArena/hmmt_feb_2026, README.md dataset_info (commit afb530a): features
    # problem_idx int64, answer string, problem_type list[string], problem string; 33 rows, parquet.
    Schema("hmmt26", ("problem_idx", "problem", "answer", "problem_type"), "problem", "answer",
           "MathArena/hmmt_feb_2026 (Hugging Face dataset card: problem_idx, problem, answer, problem_type)"),
    # github.com/google-deepmind/superhuman imobench/answerbench.csv header (commit f960960):
    # "Problem ID,Problem,Short Answer,Category,Level,Subcategory,Source"; the dataset card
    # imobench/hf_dataset_cards/answerbench.md lists the same columns. Level is not required (the
    # paper's release text names six columns; nothing here reads it).
    Schema("imo_answerbench", ("Problem ID", "Problem", "Short Answer", "Category", "Subcategory", "Source"),
           "Problem", "Short Answer",
           "google-deepmind/superhuman imobench/answerbench.csv (IMO-AnswerBench)"),
)}
SCHEMA_ALIASES = {"aime_2026": "aime26", "aime2026": "aime26", "hmmt_feb_2026": "hmmt26", "hmmt_feb26": "hmmt26",
                  "hmmt2026": "hmmt26", "imo-answerbench": "imo_answerbench", "imoanswerbench": "imo_answerbench",
                  "answerbench": "imo_answerbench"}


def schema_for(name: str) -> Optional[Schema]:
    """The release schema a benchmark *named* `name` must follow (aime26, hmmt26, imo_answerbench and
    their aliases, case-insensitive), else None."""
    key = name.strip().lower()
    return SCHEMAS.get(SCHEMA_ALIASES.get(key, key))


def get_schema(schema: str) -> Schema:
    """A schema by name or alias; EvalInputError naming the known ones otherwise."""
    found = schema_for(schema)
    if found is None:
        raise EvalInputError(f"unknown benchmark schema {schema!r}; known: {sorted(SCHEMAS)}")
    return found


def check_schema(rows: list[Any], schema: Schema, where: str) -> None:
    """Refuse `rows` unless every row has every column of `schema` (EvalInputError naming the missing ones)."""
    if not rows:
        raise EvalInputError(f"{where}: no rows; expected the {schema.name} schema of {schema.source}")
    for i, row in enumerate(rows):
        keys = {str(k).strip().lower() for k in row} if isinstance(row, dict) else set()
        missing = [c for c in schema.columns if c.lower() not in keys]
        if missing:
            found = sorted(map(str, row)) if isinstance(row, dict) else type(row).__name__
            raise EvalInputError(f"{where}: not in the {schema.name} schema of {schema.source}: row {i} is missing "
                                 f"column(s) {missing} (found {found})")


def _schema_row(row: dict, schema: Schema) -> tuple[Optional[Item], str]:
    r = {str(k).strip().lower(): v for k, v in row.items()}
    question = _text(r.get(schema.question.lower()))
    if question is None:
        return None, "missing_question"
    reference = _text(r.get(schema.answer.lower()))
    if reference is None:
        return None, "missing_answer"
    return Item(prompt=question, reference=reference, kind="math"), ""


# ----------------------------------------------------------------------------------------------
# Multimodal releases
# ----------------------------------------------------------------------------------------------
IMAGE_MARK = "<image>"


def _image_entry(value: Any) -> Any:
    """A row's image cell as an entry data.prompts.load_image reads (path str, bytes, {"bytes", "path"}), or None."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    if isinstance(value, dict):
        return value if (value.get("bytes") or value.get("path")) else None
    if isinstance(value, (bytes, bytearray)) or (isinstance(value, str) and value.strip()):
        return value
    return None


def _options(value: Any) -> Optional[list[str]]:
    """A choices / options cell: a list, or (MMMU-Pro) a Python-literal list in a string (read with
    ast.literal_eval: literals only, nothing executed). None when absent or empty."""
    import ast

    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return None
    if not isinstance(value, (list, tuple)) or not value:
        return None
    out = [_text(v) for v in value]
    return out if all(out) else None


def _letter(answer: Any, choices: list[str]) -> Optional[str]:
    a = _text(answer)
    if a is None:
        return None
    a = a.strip("()").strip()
    if len(a) == 1 and a.upper() in LETTERS[: len(choices)]:
        return a.upper()
    return LETTERS[choices.index(a)] if a in choices else None


def _mathvista(r: dict) -> tuple[Optional[Item], str]:
    image = _image_entry(r.get("decoded_image")) or _image_entry(r.get("image"))
    if image is None:
        return None, "missing_image"
    question = _text(r.get("question"))
    if question is None:
        return None, "missing_question"
    choices = None
    if str(r.get("question_type", "")).strip() == "multi_choice":
        choices = _options(r.get("choices"))
        if choices is None or not 2 <= len(choices) <= len(LETTERS):
            return None, "bad_choices"
    unit = _text(r.get("unit"))
    return _image_item(image, question, choices, r.get("answer"), f" (unit: {unit})" if unit else "")


def _image_item(image, question: str, choices, answer, suffix: str = "") -> tuple[Optional[Item], str]:
    """One image benchmark item: multiple choice (``choices``: the options, answer a letter or an option) or free
    form (``choices`` None / empty: answer the reference, scored as math); ``suffix`` follows a free-form question."""
    if choices:
        letter = _letter(answer, choices)
        if letter is None:
            return None, "bad_answer"
        item = _choice_item(f"{IMAGE_MARK}{question}", choices, letter)
    else:
        ref = _text(answer)
        if ref is None:
            return None, "missing_answer"
        item = Item(prompt=f"{IMAGE_MARK}{question}{suffix}", reference=ref, kind="math")
    return dataclasses.replace(item, images=(image,)), ""


def _mathvision(r: dict) -> tuple[Optional[Item], str]:
    image = _image_entry(r.get("decoded_image")) or _image_entry(r.get("image"))
    if image is None:
        return None, "missing_image"
    question = _text(r.get("question"))
    if question is None:
        return None, "missing_question"
    question = question.replace("<image1>", "").strip()  # MathVision marks its one image in the text
    return _image_item(image, question, _options(r.get("options")), r.get("answer"))


def _mmmu_pro(r: dict) -> tuple[Optional[Item], str]:
    import re

    choices = _options(r.get("options"))
    if choices is None or not 2 <= len(choices) <= len(LETTERS):
        return None, "bad_choices"
    letter = _letter(r.get("answer"), choices)
    if letter is None:
        return None, "bad_answer"
    if "question" not in r:  # the "vision" setting: question and options are in the screenshot
        image = _image_entry(r.get("image"))
        if image is None:
            return None, "missing_image"
        item = _choice_item(IMAGE_MARK + "Answer the question in the image.", choices, letter)
        return dataclasses.replace(item, images=(image,)), ""
    question = _text(r.get("question"))
    if question is None:
        return None, "missing_question"
    text = question + "\n" + "\n".join(choices)
    order = []  # images in order of first mention; "<image k>" -> "<image>"
    for m in re.finditer(r"<image (\d+)>", text):
        k = int(m.group(1))
        if k not in order:
            order.append(k)
    images = []
    for k in order:
        e = _image_entry(r.get(f"image_{k}"))
        if e is None:
            return None, "missing_image"
        images.append(e)
    if not images:
        return None, "missing_image"
    seen = set()

    def mark(m):  # the first mention of image k stands for it; a repeat becomes plain text
        k = int(m.group(1))
        if k in seen:
            return f"(image {k})"
        seen.add(k)
        return IMAGE_MARK

    item = _choice_item(re.sub(r"<image (\d+)>", mark, question),
                        [re.sub(r"<image (\d+)>", mark, c) for c in choices], letter)
    return dataclasses.replace(item, images=tuple(images)), ""


@dataclasses.dataclass(frozen=True)
class VisionSchema:
    """An image benchmark's release layout: ``columns`` every row must have (case-insensitive), ``any_of`` groups of
    which each row needs one (the image column: a path or the decoded image), ``parse`` the row reader."""

    name: str
    columns: tuple[str, ...]
    any_of: tuple[tuple[str, ...], ...]
    parse: Any
    source: str


VISION_SCHEMAS = {s.name: s for s in (
    # huggingface.co/datasets/AI4Math/MathVista README.md dataset_info (commit d32e834): pid, question, image
    # (string path "images/<pid>.jpg"), decoded_image (image), choices (sequence string), unit, precision, answer,
    # question_type, answer_type, metadata, query; splits testmini (1000 rows), test (5141).
    VisionSchema("mathvista", ("pid", "question", "answer", "question_type"), (("image", "decoded_image"),),
                 _mathvista, "AI4Math/MathVista (Hugging Face dataset card, testmini split)"),
    # huggingface.co/datasets/MathLLMs/MathVision (parquet, splits test / testmini): id, question, options (list,
    # empty for free-form), image (path "images/<id>.jpg"), decoded_image, answer (a letter for multiple choice),
    # solution, level, subject.
    VisionSchema("mathvision", ("id", "question", "options", "answer"), (("image", "decoded_image"),),
                 _mathvision, "MathLLMs/MathVision (Hugging Face dataset)"),
    # huggingface.co/datasets/MMMU/MMMU_Pro README.md dataset_info (commit cd9382d): configs "standard (10 options)"
    # / "standard (4 options)": id, question, options (string), explanation, image_1 .. image_7, img_type, answer,
    # topic_difficulty, subject; "vision": id, image, options, answer, subject.
    VisionSchema("mmmu_pro", ("id", "options", "answer"), (("question", "image"),), _mmmu_pro,
                 "MMMU/MMMU_Pro (Hugging Face dataset card: standard and vision configs)"),
)}
VISION_ALIASES = {"mathvista_mini": "mathvista", "mathvista-mini": "mathvista", "mathvista_testmini": "mathvista",
                  "math_vision": "mathvision", "math-vision": "mathvision", "mmmu-pro": "mmmu_pro",
                  "mmmupro": "mmmu_pro"}


def vision_schema_for(name: Optional[str]) -> Optional[VisionSchema]:
    """The image-benchmark layout a benchmark named (or given the schema) ``name`` follows, else None."""
    if not name:
        return None
    key = name.strip().lower()
    return VISION_SCHEMAS.get(VISION_ALIASES.get(key, key))


def _check_vision_schema(rows: list[Any], schema: VisionSchema, where: str) -> None:
    if not rows:
        raise EvalInputError(f"{where}: no rows; expected the {schema.name} layout of {schema.source}")
    for i, row in enumerate(rows):
        keys = {str(k).strip().lower() for k in row} if isinstance(row, dict) else set()
        missing = [c for c in schema.columns if c.lower() not in keys]
        missing += ["/".join(g) for g in schema.any_of if not any(c.lower() in keys for c in g)]
        if missing:
            found = sorted(map(str, row)) if isinstance(row, dict) else type(row).__name__
            raise EvalInputError(f"{where}: not in the {schema.name} layout of {schema.source}: row {i} is missing "
                                 f"column(s) {missing} (found {found})")


def load_benchmark(name: str, source: Union[str, Iterable[Any]], schema: Optional[str] = None) -> Benchmark:
    """Load a file path or an iterable of row dicts into a Benchmark (malformed rows skipped, counted).

    schema: a release schema (SCHEMAS) the rows must follow; None: the one the benchmark's name implies
    (schema_for), if any; "auto": none, rows are detected one by one."""
    path = None
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        rows, skipped = read_rows(path)
    else:
        rows, skipped = list(source), {}
    vision = None if schema == "auto" else vision_schema_for(schema or name)
    release = None if schema == "auto" or vision is not None else (get_schema(schema) if schema else schema_for(name))
    if release is not None:
        check_schema(rows, release, f"{name} ({path or 'rows'})")
    if vision is not None:
        _check_vision_schema(rows, vision, f"{name} ({path or 'rows'})")
    image_dir = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
    counts = collections.Counter(skipped)
    items = []
    for row in rows:
        if vision is not None:
            item, reason = vision.parse({str(k).strip().lower(): v for k, v in row.items()})
            item = item if item is None else dataclasses.replace(item, image_dir=image_dir)
        else:
            item, reason = _schema_row(row, release) if release is not None else normalize_row(row)
        if item is None:
            counts[reason] += 1
        else:
            items.append(item)
    if path is not None and not items:  # a table of n/a would read as a result: refuse, naming the file
        why = "; skipped: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) if counts else ""
        raise EvalInputError(f"{path}: benchmark {name!r} has no usable row ({len(rows)} parsed{why}"
                             f"{_first_bad_line(path)})")
    return Benchmark(name=name, items=items, skipped=dict(counts), reward=declared_reward(rows, path),
                     source=path or "<rows>")


def _first_bad_line(path: str) -> str:
    """"; line N is not JSON: ..." for the first undecodable line of a .jsonl file, else "" (error messages)."""
    if not path.endswith(".jsonl"):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as err:
                    return f"; line {n} is not JSON: {err.msg} at column {err.colno}"
    return ""


# ----------------------------------------------------------------------------------------------
# Row normalisation
# ----------------------------------------------------------------------------------------------
def normalize_row(row: Any) -> tuple[Optional[Item], str]:
    """(Item, "") for a usable row, else (None, reason)."""
    if not isinstance(row, dict):
        return None, "not_a_dict"
    r = {str(k).strip().lower(): v for k, v in row.items()}
    if "correct answer" in r:
        item, reason = _gpqa_raw(r)
    elif "choices" in r or "options" in r:
        item, reason = _multiple_choice(r)
    else:
        item, reason = _math(r)
    if item is None or r.get("prompt_ids") is None:
        return item, reason
    ids = r["prompt_ids"]
    if not isinstance(ids, (list, tuple)) or not ids or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        return None, "bad_prompt_ids"
    return dataclasses.replace(item, token_ids=tuple(ids)), ""


def _text(value: Any) -> Optional[str]:
    """A non-empty string from a str / int / float field (27.0 -> "27"), else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float):
        if value != value:  # NaN (empty parquet cell)
            return None
        value = int(value) if value.is_integer() else value
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


def _first(r: dict, keys: tuple[str, ...]) -> Any:
    return next((r[k] for k in keys if r.get(k) is not None), None)


def _math(r: dict) -> tuple[Optional[Item], str]:
    question = _text(_first(r, ("problem", "question", "prompt")))
    if question is None:
        return None, "missing_question"
    reference = None
    if isinstance(r.get("final_answer"), (list, tuple)):  # OlympiadBench
        parts = [_text(a) for a in r["final_answer"]]
        reference = ", ".join(parts) if parts and all(parts) else None
    else:
        reference = _text(_first(r, ("answer", "final_answer", "reference")))
    if reference is None and _text(r.get("solution")) is not None:  # Minerva: boxed in the solution
        reference = _text(extract_last_boxed(r["solution"]))
    if reference is None:
        return None, "missing_answer"
    return Item(prompt=question, reference=reference, kind="math"), ""


def _multiple_choice(r: dict) -> tuple[Optional[Item], str]:
    question = _text(_first(r, ("question", "problem", "prompt")))
    if question is None:
        return None, "missing_question"
    raw = _first(r, ("choices", "options"))
    if isinstance(raw, dict):  # {"A": "...", "B": "..."}
        raw = [raw[k] for k in sorted(raw)]
    if not isinstance(raw, (list, tuple)) or not 2 <= len(raw) <= len(LETTERS):
        return None, "bad_choices"
    choices = [_text(c) for c in raw]
    if not all(choices):
        return None, "bad_choices"
    answer = _first(r, ("answer", "correct_answer", "label"))
    letter = None
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices):
        letter = LETTERS[answer]
    elif isinstance(answer, str):
        a = answer.strip().strip("()").strip()
        if len(a) == 1 and a.upper() in LETTERS[: len(choices)]:
            letter = a.upper()
        elif answer.strip() in choices:
            letter = LETTERS[choices.index(answer.strip())]
    if letter is None:
        return None, "bad_answer"
    return _choice_item(question, choices, letter), ""


def _gpqa_raw(r: dict) -> tuple[Optional[Item], str]:
    question = _text(r.get("question"))
    correct = _text(r.get("correct answer"))
    wrong = [_text(r.get(f"incorrect answer {i}")) for i in (1, 2, 3)]
    if question is None:
        return None, "missing_question"
    if correct is None or not all(wrong):
        return None, "bad_choices"
    choices = [correct] + wrong
    # A local Random seeded by the question: the order is stable across runs and row orders, and
    # the global `random` stream is untouched.
    random.Random(f"{GPQA_SHUFFLE_SEED}:{question}").shuffle(choices)
    return _choice_item(question, choices, LETTERS[choices.index(correct)]), ""


def _choice_item(question: str, choices: list[str], letter: str) -> Item:
    listed = "\n".join(f"{LETTERS[i]}) {c}" for i, c in enumerate(choices))
    return Item(prompt=f"{question}\n\n{listed}", reference=letter, kind="choice", choices=tuple(choices))


# ----------------------------------------------------------------------------------------------
# Prompt template
# ----------------------------------------------------------------------------------------------
def render_prompt(item: Item, tokenizer=None, template: str = "auto") -> str:
    """The text fed to the model.

    template: "auto" (the tokenizer's chat template when it has one, else PLAIN_TEMPLATE), "chat",
    "raw" (item.prompt exactly, no instruction: e.g. the CPU demo's "12+34=" task), or a format
    string with a "{prompt}" field used instead of PLAIN_TEMPLATE.
    """
    if template == "raw":
        return item.prompt
    instruction = CHOICE_INSTRUCTION if item.kind == "choice" else MATH_INSTRUCTION
    text = f"{item.prompt}\n\n{instruction}"
    if uses_chat_template(tokenizer, template):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("template='chat' but the tokenizer has no chat template")
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    if template == "auto":
        return PLAIN_TEMPLATE.format(prompt=text)
    if "{prompt}" not in template:
        raise ValueError(f"template must be 'auto', 'chat', 'raw' or contain '{{prompt}}', got {template!r}")
    return template.format(prompt=text)


def uses_chat_template(tokenizer, template: str = "auto") -> bool:
    return template == "chat" or (template == "auto" and tokenizer is not None
                                  and bool(getattr(tokenizer, "chat_template", None)))


def prompt_ids(item: Item, tokenizer, template: str = "auto") -> list[int]:
    """Token ids of the rendered prompt. A chat template writes its own special tokens, so none are
    added then (as apply_chat_template(tokenize=True) does); otherwise the tokenizer's defaults apply.
    A tokenizer that is not an HF one (not callable, e.g. the CPU demo's CharVocab) needs .encode(text)."""
    if item.token_ids:
        return list(item.token_ids)
    text = render_prompt(item, tokenizer, template)
    try:
        if not callable(tokenizer):
            return list(tokenizer.encode(text))
        return list(tokenizer(text, add_special_tokens=not uses_chat_template(tokenizer, template))["input_ids"])
    except Exception as err:  # tokenizers raises its own Exception ("WordLevel error: Missing [UNK] token")
        raise EvalInputError(f"the tokenizer cannot encode the prompt {item.prompt[:60]!r} "
                             f"({type(err).__name__}: {err})") from None


def prompt_inputs(item: Item, tokenizer, template: str = "auto", vision=None):
    """(ids, ImageInputs or None) of an item: ``prompt_ids`` for a text item; for an image item the rendered
    prompt through the model's ``data.prompts.VisionProcessor`` (each ``<image>`` expanded to its tokens).
    EvalInputError for an image item without a vision-language model (``vision`` None) or an unreadable image."""
    if not item.images:
        return prompt_ids(item, tokenizer, template), None
    if vision is None:
        raise EvalInputError("an image benchmark needs a vision-language model (a checkpoint with vision_config and "
                             "preprocessor_config.json); this one is text-only")
    from megatron_s3ac.data.prompts import load_image

    text = render_prompt(item, tokenizer, template)
    try:
        pil = [load_image(e, item.image_dir, f"image {j} of {item.prompt[:40]!r}") for j, e in enumerate(item.images)]
        return vision.expand(text, pil, tokenizer, f"{item.prompt[:40]!r}")
    except ValueError as err:
        raise EvalInputError(str(err)) from None


def undecodable_ids(tokenizer, ids) -> list[int]:
    """The ids among `ids` that `tokenizer` has no token for (id outside its vocabulary, e.g. a model
    saved without its tokenizer, whose stand-in has an empty vocabulary). Empty list: all decodable."""
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "size", None)
    if size is None:
        return []
    return [int(t) for t in ids if not 0 <= int(t) < size]


def decode_response(tokenizer, ids) -> str:
    """Response text without special tokens; falls back to .decode(ids) for non-HF vocabularies."""
    try:
        return tokenizer.decode(ids, skip_special_tokens=True)
    except TypeError:
        return tokenizer.decode(ids)

"""Benchmark schemas -> items, malformed rows skipped with counts, prompt templates."""
import json
import os

import pytest

from eval_fixtures import EXAMPLES
from megatron_s3ac.eval.benchmarks import (
    CHOICE_INSTRUCTION, MATH_INSTRUCTION, Item, load_benchmark, normalize_row, prompt_ids, render_prompt,
)


def load_example(name):
    return load_benchmark(name, os.path.join(EXAMPLES, name))


@pytest.mark.parametrize("filename, kind, references", [
    ("math500.jsonl", "math", ["\\frac{5}{6}", "4", "\\left( 3, \\frac{\\pi}{2} \\right)"]),
    ("aime24.jsonl", "math", ["016", "1"]),
    ("aime25.jsonl", "math", ["15", "16"]),                       # question/answer, int answers
    ("amc23.jsonl", "math", ["216", "25"]),                       # float answers 216.0 -> "216"
    ("olympiadbench.jsonl", "math", ["$3$, $-3$", "$11$"]),       # final_answer lists
    ("minerva.jsonl", "math", ["60", "9"]),                       # boxed in the solution, or answer
    ("multiple_choice.jsonl", "choice", ["B", "B"]),              # letter, and 0-based index
    ("arithmetic.jsonl", "math", ["46", "12", "42"]),
])
def test_example_files_load(filename, kind, references):
    bench = load_example(filename)
    assert bench.num_skipped == 0
    assert [it.kind for it in bench.items] == [kind] * len(references)
    assert [it.reference for it in bench.items] == references


def test_gpqa_raw_choices_are_shuffled_stably():
    bench = load_example("gpqa_diamond.jsonl")
    assert bench.num_skipped == 0
    first = bench.items[0]
    assert first.kind == "choice" and sorted(first.choices) == sorted(
        ["The photon", "The gluon", "The W boson", "The Higgs boson"])
    assert first.choices["ABCD".index(first.reference)] == "The photon"
    assert "A) " in first.prompt and "D) " in first.prompt
    assert load_example("gpqa_diamond.jsonl").items == bench.items  # same order on every load
    refs = {load_benchmark("g", [{"Question": f"q{i}", "Correct Answer": "x", "Incorrect Answer 1": "y",
                                  "Incorrect Answer 2": "z", "Incorrect Answer 3": "w"}]).items[0].reference
            for i in range(20)}
    assert len(refs) > 1  # the correct answer is not always in the same place


def test_malformed_rows_are_skipped_with_counts(tmp_path):
    good = {"problem": "1+1?", "answer": "2"}
    lines = [json.dumps(good), "{not json", "", json.dumps([1, 2]),
             json.dumps({"problem": "", "answer": "2"}),                              # empty question
             json.dumps({"problem": "q", "answer": None}),                            # no answer
             json.dumps({"question": "q", "final_answer": []}),                       # empty list
             json.dumps({"problem": "q", "solution": "no box here"}),                 # Minerva, no box
             json.dumps({"question": "q", "choices": ["a", "b"], "answer": "C"}),     # letter out of range
             json.dumps({"question": "q", "choices": ["a"], "answer": "A"}),          # one choice
             json.dumps({"question": "q", "options": ["a", ""], "answer": 0}),        # empty option
             json.dumps({"Question": "q", "Correct Answer": "a", "Incorrect Answer 1": "b"}),  # GPQA, 2 missing
             json.dumps({"question": "q", "choices": ["a", "b"], "answer": "b"}),     # answer by text: OK
             json.dumps({"prompt": "1+2=", "answer": "3", "prompt_ids": [5, -1]}),    # bad token ids
             json.dumps({"prompt": "1+2=", "answer": "3", "prompt_ids": [2, 4, 13]}),  # pre-tokenized: OK
             ]
    path = tmp_path / "bench.jsonl"
    path.write_text("\n".join(lines) + "\n")
    bench = load_benchmark("b", str(path))
    assert [(it.reference, it.kind) for it in bench.items] == [("2", "math"), ("B", "choice"), ("3", "math")]
    assert bench.items[2].token_ids == (2, 4, 13) and prompt_ids(bench.items[2], None) == [2, 4, 13]
    assert bench.skipped == {"bad_json": 1, "not_a_dict": 1, "missing_question": 1, "missing_answer": 3,
                             "bad_answer": 1, "bad_choices": 3, "bad_prompt_ids": 1}
    assert bench.num_skipped == 11


def test_parquet_and_json_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "2+2?", "final_answer": ["4"]}, {"question": "3+3?", "final_answer": ["6"]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "olympiad.parquet")
    assert [it.reference for it in load_benchmark("o", str(tmp_path / "olympiad.parquet")).items] == ["4", "6"]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    assert len(load_benchmark("o", str(tmp_path / "rows.json")).items) == 2
    with pytest.raises(ValueError, match="unsupported"):
        load_benchmark("o", str(tmp_path / "rows.txt"))  # .csv is read (IMO-AnswerBench)


def test_case_insensitive_keys_and_nan_answer():
    item, _ = normalize_row({"Problem": "q", "Answer": 3.5})
    assert item == Item("q", "3.5", "math")
    assert normalize_row({"problem": "q", "answer": float("nan")}) == (None, "missing_answer")


def test_templates(tokenizer):
    item = Item("What is 1+1?", "2", "math")
    assert render_prompt(item, tokenizer, "raw") == "What is 1+1?"
    plain = render_prompt(item, tokenizer, "auto")  # the char tokenizer has no chat template
    assert plain.startswith("What is 1+1?") and MATH_INSTRUCTION in plain and plain.endswith("Answer:")
    assert render_prompt(item, None, "Q: {prompt}\nA:") == f"Q: What is 1+1?\n\n{MATH_INSTRUCTION}\nA:"
    choice = Item("Pick.\n\nA) x\nB) y", "A", "choice", ("x", "y"))
    assert CHOICE_INSTRUCTION in render_prompt(choice, None)
    with pytest.raises(ValueError, match="chat template"):
        render_prompt(item, tokenizer, "chat")
    with pytest.raises(ValueError, match="prompt"):
        render_prompt(item, tokenizer, "no placeholder")


def test_chat_template_is_used_when_present():
    from eval_fixtures import char_tokenizer

    tok = char_tokenizer()
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}")
    item = Item("1+1=", "2", "math")
    text = render_prompt(item, tok, "auto")
    assert text == f"<bos>[user]1+1=\n\n{MATH_INSTRUCTION}[assistant]"
    ids = prompt_ids(item, tok, "auto")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # no second BOS added
    assert prompt_ids(item, tok, "raw") == tok("1+1=")["input_ids"]

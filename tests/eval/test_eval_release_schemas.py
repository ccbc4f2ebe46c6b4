"""Release schemas (AIME26, HMMT26, IMO-AnswerBench): fixtures in the published layout load; a file in
the wrong schema is refused naming the missing columns (also through s3ac-eval, exit 2)."""
import json
import os

import pytest

from eval_fixtures import EXAMPLES
from megatron_s3ac.eval.benchmarks import EvalInputError, SCHEMAS, load_benchmark, schema_for


def path(name):
    return os.path.join(EXAMPLES, name)


@pytest.mark.parametrize("name, filename, references", [
    ("aime26", "aime26.jsonl", ["66", "60", "2"]),                             # int64 answers
    ("hmmt26", "hmmt26.jsonl", ["\\frac{3}{8}", "2\\sqrt{2}", "12"]),          # string answers
    ("imo_answerbench", "imo_answerbench.csv", ["$2, 3$", "15", "$f(x)=x+c$"]),  # csv, multi-line cells
])
def test_release_fixtures_load(name, filename, references):
    bench = load_benchmark(name, path(filename))
    assert bench.num_skipped == 0
    assert [it.reference for it in bench.items] == references
    assert all(it.kind == "math" and it.prompt for it in bench.items)
    if name == "imo_answerbench":
        assert "x^2 - 5x + 6 = 0" in bench.items[0].prompt  # the quoted cell spans lines


def test_aime26_parquet_as_released(tmp_path):
    """MathArena publishes parquet (problem_idx int64, answer int64, problem string): same items."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in open(path("aime26.jsonl"))]
    table = pa.table({"problem_idx": pa.array([r["problem_idx"] for r in rows], pa.int64()),
                      "answer": pa.array([r["answer"] for r in rows], pa.int64()),
                      "problem": pa.array([r["problem"] for r in rows], pa.string())})
    pq.write_table(table, tmp_path / "train-00000.parquet")
    a = load_benchmark("aime_2026", str(tmp_path / "train-00000.parquet"))  # an alias of aime26
    assert a.items == load_benchmark("aime26", path("aime26.jsonl")).items


@pytest.mark.parametrize("name, filename, missing", [
    # columns match case-insensitively (AIME's "problem" is IMO-AnswerBench's "Problem")
    ("imo_answerbench", "aime26.jsonl", ["Problem ID", "Short Answer", "Category", "Subcategory", "Source"]),
    ("hmmt26", "aime26.jsonl", ["problem_type"]),
    ("aime26", "imo_answerbench.csv", ["problem_idx", "answer"]),
])
def test_wrong_schema_is_refused_naming_missing_columns(name, filename, missing):
    with pytest.raises(EvalInputError) as e:
        load_benchmark(name, path(filename))
    msg = str(e.value)
    assert f"missing column(s) {missing}" in msg and SCHEMAS[schema_for(name).name].source in msg


def test_schema_is_explicit_or_implied_by_name(tmp_path):
    # any name with schema=...: enforced; schema="auto": rows detected one by one (aime26.jsonl fits "math")
    with pytest.raises(EvalInputError, match=r"missing column\(s\) \['problem_type'\]"):
        load_benchmark("mine", path("aime26.jsonl"), schema="hmmt26")
    assert len(load_benchmark("hmmt26", path("aime26.jsonl"), schema="auto").items) == 3
    with pytest.raises(EvalInputError, match="unknown benchmark schema 'aime27'"):
        load_benchmark("x", path("aime26.jsonl"), schema="aime27")
    bad = tmp_path / "partial.jsonl"  # one row lacking a column is enough
    bad.write_text(json.dumps({"problem_idx": 1, "problem": "p", "answer": 1}) + "\n"
                   + json.dumps({"problem_idx": 2, "problem": "q"}) + "\n")
    with pytest.raises(EvalInputError, match=r"row 1 is missing column\(s\) \['answer'\]"):
        load_benchmark("aime26", str(bad))


def test_cli_refuses_wrong_schema_before_loading_a_model(tmp_path, capsys):
    from megatron_s3ac.eval.cli import main

    out = tmp_path / "r.json"
    rc = main(["--model", str(tmp_path / "no_model"), "--bench", f"imo_answerbench={path('hmmt26.jsonl')}",
               "--out", str(out)])
    assert rc == 2 and not out.exists()
    assert "missing column(s) ['Problem ID'" in capsys.readouterr().err
    rc = main(["--model", str(tmp_path / "no_model"), "--bench", f"x={path('aime26.jsonl')}",
               "--schema", "x=imo_answerbench", "--out", str(out)])
    assert rc == 2 and not out.exists()

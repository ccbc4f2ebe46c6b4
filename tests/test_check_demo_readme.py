"""tools/check_demo_readme.py: `.ci/run`'s check that the README's demo row is what `make demo` printed."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import check_demo_readme as C  # noqa: E402

README = """| run | greedy (T=0) | sampled (T=1, avg@4) |
|---|---|---|
| S3AC, fp32 (`make demo`) | 22.5% -> 45.5% | 19.8% -> 33.5% |
"""


def _run(tmp_path, greedy_after):
    (tmp_path / "README.md").write_text(README)
    d = tmp_path / "run"
    d.mkdir(exist_ok=True)
    (d / "demo_result.json").write_text(json.dumps({"before": {"greedy": 0.225, "sampled": 0.198},
                                                    "after": {"greedy": greedy_after, "sampled": 0.335}}))
    return ["--readme", str(tmp_path / "README.md"), str(d)]


def test_matching_run_passes_and_a_drift_is_named(tmp_path, capsys):
    assert C.main(_run(tmp_path, 0.46)) == 0  # 0.5 points off: within 1
    assert C.main(_run(tmp_path, 0.47)) == 1  # 1.5 points off
    assert "greedy after: README 45.5%, the run 47.0%" in capsys.readouterr().err


def test_missing_row_or_result_exits_2(tmp_path, capsys):
    args = _run(tmp_path, 0.455)
    assert C.main(args + ["--row", "GRPO-X"]) == 2
    assert "no table row whose first cell is 'GRPO-X'" in capsys.readouterr().err
    assert C.main(["--readme", str(tmp_path / "README.md"), str(tmp_path / "nowhere")]) == 2
    assert "demo_result.json: not a demo result" in capsys.readouterr().err


def test_the_repo_readme_has_the_row():
    figs = C.readme_figures(os.path.join(ROOT, "README.md"), C.ROW)
    assert set(figs) == {(k, w) for k in ("greedy", "sampled") for w in ("before", "after")}

"""tools/compare_evals.py: the paired before/after comparison of two s3ac-eval reports. The difference and the
interval against a hand-derived mean and the bootstrap called directly; a real report (evaluate with
keep_samples, the tiny model) compared with itself gives 0 [0, 0]; mismatched prompts and reports without samples
are refused (exit 2, no output file)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from eval_fixtures import arithmetic_rows
from megatron_s3ac.eval.estimators import bootstrap_ci
from megatron_s3ac.eval.runner import evaluate
from megatron_s3ac.rollout.base import SamplingParams

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
TOOL = os.path.join(ROOT, "tools", "compare_evals.py")


def _report(path, correct, name="heldout", prompts=None):
    samples = [{"prompt": (prompts or [f"p{i}" for i in range(len(correct))])[i], "reference": str(i),
                "responses": ["x"] * len(c), "correct": c} for i, c in enumerate(correct)]
    path.write_text(json.dumps({"benchmarks": {name: {"k": len(correct[0]), "samples": samples}}}))
    return str(path)


def _run(*args):
    return subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True, text=True)


def test_paired_difference_and_interval(tmp_path):
    rng = np.random.default_rng(3)
    a = rng.random((60, 4)) < 0.3
    b = a | (rng.random((60, 4)) < 0.3)  # B = A plus more correct samples: never worse on a prompt
    pa = _report(tmp_path / "a.json", a.tolist())
    pb = _report(tmp_path / "b.json", b.tolist())
    r = _run(pa, pb, "--json", tmp_path / "s.json")
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    d = b.mean(axis=1) - a.mean(axis=1)
    assert s["prompts"] == 60 and s["k_a"] == s["k_b"] == 4
    assert s["a"] == pytest.approx(a.mean()) and s["b"] == pytest.approx(b.mean())
    assert s["diff"] == pytest.approx(d.mean()) and s["diff_ci95"] == pytest.approx(list(bootstrap_ci(d, seed=0)))
    assert s["diff_ci95"][0] > 0 and s["verdict"] == "B higher" and s["prompts_a_better"] == 0
    assert "B higher" in r.stdout
    r = _run(pb, pa)  # the other way round
    assert r.returncode == 0 and "A higher" in r.stdout


def test_a_real_report_against_itself(tokenizer, engine, tmp_path):
    bench = tmp_path / "sums.jsonl"
    bench.write_text("".join(json.dumps({**r, "reward": "arithmetic"}) + "\n" for r in arithmetic_rows(12)))
    rep = evaluate(engine, tokenizer, {"sums": str(bench)}, k=2, params=SamplingParams(max_new_tokens=3), seed=0,
                   template="raw", keep_samples=True)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rep))
    r = _run(path, path, "--json", tmp_path / "s.json")
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["bench"] == "sums" and s["prompts"] == 12 and s["a"] == s["b"] == pytest.approx(rep["benchmarks"]["sums"]["avg_at_k"])
    assert s["diff"] == 0 and s["diff_ci95"] == [0, 0] and s["verdict"] == "no difference shown"


def test_refusals(tmp_path):
    pa = _report(tmp_path / "a.json", [[1], [0]])
    other = _report(tmp_path / "b.json", [[1], [0]], prompts=["p0", "q1"])
    r = _run(pa, other, "--json", tmp_path / "s.json")
    assert r.returncode == 2 and "prompt 1 differs" in r.stderr and not (tmp_path / "s.json").exists()
    (tmp_path / "n.json").write_text(json.dumps({"benchmarks": {"heldout": {"k": 1, "avg_at_k": 0.5}}}))
    r = _run(pa, tmp_path / "n.json")
    assert r.returncode == 2 and "--save-samples" in r.stderr
    r = _run(pa, pa, "--bench", "nope")
    assert r.returncode == 2 and "no benchmark 'nope'" in r.stderr

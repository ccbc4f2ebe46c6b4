"""reproduce_claims statistics, verdict rule and claims.json schema, on hand-computed numbers and on
synthetic run directories (no training: the driver reuses runs that hold demo_result.json)."""
import importlib.util
import json
import math
import os
import sys

import pytest

from megatron_s3ac.eval.claims import (arm_summary, combine, compare, mean_ci95, t_quantile, threshold,
                                       validate_claims)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _driver():
    spec = importlib.util.spec_from_file_location("reproduce_claims", os.path.join(REPO, "tools", "reproduce_claims.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["reproduce_claims"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("df,table", [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (29, 2.045), (10**6, 1.960)])
def test_t_quantile_matches_the_table(df, table):
    assert t_quantile(0.975, df) == pytest.approx(table, abs=1e-3)
    assert t_quantile(0.025, df) == pytest.approx(-table, abs=1e-3)


def test_mean_ci95_by_hand():
    mean, (lo, hi) = mean_ci95([1.0, 2.0, 3.0])  # s = 1, half = 4.3027 / sqrt(3)
    assert mean == 2.0 and hi - 2.0 == pytest.approx(4.302653 / math.sqrt(3)) and lo == pytest.approx(4 - hi)
    assert mean_ci95([5.0]) == (5.0, [None, None])
    assert mean_ci95([None, float("nan")]) == (None, [None, None])
    assert arm_summary([1.0, None, 3.0]) == {"values": [1.0, None, 3.0], "mean": 2.0,
                                             "ci95": [pytest.approx(2 - 12.7062 * math.sqrt(2) / math.sqrt(2), abs=1e-3),
                                                      pytest.approx(2 + 12.7062, abs=1e-3)]}


def test_paired_comparison_verdicts():
    # differences 0.1, 0.2, 0.3: mean 0.2, s 0.1, half 4.303 * 0.1 / sqrt 3 = 0.248 -> [-0.048, 0.448]: contains 0
    v, s = compare([0.6, 0.7, 0.8], [0.5, 0.5, 0.5], True)
    assert v == "inconclusive" and "mean 0.2" in s
    # differences 0.30, 0.31, 0.29: half 4.303 * 0.01 / sqrt 3 = 0.0248 -> above 0
    assert compare([0.80, 0.81, 0.79], [0.5, 0.5, 0.5], True)[0] == "reproduced"
    assert compare([0.5, 0.5, 0.5], [0.80, 0.81, 0.79], True)[0] == "not reproduced"
    # lower is better: the better arm has the smaller values
    assert compare([0.1, 0.12, 0.11], [0.9, 0.95, 0.97], False)[0] == "reproduced"
    assert compare([0.9, 0.95, 0.97], [0.1, 0.12, 0.11], False)[0] == "not reproduced"
    # a missing run drops its pair; one pair left is too few
    assert compare([0.8, None, None], [0.5, 0.5, 0.5], True)[0] == "inconclusive"
    assert compare([0.80, 0.81, None, 0.79], [0.5, 0.5, 0.1, 0.5], True)[0] == "reproduced"


def test_threshold_and_combine():
    assert threshold([0.9, 0.95, 0.92], 0.5, above=True)[0] == "reproduced"
    assert threshold([0.1, 0.15, 0.12], 0.5, above=True)[0] == "not reproduced"
    assert threshold([0.2, 0.9, 0.5], 0.5, above=True)[0] == "inconclusive"
    assert threshold([0.1, 0.15, 0.12], 0.5, above=False)[0] == "reproduced"
    assert combine(["reproduced", "reproduced"]) == "reproduced"
    assert combine(["reproduced", "inconclusive"]) == "inconclusive"
    assert combine(["inconclusive", "not reproduced"]) == "not reproduced"
    assert combine([]) == "inconclusive"


def _claim(**over):
    c = {"name": "x", "metric": "m", "arms": {"a": arm_summary([1.0, 2.0, 3.0])}, "verdict": "inconclusive", "rule": "r"}
    c.update(over)
    return c


def test_schema_validation():
    validate_claims([_claim()])
    for bad in ([_claim(extra=1)], [_claim(verdict="maybe")], [_claim(arms={})],
                [_claim(arms={"a": {"values": [1.0, 2.0], "mean": 9.0, "ci95": [None, None]}})],
                [_claim(arms={"a": {"values": [1.0], "mean": 1.0}})], {"not": "a list"}):
        with pytest.raises(ValueError):
            validate_claims(bad)


def _fake_run(out, arm, seed, result=None, metrics=(), vpt=()):
    d = os.path.join(out, "runs", arm, f"seed{seed}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "demo_result.json"), "w") as f:
        json.dump(result or {}, f)
    for name, rows in (("metrics.jsonl", metrics), ("value_pretrain.jsonl", vpt)):
        with open(os.path.join(d, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def test_driver_on_synthetic_runs(tmp_path, capsys):
    """Complete synthetic runs for three claims: the driver reuses them (no training), reads each
    metric from the right file, writes claims.json in the schema, verdicts by the rule, a report
    and plots; an arm needing a knob the trainer lacks is not run and its claim is inconclusive."""
    drv = _driver()
    out = str(tmp_path / "claims")
    clip = {"s3ac": [0.10, 0.12, 0.11], "value_pretrain_clip_1": [0.99, 0.97, 1.0]}
    score = {"s3ac": [0.30, 0.36, 0.33], "grpo_x": [0.31, 0.33, 0.35]}
    for seed_i, seed in enumerate((4, 5, 6)):
        for arm in ("s3ac", "value_pretrain_clip_1", "grpo_x"):
            res = {"vpt/clip_frac": clip.get(arm, [0.5] * 3)[seed_i],
                   "after": {"sampled": score.get(arm, [0.2] * 3)[seed_i]}}
            ev = [{"step": t, "critic/explained_variance": 0.1 * t + seed_i, "eval/average": 0.3} for t in range(5)]
            _fake_run(out, arm, seed, res, ev, [{"step": t, "vpt/grad_norm": 3.0} for t in range(3)])
    rc = drv.main(["--seeds", "4", "5", "6", "--out", out, "--claims", "critic_grad_clip", "s3ac_vs_grpo_x",
                   "value_head_init"])
    assert rc == 0
    claims = json.load(open(os.path.join(out, "claims.json")))
    validate_claims(claims)
    by = {c["name"]: c for c in claims}
    assert [c["name"] for c in claims] == ["value_head_init", "critic_grad_clip", "s3ac_vs_grpo_x"]
    assert by["critic_grad_clip"]["arms"]["s3ac"]["values"] == clip["s3ac"]
    assert by["critic_grad_clip"]["verdict"] == "reproduced"  # clip 10 clips far fewer steps
    # differences -0.01, 0.03, -0.02: the interval contains 0
    assert by["s3ac_vs_grpo_x"]["verdict"] == "inconclusive"
    assert by["s3ac_vs_grpo_x"]["arms"]["grpo_x"]["mean"] == pytest.approx(0.33)
    assert by["value_head_init"]["verdict"] == "inconclusive" and "not run" in by["value_head_init"]["rule"]
    assert by["value_head_init"]["arms"]["head_init_0.01"]["values"] == [None, None, None]
    report = open(os.path.join(out, "report.md")).read()
    assert "critic_grad_clip" in report and "**reproduced**" in report
    for c in claims:
        assert os.path.getsize(os.path.join(out, "plots", f"{c['name']}.png")) > 1000
    assert "critic_grad_clip" in capsys.readouterr().out


def test_metric_readers(tmp_path):
    drv = _driver()
    d = str(tmp_path)
    _fake_run(str(tmp_path), "a", 1, {"vpt/loss_first": 0.5, "after": {"sampled": 0.25}},
              [{"step": 2, "k": 3.0}, {"step": 0, "k": 1.0}, {"step": 1, "k": float("nan")}, {"step": 3, "k": 2.0}])
    run = os.path.join(d, "runs", "a", "seed1")
    assert drv.series(run, "k") == [1.0, 3.0, 2.0]  # step order, NaN dropped
    assert drv.first_mean("k", 2)(run) == 2.0
    assert drv.drop_from_peak("k")(run) == 1.0
    assert drv.mean_over_run("k")(run) == 2.0
    assert drv.result("after", "sampled")(run) == 0.25 and drv.result("nope")(run) is None
    assert drv.first_mean("missing", 3)(run) is None

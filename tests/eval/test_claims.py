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


def _plan(drv, out, claims=None, extra=()):
    args = drv.parse_args(["--out", out, "--seeds", "4", "5", "6", *extra] + (["--claims", *claims] if claims else []))
    chosen = [c for c in drv.claims(10) if claims is None or c.name in claims]
    return drv.plan(args, drv.CHAIN_FULL, chosen)


def _write(path, obj=None, rows=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        if rows is not None:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        else:
            json.dump(obj or {}, f)


def test_arms_share_stages_by_fingerprint(tmp_path):
    """Arms that change only RL settings share their seed's warm-up, coverage and value pretraining;
    an arm that changes a value-pretraining setting shares warm-up + coverage and has its own value
    pretraining; the on-policy arm has its own coverage; critic-free arms run the warm-up only; seeds
    share nothing; arms stop where their metric is (value pretraining / the first RL steps)."""
    drv = _driver()
    jobs, missing = _plan(drv, str(tmp_path))
    assert missing == {}
    by = {(j.arm, j.seed): j for j in jobs}
    assert [j.arm for j in jobs[:3]] == ["s3ac"] * 3  # producers of the shared stages first
    # then arm by arm, every seed of an arm together (a report cut short lacks whole arms)
    assert [j.seed for j in jobs] == [4, 5, 6] * (len(jobs) // 3)
    assert all(len({j.arm for j in jobs[i:i + 3]}) == 1 for i in range(0, len(jobs), 3))
    st = lambda a, s=4: dict(by[(a, s)].dirs.stages)
    base = st("s3ac")
    assert set(base) == {"warmup", "coverage", "value_pretrain"}
    for a in ("uniform_sampling", "fixed_lambda_0.95", "dapo_refill", "k1_s3ac"):
        assert st(a) == base, a
    for a in ("head_init_0.01", "head_init_paper_ratio", "value_pretrain_clip_1"):
        assert st(a)["warmup"] == base["warmup"] and st(a)["coverage"] == base["coverage"]
        assert st(a)["value_pretrain"] != base["value_pretrain"]
        assert "pipeline.stop_after=value_pretrain" in by[(a, 4)].overrides
    assert len({st(a)["value_pretrain"] for a in ("head_init_0.01", "head_init_paper_ratio", "value_pretrain_clip_1")}) == 3
    onp = st("on_policy_value_pretraining")
    assert onp["warmup"] == base["warmup"] and onp["coverage"] != base["coverage"]
    for a in ("grpo_x", "k1_reinforce_pp", "k1_flash_reinforce", "no_value_pretraining"):
        assert st(a) == {"warmup": base["warmup"]}, a
    assert st("s3ac", 5)["warmup"] != base["warmup"]
    assert f"train.steps={drv.CHAIN_FULL.first}" in by[("no_value_pretraining", 4)].overrides
    assert f"train.steps={drv.CHAIN_FULL.steps}" in by[("grpo_x", 4)].overrides
    k1 = by[("k1_s3ac", 4)].overrides
    assert "rollout.k=1" in k1 and f"rollout.prompts_per_step={drv.CHAIN_FULL.prompts_per_step * drv.CHAIN_FULL.k}" in k1
    # every job's command line names its stage dirs and its own out dir
    j = by[("head_init_0.01", 6)]
    assert f"pipeline.value_pretrain_dir={st('head_init_0.01', 6)['value_pretrain']}" in j.overrides
    assert j.dirs.out.endswith(os.path.join("runs", "head_init_0.01", "seed6"))


def _fake_outputs(drv, jobs, values):
    """values: arm -> per-seed dict of metric rows / stage results written where a pipeline would."""
    for j in jobs:
        v = values.get(j.arm, {}).get(j.seed)
        if v is None:
            continue
        for stage, d in j.dirs.stages:
            _write(os.path.join(d, "DONE.json"), {"stage": stage, "fingerprint": "x", "keys": {},
                                                  "result": v.get("vpt", {}) if stage == "value_pretrain" else {},
                                                  "wall_s": 1.0})
            if stage == "value_pretrain":
                _write(os.path.join(d, "value_pretrain.jsonl"), rows=v.get("vpt_rows", []))
        _write(os.path.join(j.dirs.out, "metrics.jsonl"), rows=v.get("metrics", []))
        _write(os.path.join(j.dirs.out, "pipeline.json"), {})
        _write(os.path.join(j.dirs.out, "claims_job.json"), {"overrides": j.overrides})


def test_driver_on_synthetic_runs(tmp_path, capsys):
    """Complete synthetic outputs for three claims: the driver reuses them (--reuse-only: it can never
    launch training here), reads each metric from the right file (a value-pretraining figure from the
    arm's own value-pretraining stage), writes claims.json in the schema, verdicts by the rule, a
    report and plots; a missing run leaves null values."""
    drv = _driver()
    out = str(tmp_path / "claims")
    names = ["critic_grad_clip", "s3ac_vs_grpo_x", "value_head_init"]
    jobs, _ = _plan(drv, out, names)
    clip = {"s3ac": [0.10, 0.12, 0.11], "value_pretrain_clip_1": [0.99, 0.97, 1.0]}
    score = {"s3ac": [0.30, 0.36, 0.33], "grpo_x": [0.31, 0.33, 0.35]}
    loss = {"s3ac": [0.40, 0.45, 0.42], "head_init_0.01": [0.7, 0.72, None], "value_pretrain_clip_1": [0.5] * 3}
    values = {}
    for i, seed in enumerate((4, 5, 6)):
        for arm in ("s3ac", "value_pretrain_clip_1", "grpo_x", "head_init_0.01"):
            if arm == "head_init_0.01" and seed == 6:
                continue  # that run is missing
            vpt = {"vpt/clip_frac": clip.get(arm, [0.5] * 3)[i], "vpt/loss_first": loss[arm][i] if arm in loss else None}
            metrics = [{"step": t, "critic/explained_variance": 0.1 * t} for t in range(5)]
            metrics[-1]["eval/average"] = score.get(arm, [0.2] * 3)[i]
            metrics[1]["eval/average"] = 0.9  # an earlier evaluation: the claim reads the last one
            values.setdefault(arm, {})[seed] = {"vpt": vpt, "metrics": metrics,
                                                "vpt_rows": [{"step": t, "vpt/value_loss": 1.0 - 0.1 * t} for t in range(4)]}
    _fake_outputs(drv, jobs, values)
    rc = drv.main(["--seeds", "4", "5", "6", "--out", out, "--claims", *names, "--reuse-only"])
    assert rc == 0
    claims = json.load(open(os.path.join(out, "claims.json")))
    validate_claims(claims)
    by = {c["name"]: c for c in claims}
    assert [c["name"] for c in claims] == ["value_head_init", "critic_grad_clip", "s3ac_vs_grpo_x"]
    assert by["critic_grad_clip"]["arms"]["s3ac"]["values"] == clip["s3ac"]
    assert by["critic_grad_clip"]["arms"]["value_pretrain_clip_1"]["values"] == clip["value_pretrain_clip_1"]
    assert by["critic_grad_clip"]["verdict"] == "reproduced"  # clip 10 clips far fewer steps
    # differences -0.01, 0.03, -0.02: the interval contains 0
    assert by["s3ac_vs_grpo_x"]["verdict"] == "inconclusive"
    assert by["s3ac_vs_grpo_x"]["arms"]["grpo_x"]["mean"] == pytest.approx(0.33)
    # seed 6 has no 0.01 run: 2 pairs, differences 0.30, 0.27 -> mean 0.285, s = 0.0212,
    # half-width 12.706 * 0.0212 / sqrt 2 = 0.19 -> [0.095, 0.475], above 0
    assert by["value_head_init"]["arms"]["head_init_0.01"]["values"] == [0.7, 0.72, None]
    assert by["value_head_init"]["verdict"] == "reproduced" and "over 2 paired seeds" in by["value_head_init"]["rule"]
    report = open(os.path.join(out, "report.md")).read()
    assert "critic_grad_clip" in report and "**reproduced**" in report and "head_init_0.01 seed 6 | failed" in report
    for c in claims:
        assert os.path.getsize(os.path.join(out, "plots", f"{c['name']}.png")) > 1000
    assert "critic_grad_clip" in capsys.readouterr().out
    jobs_rec = json.load(open(os.path.join(out, "jobs.json")))
    assert sum(j["status"] == "reused" for j in jobs_rec) == len(jobs) - 1


def test_a_run_dir_made_by_other_settings_is_refused(tmp_path, capsys):
    drv = _driver()
    out = str(tmp_path)
    jobs, _ = _plan(drv, out, ["s3ac_vs_grpo_x"])
    _write(os.path.join(jobs[0].dirs.out, "claims_job.json"), {"overrides": jobs[0].overrides[:-1] + ["train.steps=3"]})
    assert drv.main(["--seeds", "4", "5", "6", "--out", out, "--claims", "s3ac_vs_grpo_x", "--dry-run"]) == 2
    assert "run with other settings" in capsys.readouterr().err


def test_metric_readers(tmp_path):
    drv = _driver()
    run = drv.RunDirs(str(tmp_path / "out"), (("value_pretrain", str(tmp_path / "vpt")),))
    _write(os.path.join(run.out, "metrics.jsonl"),
           rows=[{"step": 2, "k": 3.0}, {"step": 0, "k": 1.0}, {"step": 1, "k": float("nan")}, {"step": 3, "k": 2.0}])
    _write(str(tmp_path / "vpt" / "DONE.json"), {"result": {"vpt/loss_first": 0.5, "flag": True}})
    _write(str(tmp_path / "vpt" / "value_pretrain.jsonl"), rows=[{"step": 0, "h": 0.9}, {"step": 1, "h": 0.7}])
    assert drv.series(run, "k") == [1.0, 3.0, 2.0]  # step order, NaN dropped
    assert drv.first_mean("k", 2)(run) == 2.0 and drv.last_mean("k", 2)(run) == 2.5
    assert drv.drop_from_peak("k")(run) == 1.0 and drv.last_value("k")(run) == 2.0
    assert drv.mean_over_run("k")(run) == 2.0
    assert drv.first_mean("h", 1, "value_pretrain.jsonl")(run) == 0.9
    assert drv.stage_result("value_pretrain", "vpt/loss_first")(run) == 0.5
    assert drv.stage_result("value_pretrain", "flag")(run) is None and drv.stage_result("coverage", "x")(run) is None
    assert drv.first_mean("missing", 3)(run) is None


FAKE_PIPELINE = r'''
import json, os, sys, time
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
stages = [(k[len("pipeline."):-len("_dir")], v) for k, v in args.items() if k.startswith("pipeline.") and k.endswith("_dir")]
fail = os.environ.get("FAKE_FAIL_STAGE")
if os.environ.get("FAKE_HANG"):
    open(os.environ["FAKE_HANG"], "w").write(str(os.getpid()))
    time.sleep(120)
for stage, d in stages:
    if os.path.exists(os.path.join(d, "DONE.json")):
        continue
    os.makedirs(d, exist_ok=True)
    try:  # two jobs producing one stage at once would be a scheduling bug
        os.close(os.open(os.path.join(d, "LOCK"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        sys.exit("CONFLICT " + d)
    time.sleep(0.3)
    if stage == fail and "seed4" in d:
        sys.exit("failing " + stage)
    json.dump({"stage": stage}, open(os.path.join(d, "DONE.json"), "w"))
    os.remove(os.path.join(d, "LOCK"))
out = args["train.out_dir"]
json.dump({}, open(os.path.join(out, "pipeline.json"), "w"))
'''


@pytest.mark.parametrize("fail_stage", [None, "warmup"])
def test_scheduler_never_runs_one_stage_twice_at_once(tmp_path, monkeypatch, fail_stage):
    """Two jobs at a time against a stand-in pipeline that exits on a concurrent producer of one stage:
    every job completes, dependents wait for the shared stages; when a seed's warm-up fails, the jobs
    that need it fail without running and the other seeds complete."""
    drv = _driver()
    jobs, _ = _plan(drv, str(tmp_path), ["value_pretraining_explained_variance", "critic_grad_clip", "s3ac_vs_grpo_x"])
    script = tmp_path / "fake_pipeline.py"
    script.write_text(FAKE_PIPELINE)
    monkeypatch.setattr(drv, "pipeline_cmd", lambda config, job, nproc: [sys.executable, str(script), *job.overrides])
    if fail_stage:
        monkeypatch.setenv("FAKE_FAIL_STAGE", fail_stage)
    drv.run_jobs("cfg.yaml", jobs, nproc=1, max_jobs=2, timeout_s=60)
    for j in jobs:
        log = open(os.path.join(j.dirs.out, "log.txt")).read() if os.path.exists(os.path.join(j.dirs.out, "log.txt")) else ""
        assert "CONFLICT" not in log
        if fail_stage and j.seed == 4:
            assert j.status == "failed"
            assert (j.arm == "s3ac") == ("failing" in log)  # only the producer ran
        else:
            assert j.status == "ok", (j.name, log)


def test_arm_the_trainer_cannot_run_is_reported_not_run():
    drv = _driver()
    c = next(c for c in drv.claims(10) if c.name == "value_head_init")
    e = drv.evaluate_claim(c, {"s3ac": [0.4, 0.5, 0.45], "head_init_0.01": [None] * 3},
                           {"head_init_0.01": "invalid config: Key 'value_head_init_std' not in 'ModelCfg'"})
    validate_claims([e])
    assert e["verdict"] == "inconclusive" and e["rule"].startswith("not run") and "value_head_init_std" in e["rule"]


def test_a_job_over_its_timeout_is_killed_and_failed(tmp_path, monkeypatch):
    drv = _driver()
    jobs, _ = _plan(drv, str(tmp_path), ["critic_grad_clip"])
    script = tmp_path / "fake_pipeline.py"
    script.write_text(FAKE_PIPELINE)
    monkeypatch.setattr(drv, "pipeline_cmd", lambda config, job, nproc: [sys.executable, str(script), *job.overrides])
    monkeypatch.setenv("FAKE_HANG", str(tmp_path / "pid"))
    job = jobs[0]
    drv.run_jobs("cfg.yaml", [job], nproc=1, max_jobs=1, timeout_s=2)
    assert job.status == "failed" and "exit -9" in job.note
    assert "killed after 2 s" in open(os.path.join(job.dirs.out, "log.txt")).read()
    pid = int(open(tmp_path / "pid").read())
    with pytest.raises(ProcessLookupError):  # the job's process is gone
        os.kill(pid, 0)


def test_default_task_is_the_chain_and_arithmetic_stays_selectable(tmp_path):
    """The default task is the digit chain at its own sizes (credit recorded, max_new_tokens covering the
    answer); --task arithmetic plans the earlier task at the earlier sizes, without the chain keys."""
    drv = _driver()
    args = drv.parse_args(["--out", str(tmp_path)])
    assert args.task == "chain" and args.seeds == [1, 2, 3]
    base = drv.base_overrides(args, drv.SIZES["chain"][0])
    for o in ("data.task=chain", "rollout.reward=chain", "data.chain=cumsum", "data.min_len=12", "data.max_len=12",
              "rollout.max_new_tokens=13", "train.credit_every=1"):
        assert o in base, o
    q = drv.parse_args(["--out", str(tmp_path), "--quick"])
    assert q.seeds == [1, 2, 3]
    ar = drv.parse_args(["--out", str(tmp_path), "--task", "arithmetic", "--quick"])
    assert ar.seeds == [1, 2]
    base_ar = drv.base_overrides(ar, drv.SIZES["arithmetic"][1])
    assert not any(o.startswith(("data.task=", "train.credit_every")) for o in base_ar)
    assert drv.SIZES["arithmetic"] == (drv.FULL, drv.QUICK)
    add = drv.parse_args(["--out", str(tmp_path), "--chain", "add", "--min-len", "8", "--max-len", "8"])
    assert "rollout.max_new_tokens=17" in drv.base_overrides(add, drv.CHAIN_FULL)


def test_credit_plot_from_the_runs(tmp_path):
    """The report's credit plot reads the S3AC and GRPO-X runs' credit.jsonl (seeds pooled) and adds the
    like-for-like split for the arm with a critic."""
    drv = _driver()
    row = {"step": 0, "k": 2, "pid": [1, 1, 2, 2], "reward": [1.0, -1.0, -1.0, -1.0],
           "adv": [[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0], [0.0, 0.0]]}
    dirs = {}
    for arm, v0 in (("s3ac", [0.3, 0.3, -0.2, -0.2]), ("grpo_x", None)):
        d = tmp_path / arm
        d.mkdir()
        (d / "credit.jsonl").write_text(json.dumps(dict(row, v0=v0)) + "\n")
        dirs[arm] = [drv.RunDirs(str(d))]
    panels = drv.credit_plot(dirs, str(tmp_path / "credit.png"))
    assert list(panels) == ["S3AC", "S3AC (split as GRPO-X)", "GRPO-X"]
    assert panels["S3AC"]["estimate"] == "V(s0)" and panels["GRPO-X"]["estimate"] == "group mean reward"
    assert panels["GRPO-X"]["mean"]["easy/correct"] == 1.0 and panels["GRPO-X"]["responses"]["hard/incorrect"] == 2
    assert (tmp_path / "credit.png").stat().st_size > 1000
    assert drv.credit_plot({}, str(tmp_path / "none.png")) is None

"""``s3ac-train pipeline`` (trainer.stages.pipeline): which keys each stage depends on, the DONE.json skip /
mismatch rule, the stage plan, the fresh-value-head warning (train banner, ``check``), and, under torchrun
(slow), a kill inside every stage followed by a re-run that completes with the uninterrupted run's results."""
import json
import os
import subprocess
import sys

import pytest

from megatron_s3ac.config import ConfigError, load_config
from megatron_s3ac.trainer.stages.pipeline import (
    STAGES, StageMismatch, fresh_critic_warning, pipeline_errors, planned_stages, read_done, stage_dirs,
    stage_fingerprint, stage_keys, stage_values, write_done,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "examples", "cpu_demo.yaml")
GRPO = os.path.join(ROOT, "examples", "cpu_demo_grpo.yaml")


def _cfg(*over, path=DEMO):
    return load_config(path, list(over))


# ---- keys and fingerprints -------------------------------------------------------------------------
def test_each_stage_depends_on_everything_upstream():
    keys = {s: set(stage_keys(s)) for s in STAGES}
    assert keys["warmup"] < keys["coverage"] < keys["value_pretrain"] < keys["rl"]
    # the warm-up trains the actor only: critic settings and the RL algorithm are not its inputs, so the
    # claims' arms (value-head init, critic clip, S3AC vs GRPO-X) share one warm-up
    for k in ("model.critic_init", "model.critic_head", "model.value_head_init_std", "algo.name",
              "algo.critic_clip_grad", "value_pretrain.lr", "rollout.k", "train.steps"):
        assert k not in keys["warmup"], k
    assert {"train.seed", "model.tiny", "data.num_prompts", "demo.warmup_lr"} <= keys["warmup"]
    # coverage: the RL response length, the policies, the engine
    assert {"rollout.max_new_tokens", "rollout.engine", "pipeline.policies", "demo.coverage_k"} <= keys["coverage"]
    assert {"value_pretrain.lr", "value_pretrain.epochs", "model.value_head_init_std",
            "model.critic_head"} <= keys["value_pretrain"]
    assert "algo.critic_clip_grad" not in keys["value_pretrain"]  # value pretraining clips at value_pretrain.clip_grad
    # where things are written is never an input
    for s in STAGES:
        assert not keys[s] & {"train.out_dir", "pipeline.warmup_dir", "pipeline.stop_after", "train.progress"}
    with pytest.raises(KeyError, match="unknown pipeline stage"):
        stage_keys("sft")


@pytest.mark.parametrize("override, changed_from", [
    ("train.seed=7", "warmup"), ("data.num_prompts=999", "warmup"), ("demo.coverage_k=3", "coverage"),
    ("rollout.max_new_tokens=5", "warmup"), ("value_pretrain.lr=0.01", "value_pretrain"),
    ("model.value_head_init_std=0.01", "value_pretrain"), ("algo.name=grpo_x", "rl"), ("train.steps=3", "rl"),
    ("train.out_dir=/elsewhere", None), ("pipeline.stop_after=coverage", None)])
def test_fingerprint_changes_exactly_from_the_first_dependent_stage(override, changed_from):
    base, other = _cfg(), _cfg(override)
    first = len(STAGES) if changed_from is None else STAGES.index(changed_from)
    for i, s in enumerate(STAGES):
        assert (stage_fingerprint(base, s) != stage_fingerprint(other, s)) == (i >= first), (override, s)


def test_done_json_skip_and_mismatch_naming_the_keys(tmp_path):
    cfg = _cfg()
    d = str(tmp_path / "vpt")
    os.makedirs(d)
    assert read_done(cfg, "value_pretrain", d) is None  # absent: the stage runs
    write_done(cfg, "value_pretrain", d, {"vpt/ev_last": 0.5}, 1.5)
    done = read_done(cfg, "value_pretrain", d)
    assert done["result"] == {"vpt/ev_last": 0.5} and done["fingerprint"] == stage_fingerprint(cfg, "value_pretrain")
    assert done["keys"] == stage_values(cfg, "value_pretrain") and done["keys"]["value_pretrain.lr"] == 1e-3
    # a key outside the stage: still the same stage output
    assert read_done(_cfg("algo.critic_clip_grad=1.0"), "value_pretrain", d) is not None
    with pytest.raises(StageMismatch) as e:
        read_done(_cfg("value_pretrain.lr=0.01", "train.seed=5"), "value_pretrain", d)
    msg = str(e.value)
    assert "value_pretrain.lr: 0.001 (recorded) vs 0.01 (now)" in msg and "train.seed: 1234 (recorded) vs 5" in msg
    assert f"delete {d}" in msg and "rollout.k" not in msg


def test_mismatched_stage_refused_before_any_work(tmp_path, capsys):
    from megatron_s3ac.trainer import cli

    cfg = _cfg(f"train.out_dir={tmp_path}")
    d = stage_dirs(cfg)["warmup"]
    os.makedirs(d)
    write_done(cfg, "warmup", d, {}, 0.0)
    assert pipeline_errors(cfg) == []
    assert cli.main(["pipeline", DEMO, f"train.out_dir={tmp_path}", "demo.warmup_lr=0.01"]) == 2
    err = capsys.readouterr().err
    assert "pipeline stage warmup" in err and "demo.warmup_lr: 0.003 (recorded) vs 0.01 (now)" in err
    assert sorted(os.listdir(tmp_path)) == ["stages"]  # nothing else written


def test_stage_dirs_default_and_shared(tmp_path):
    cfg = _cfg(f"train.out_dir={tmp_path}/run", f"pipeline.warmup_dir={tmp_path}/shared_warmup")
    d = stage_dirs(cfg)
    assert d == {"warmup": f"{tmp_path}/shared_warmup", "coverage": f"{tmp_path}/run/stages/coverage",
                 "value_pretrain": f"{tmp_path}/run/stages/value_pretrain", "rl": f"{tmp_path}/run"}


# ---- the plan ----------------------------------------------------------------------------------------
def test_planned_stages(tmp_path):
    assert set(planned_stages(_cfg()).values()) == {"run"}
    p = planned_stages(_cfg(path=GRPO))  # no critic: nothing to pretrain
    assert p["warmup"] == p["rl"] == "run" and p["coverage"] == p["value_pretrain"] == "no critic"
    assert planned_stages(_cfg("value_pretrain.enabled=false"))["coverage"] == "value_pretrain.enabled=false"
    cov = tmp_path / "cov.jsonl"
    cov.write_text("")
    p = planned_stages(_cfg(f"value_pretrain.coverage_path={cov}"))
    assert p["coverage"] == "value_pretrain.coverage_path given" and p["value_pretrain"] == "run"
    p = planned_stages(_cfg(f"model.critic_init={tmp_path}"))
    assert p["coverage"] == p["value_pretrain"] == "model.critic_init given"
    p = planned_stages(_cfg("pipeline.stop_after=coverage"))
    assert p["coverage"] == "run" and p["value_pretrain"] == p["rl"] == "pipeline.stop_after=coverage"


def test_pipeline_config_keys_validated(tmp_path):
    with pytest.raises(ConfigError, match=r"pipeline.policies\[0\]='/no/such' is not a directory"):
        _cfg("pipeline.policies=[/no/such]")
    with pytest.raises(ConfigError, match=r"pipeline.policies\[0\]=0 must be a warm-up step number >= 1"):
        _cfg("pipeline.policies=[0]")
    with pytest.raises(ConfigError, match="pipeline.coverage_k=0 must be >= 1"):
        _cfg("pipeline.coverage_k=0")
    with pytest.raises(ConfigError, match="pipeline.stop_after"):
        _cfg("pipeline.stop_after=sft")
    assert _cfg("pipeline.policies=[100, 200]").pipeline.policies == [100, 200]
    # a model without a warm-up has no snapshots to number, and no default policies for coverage
    hf = os.path.join(ROOT, "examples", "hf_configs", "qwen3_30b_a3b")
    with pytest.raises(ConfigError, match="step numbers name warm-up snapshots"):
        load_config(None, ["model.hf_config=" + hf, "data.task=math", f"data.path={DEMO}", "rollout.reward=math",
                           "pipeline.policies=[100]"])
    cfg = load_config(None, ["model.hf_config=" + hf, "data.task=math", f"data.path={DEMO}", "rollout.reward=math"])
    assert pipeline_errors(cfg) and "pipeline.policies: the coverage stage needs policies" in pipeline_errors(cfg)[0]


# ---- the fresh value head warning ----------------------------------------------------------------------
def test_fresh_value_head_warning(tmp_path):
    w = fresh_critic_warning(_cfg(), "train")
    assert w and "FRESH" in w and "s3ac-train pipeline" in w and "model.critic_init" in w
    assert fresh_critic_warning(_cfg(path=GRPO), "train") is None  # no critic
    assert fresh_critic_warning(_cfg(f"model.critic_init={tmp_path}"), "train") is None
    assert fresh_critic_warning(_cfg(), "pipeline") is None  # the pipeline pretrains it
    assert "value_pretrain.enabled=false" in fresh_critic_warning(_cfg("value_pretrain.enabled=false"), "pipeline")


def test_check_reports_the_fresh_head_and_strict_refuses(capsys):
    from megatron_s3ac.trainer import cli

    assert cli.main(["check", DEMO]) == 0
    assert "warning: algo.name=s3ac trains a critic" in capsys.readouterr().err
    assert cli.main(["check", DEMO, "--strict"]) == 2
    capsys.readouterr()
    assert cli.main(["check", DEMO, "--strict", "--for", "pipeline"]) == 0
    assert "FRESH" not in capsys.readouterr().err
    assert cli.main(["check", DEMO, "--strict", "--for", "pipeline", "value_pretrain.enabled=false"]) == 2
    assert cli.main(["check", GRPO, "--strict"]) == 0
    assert cli.main(["check", DEMO, "--for", "sft"]) == 2


def test_train_prints_the_banner_on_rank0_before_building(monkeypatch, capsys, tmp_path):
    from megatron_s3ac.trainer import cli
    from megatron_s3ac.trainer.step import trainer as loop

    class Stop(Exception):
        pass

    def no_trainer(cfg):
        raise Stop

    monkeypatch.setattr(loop, "Trainer", no_trainer)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(Stop):
        cli.main(["train", DEMO, f"train.out_dir={tmp_path}"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[0].startswith("!!!!") and lines[-1].startswith("!!!!") and len(lines) >= 5
    assert "s3ac-train pipeline" in err.replace("!! ", "").replace("\n", " ")
    monkeypatch.setenv("RANK", "1")  # other ranks stay quiet
    with pytest.raises(Stop):
        cli.main(["train", DEMO, f"train.out_dir={tmp_path}"])
    assert "!!!!" not in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(Stop):
        cli.main(["train", GRPO, f"train.out_dir={tmp_path}"])
    assert "!!!!" not in capsys.readouterr().err


PAPER = sorted(os.path.join(ROOT, "examples", d, f) for d in ("paper", "qwen3_5")
               for f in os.listdir(os.path.join(ROOT, "examples", d)) if f.endswith(".yaml"))


@pytest.mark.parametrize("path", PAPER, ids=os.path.basename)
def test_paper_examples_never_start_s3ac_from_a_fresh_head(path):
    """Every paper / Qwen3.5 example either runs the pipeline's value pretraining on several coverage
    policies or names a pretrained critic; GRPO-X runs with R3 on (paper §4.1)."""
    cfg = load_config(path, check=False)  # the model paths live on the cluster
    if cfg.algo.name == "grpo_x":
        assert cfg.train.r3 == "on"
    from megatron_s3ac.algorithms.registry import get_algo

    if get_algo(cfg.algo.name).uses_critic:
        assert cfg.model.critic_init or (planned_stages(cfg)["value_pretrain"] == "run"
                                         and len(cfg.pipeline.policies or []) >= 2)
        assert fresh_critic_warning(cfg, "pipeline") is None and fresh_critic_warning(cfg, "train") is not None
        assert "launch.sh train" in open(path).read() or "run.sh train" in open(path).read()


def test_stage_fault_seam():
    code = ("from megatron_s3ac import faults; faults.in_stage('warmup'); print('past warmup', flush=True); "
            "faults.after_step(0); print('past step 0', flush=True); faults.after_step(1); print('past 1')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("S3AC_TESTING")}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(env, S3AC_TESTING_FAIL_IN_STAGE="coverage"))
    assert r.returncode == 0 and "past 1" in r.stdout
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(env, S3AC_TESTING_FAIL_IN_STAGE="warmup"))
    assert r.returncode == 9 and "past warmup" not in r.stdout
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(env, S3AC_TESTING_FAIL_IN_STAGE="rl"))  # rl: after step 1
    assert r.returncode == 9 and "past step 0" in r.stdout and "past 1" not in r.stdout


# ---- a kill in every stage, then a re-run (torchrun, 2 gloo ranks) -----------------------------------
TINY = ["rollout.prompts_per_step=16", "rollout.k=4", "data.num_prompts=300", "data.eval_prompts=24",
        "demo.warmup_max_steps=20", "demo.warmup_eval_every=10", "demo.target_pass_rate=1.0",
        "demo.coverage_prompts=16", "demo.coverage_k=2", "demo.coverage_checkpoints=2", "value_pretrain.batch_size=16",
        "train.steps=2", "train.eval_every=1", "train.save_every=1", "eval.k=2", "eval.batch_size=16",
        "train.progress=false", "train.tensorboard=false"]


def _pipeline(out, fail_in=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("S3AC_TESTING")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if fail_in:
        env["S3AC_TESTING_FAIL_IN_STAGE"] = fail_in
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_s3ac.trainer.cli", "pipeline", DEMO, *TINY, f"train.out_dir={out}"]
    log = f"{out}.{fail_in or 'full'}.log"
    with open(log, "a") as f:  # a file, not a pipe: dist_checkpointing helpers can outlive a killed rank
        r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    return r.returncode, open(log).read()


def _done(d):
    p = os.path.join(d, "DONE.json")
    return json.load(open(p)) if os.path.exists(p) else None


@pytest.mark.slow
def test_kill_in_every_stage_then_rerun_completes_like_an_uninterrupted_run(tmp_path):
    ref, out = str(tmp_path / "ref"), str(tmp_path / "run")
    rc, log = _pipeline(ref)
    assert rc == 0, log[-3000:]
    dirs = {s: (os.path.join(out, "stages", s) if s != "rl" else out) for s in STAGES}
    for i, stage in enumerate(STAGES):  # each run dies in the next stage; the ones before are skipped
        rc, log = _pipeline(out, fail_in=stage)
        assert rc != 0, log[-2000:]
        assert _done(dirs[stage]) is None, stage  # killed before its DONE.json
        assert all(_done(dirs[s]) for s in STAGES[:i]), stage
        if i:  # the stage killed last time is redone from scratch, the ones done before it are skipped
            assert f"stage {STAGES[i - 1]} -> " in log and f"stage {STAGES[i - 1]} skipped" not in log
        if i > 1:
            assert f"stage {STAGES[i - 2]} skipped" in log
    assert os.path.exists(os.path.join(out, "checkpoints", "step_000001", "COMPLETE"))  # rl died after step 1
    rc, log = _pipeline(out)
    assert rc == 0, log[-3000:]
    assert "resumed from" in log and "step_000001" in log  # rl resumed from its checkpoint, not from scratch
    st = json.load(open(os.path.join(out, "pipeline.json")))["stages"]
    assert {s: v["status"] for s, v in st.items()} == {"warmup": "skipped", "coverage": "skipped",
                                                      "value_pretrain": "skipped", "rl": "ran"}
    # every stage output equals the uninterrupted run's (redone from scratch after a kill: same numbers)
    for s in ("warmup", "coverage", "value_pretrain"):
        a, b = _done(os.path.join(ref, "stages", s)), _done(dirs[s])
        assert a["fingerprint"] == b["fingerprint"]
        ra, rb = ({k: v for k, v in d["result"].items() if "wall_s" not in k} for d in (a, b))
        if s == "coverage":
            for p in ra["policies"] + rb["policies"]:
                p.pop("wall_s"), p.pop("source")
        assert ra == rb, s
    assert open(os.path.join(ref, "stages", "coverage", "coverage.jsonl")).read().replace(ref, "X") == \
        open(os.path.join(out, "stages", "coverage", "coverage.jsonl")).read().replace(out, "X")

    def metrics(d):
        rows = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]

    assert metrics(ref) == metrics(out)
    assert _done(ref)["result"] == _done(out)["result"]
    # tools/build_coverage_data.py on the same config and snapshots writes the coverage stage's file
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import build_coverage_data
    import torch

    torch.set_num_threads(1)  # as the pipeline's ranks (train.threads=1): the same float reductions
    snaps = [os.path.join(ref, "stages", "warmup", "policies", f"step_{n}") for n in (10, 20)]
    tool_out = str(tmp_path / "tool_cov.jsonl")
    assert build_coverage_data.main(["--config", DEMO, "--checkpoints", *snaps, "--out", tool_out, *TINY,
                                     f"train.out_dir={ref}"]) == 0
    assert open(tool_out).read() == open(os.path.join(ref, "stages", "coverage", "coverage.jsonl")).read()

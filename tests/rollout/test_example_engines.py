"""The GPU example configs roll out with SGLang: their rollout.sglang sections pass the factory's validation against
their own cluster, and `s3ac-train check` accepts each file once its paths (models, data, checkpoints, eval sets:
absent on this machine) point at stand-ins. The HF directory stand-in is the example's real config.json (the
architecture sglang would serve) + a safetensors file + a tokenizer file."""
import os
import shutil

import pytest
import yaml

from megatron_s3ac.rollout.factory import SGLangSettings, validate_rollout_engine, validate_sglang_settings

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
EXAMPLES = [
    ("examples/paper/qwen25_math_1p5b_k1.yaml", "qwen2_5_math_1_5b"),
    ("examples/paper/qwen25_math_1p5b_k16.yaml", "qwen2_5_math_1_5b"),
    ("examples/paper/r1_distill_1p5b_math1460.yaml", "r1_distill_qwen_1_5b"),
    ("examples/paper/qwen3_30b_a3b_ep.yaml", "qwen3_30b_a3b"),
    ("examples/qwen3_5/qwen3_5_35b_a3b.yaml", "qwen3_5_35b_a3b"),
    pytest.param("examples/qwen3_5/qwen3_5_397b_layout.yaml", "qwen3_5_397b_a17b", marks=pytest.mark.slow),
]


def _load(path):
    with open(os.path.join(ROOT, path)) as f:
        return yaml.safe_load(f)


def _hf_stand_in(tmp_path, hf):
    d = tmp_path / hf
    d.mkdir()
    shutil.copy(os.path.join(ROOT, "examples", "hf_configs", hf, "config.json"), d / "config.json")
    (d / "model.safetensors").write_bytes(b"")  # validation looks for weights, it does not read them
    (d / "tokenizer.json").write_text("{}")
    return str(d)


@pytest.mark.parametrize("path,hf", EXAMPLES)
def test_example_rollout_section_is_sglang_and_consistent(path, hf, tmp_path):
    cfg = _load(path)
    r, cl = cfg["rollout"], cfg["cluster"]
    assert r["engine"] == "sglang" and r["placement"] == "colocated"
    s = SGLangSettings.from_dict(r["sglang"])
    validate_sglang_settings(s, cluster_gpus=cl["gpus"], trainer_gpus=cl["gpus"], placement="colocated")
    # colocated engines cover the trainer's GPUs one-to-one (no idle GPU during rollout)
    assert s.num_engines * s.gpus_per_engine == cl["gpus"]
    validate_rollout_engine("sglang", model_dir=_hf_stand_in(tmp_path, hf))  # the architecture is servable


@pytest.mark.parametrize("path,hf", EXAMPLES)
def test_s3ac_train_check_accepts_example(path, hf, tmp_path, monkeypatch, capsys):
    from megatron_s3ac.trainer.cli import main

    cfg = _load(path)
    model_dir = _hf_stand_in(tmp_path, hf)
    cfg["model"].update(hf_config=model_dir, engine_hf_dir=model_dir, actor_init=None)
    cfg["data"]["path"] = os.path.join(ROOT, "examples", "benchmarks", "math500.jsonl")
    if "eval" in cfg:
        cfg["eval"]["benchmarks"] = {"math500": cfg["data"]["path"]}
        cfg["eval"].pop("k_for", None)
        cfg["eval"].pop("judge", None)  # it names the file's own sets (checked in tests/eval/test_example_eval_sections.py)
    if cfg.get("pipeline", {}).get("policies"):  # coverage policies: HF dirs the check looks for
        cfg["pipeline"]["policies"] = [model_dir] * len(cfg["pipeline"]["policies"])
    if cfg.get("value_pretrain", {}).get("coverage_path"):
        cfg["value_pretrain"]["coverage_path"] = None
    out = tmp_path / "cfg.yaml"
    out.write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("WORLD_SIZE", str(cfg["cluster"]["gpus"]))
    assert main(["check", str(out)]) == 0, capsys.readouterr().err
    assert cfg["rollout"] == _load(path)["rollout"]  # the rollout section checked is the file's own

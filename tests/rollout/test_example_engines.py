"""The GPU example configs roll out with SGLang: their rollout.sglang sections pass the factory's validation against
their own cluster, and `s3ac-train check` accepts each file once its paths (models, data, checkpoints, eval sets:
absent on this machine) point at stand-ins. The HF directory stand-in is the example's real config.json (the
architecture sglang would serve) + a safetensors file + a tokenizer file."""
import os

import pytest
import yaml

from tests._examples import EXAMPLES, hf_stand_in, stand_in_policies
from megatron_s3ac.rollout.factory import SGLangSettings, validate_rollout_engine, validate_sglang_settings

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _load(path):
    with open(os.path.join(ROOT, path)) as f:
        return yaml.safe_load(f)



@pytest.mark.parametrize("path,hf", EXAMPLES)
def test_example_rollout_section_is_sglang_and_consistent(path, hf, tmp_path):
    cfg = _load(path)
    r, cl = cfg["rollout"], cfg["cluster"]
    assert r["engine"] == "sglang" and r["placement"] == "colocated"
    s = SGLangSettings.from_dict(r["sglang"])
    validate_sglang_settings(s, cluster_gpus=cl["gpus"], trainer_gpus=cl["gpus"], placement="colocated")
    # colocated engines cover the trainer's GPUs one-to-one (no idle GPU during rollout)
    assert s.num_engines * s.gpus_per_engine == cl["gpus"]
    validate_rollout_engine("sglang", model_dir=hf_stand_in(tmp_path, hf))  # the architecture is servable


@pytest.mark.parametrize("path,hf", EXAMPLES)
def test_s3ac_train_check_accepts_example(path, hf, tmp_path, monkeypatch, capsys):
    from megatron_s3ac.trainer.cli import main

    cfg = _load(path)
    model_dir = hf_stand_in(tmp_path, hf)
    cfg["model"].update(hf_config=model_dir, engine_hf_dir=model_dir, actor_init=None)
    cfg["data"]["path"] = os.path.join(ROOT, "examples", "benchmarks", "math500.jsonl")
    if "eval" in cfg:
        cfg["eval"]["benchmarks"] = {"math500": cfg["data"]["path"]}
        cfg["eval"].pop("k_for", None)
        cfg["eval"].pop("judge", None)  # it names the file's own sets (checked in tests/eval/test_example_eval_sections.py)
    stand_in_policies(cfg, model_dir)
    if cfg.get("value_pretrain", {}).get("coverage_path"):
        cfg["value_pretrain"]["coverage_path"] = None
    out = tmp_path / "cfg.yaml"
    out.write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("WORLD_SIZE", str(cfg["cluster"]["gpus"]))
    assert main(["check", str(out)]) == 0, capsys.readouterr().err
    assert cfg["rollout"] == _load(path)["rollout"]  # the rollout section checked is the file's own

"""``s3ac-train`` checks the GPU stack (megatron_s3ac.env) before a GPU job starts, and not on CPU."""
import os

import pytest
import torch

from megatron_s3ac import env as s3ac_env
from megatron_s3ac.trainer import cli as train_cli
from megatron_s3ac.trainer.stages import demo as demo_mod

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DEMO = os.path.join(ROOT, "examples", "cpu_demo.yaml")


_real_check = s3ac_env.check_environment


def _bad_stack(require_gpu, **kw):
    """The real rules on a faked stack: sglang 0.5.23 pins torch==2.14.1, torch 2.9.0 is installed."""
    assert require_gpu is True
    return _real_check(
        require_gpu=True, versions={"torch": "2.9.0", "sglang": "0.5.23", "megatron-core": "0.19.2"},
        requires={"sglang": ["torch==2.14.1"]},
        runtime={"cuda_available": True, "device_count": 1, "nccl_available": True, "torch_cuda": "13.0"})


@pytest.fixture
def no_demo(monkeypatch):
    ran = []
    monkeypatch.setattr(demo_mod, "run_demo", lambda cfg: ran.append(cfg))
    return ran


def test_gpu_job_refused_naming_both_versions(monkeypatch, capsys, tmp_path, no_demo):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(s3ac_env, "check_environment", _bad_stack)
    assert train_cli.main(["demo", DEMO, f"train.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("s3ac-train: environment check failed") and "2.9.0" in err and "2.14.1" in err
    assert not no_demo and not os.listdir(tmp_path)  # nothing started, nothing written


def test_gpu_job_prints_the_report_and_runs(monkeypatch, capsys, tmp_path, no_demo):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("RANK", raising=False)
    good = {"torch": "2.14.1", "sglang": "0.5.23", "megatron-core": "0.19.2"}
    monkeypatch.setattr(s3ac_env, "check_environment", lambda require_gpu, real=s3ac_env.check_environment: real(
        require_gpu=require_gpu, versions=good, requires={"sglang": ["torch==2.14.1"]},
        runtime={"cuda_available": True, "device_count": 1, "nccl_available": True, "torch_cuda": "13.0"}))
    assert train_cli.main(["demo", DEMO, f"train.out_dir={tmp_path}"]) == 0
    assert len(no_demo) == 1 and "torch CUDA build: 13.0" in capsys.readouterr().out


def test_not_called_on_cpu(monkeypatch, tmp_path, no_demo):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def boom(*a, **k):
        raise AssertionError("check_environment called on a CPU machine")

    monkeypatch.setattr(s3ac_env, "check_environment", boom)
    assert train_cli.main(["demo", DEMO, f"train.out_dir={tmp_path}"]) == 0
    assert len(no_demo) == 1


@pytest.mark.parametrize("cmd", ["train", "value-pretrain", "pipeline", "demo", "check"])
@pytest.mark.parametrize("flag", [["--help"], ["-h"], [DEMO, "--help"]])
def test_subcommand_help_prints_its_usage(cmd, flag, capsys, no_demo):
    assert train_cli.main([cmd] + flag) == 0
    out = capsys.readouterr()
    assert out.out.startswith(f"usage: s3ac-train {cmd} CONFIG.yaml") and "not found" not in out.out + out.err
    assert not no_demo  # nothing ran

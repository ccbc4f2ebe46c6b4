"""Optional Weights & Biases sink: refused at config time when wandb is missing; when installed, an
offline run logs every row and a resumed run continues the same W&B run id."""
import importlib.util
import os

import pytest

from megatron_s3ac.config import ConfigError, load_config
from tests.trainer.test_trainer import SMALL

HAVE_WANDB = importlib.util.find_spec("wandb") is not None


@pytest.mark.skipif(HAVE_WANDB, reason="wandb is installed")
def test_wandb_project_without_wandb_is_a_config_error():
    with pytest.raises(ConfigError, match="wandb is not installed"):
        load_config(None, SMALL + ["train.wandb_project=s3ac"])


@pytest.mark.skipif(not HAVE_WANDB, reason="optional extra: pip install 'megatron_s3ac[wandb]'")
def test_wandb_offline_run_logs_and_resumes(tmp_path, monkeypatch):
    from megatron_s3ac.trainer.run.logging import MetricsLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    ids = []
    for steps in ([0, 1], [2]):  # a first run, then its resume
        log = MetricsLogger(str(tmp_path), 3, tensorboard=False, progress=False, wandb_project="s3ac",
                            run_config={"algo": {"name": "s3ac"}})
        for s in steps:
            log.log({"step": s, "rollout/pass_rate": 0.1 * s})
        ids.append(log.wandb.id)
        log.close()
    assert ids[0] == ids[1] == open(tmp_path / "wandb_run_id").read()
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert runs and all(d.endswith(ids[0]) for d in runs)

"""The launch script starts/joins Ray on every node before torchrun and stops it at exit (also on failure),
run with `ray` and `torchrun` replaced by stubs that log their arguments."""
import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $* RAY_ADDRESS=${RAY_ADDRESS:-}" >> "$LOG"
[ "$(basename "$0")" = torchrun ] && exit "${TORCHRUN_RC:-0}"
exit 0
"""


def run(tmp_path, node_rank, rc=0, args=("cfg.yaml", "train.steps=3"), script="examples/paper/launch.sh", **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("ray", "torchrun", "nvidia-smi"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(stat.S_IRWXU)
    log = tmp_path / f"log{node_rank}"
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RAY_"))}
    full.update(PATH=f"{bin_dir}:{os.environ['PATH']}", LOG=str(log), NNODES="2", NODE_RANK=str(node_rank),
                MASTER_ADDR="10.0.0.1", GPUS_PER_NODE="8", TORCHRUN_RC=str(rc), **env)
    res = subprocess.run(["bash", str(ROOT / script), *args], env=full, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    return res.returncode, log.read_text().splitlines()


def test_head_node_starts_ray_then_torchrun_then_stops(tmp_path):
    rc, lines = run(tmp_path, 0)
    assert rc == 0
    assert lines[0].startswith("ray start --head --port 6379 --num-gpus 8")
    assert lines[1].startswith("torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8")
    # the default subcommand is the paper's recipe (coverage -> value pretraining -> RL), not a bare train
    assert "-m megatron_s3ac.trainer.cli pipeline cfg.yaml train.steps=3 RAY_ADDRESS=10.0.0.1:6379" in lines[1]
    assert lines[-1].startswith("ray stop --force")


def test_other_nodes_join_and_stop_even_when_training_fails(tmp_path):
    rc, lines = run(tmp_path, 1, rc=3)
    assert rc == 3
    assert lines[0].startswith("ray start --address 10.0.0.1:6379")
    assert lines[1].startswith("torchrun") and lines[-1].startswith("ray stop --force")


def test_existing_cluster_is_used_not_started(tmp_path):
    rc, lines = run(tmp_path, 0, RAY_ADDRESS="10.9.9.9:6379")
    assert rc == 0 and len(lines) == 1 and lines[0].startswith("torchrun") and "RAY_ADDRESS=10.9.9.9:6379" in lines[0]


@pytest.mark.parametrize("cmd", ["train", "pipeline", "value-pretrain"])
def test_subcommand_is_passed_through(tmp_path, cmd):
    rc, lines = run(tmp_path, 0, args=(cmd, "cfg.yaml", "train.steps=3"), RAY_ADDRESS="10.9.9.9:6379")
    assert rc == 0 and f"-m megatron_s3ac.trainer.cli {cmd} cfg.yaml train.steps=3 " in lines[0]


def test_qwen3_5_run_script_takes_the_subcommand(tmp_path):
    (tmp_path / "cfg.yaml").write_text("model: {hf_config: /m/hf, actor_init: /m/mcore}\n")
    for args, cmd in ((("cfg.yaml",), "pipeline"), (("train", "cfg.yaml"), "train")):
        rc, lines = run(tmp_path, 0, args=args, script="examples/qwen3_5/run.sh", SKIP_CONVERT="1",
                        RAY_ADDRESS="10.9.9.9:6379")
        assert rc == 0 and f"-m megatron_s3ac.trainer.cli {cmd} cfg.yaml RAY_ADDRESS" in lines[-1]

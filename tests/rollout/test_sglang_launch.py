"""The launch script starts/joins Ray on every node before torchrun and stops it at exit (also on failure),
run with `ray` and `torchrun` replaced by stubs that log their arguments."""
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $* RAY_ADDRESS=${RAY_ADDRESS:-} RAY_AUTH_MODE=${RAY_AUTH_MODE:-}" >> "$LOG"
[ "$(basename "$0")" = torchrun ] && exit "${TORCHRUN_RC:-0}"
exit 0
"""


def run(tmp_path, node_rank, rc=0, args=("cfg.yaml", "train.steps=3"), script="examples/paper/launch.sh", **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("ray", "torchrun", "nvidia-smi"):
        if not (bin_dir / name).exists():  # a test may bring its own nvidia-smi
            (bin_dir / name).write_text(STUB)
            (bin_dir / name).chmod(stat.S_IRWXU)
    log = tmp_path / f"log{node_rank}"
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RAY_"))}
    full.update(PATH=f"{bin_dir}:{os.environ['PATH']}", LOG=str(log), NNODES="2", NODE_RANK=str(node_rank),
                MASTER_ADDR="10.0.0.1", GPUS_PER_NODE="8", TORCHRUN_RC=str(rc))
    full.update(env)
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


# -- sbatch: $0 is Slurm's spool copy (/var/spool/slurmd/job<id>/slurm_script), present on the first node only ----
SRUN = """#!/usr/bin/env bash
# records its argv, then plays "another node": Slurm's spool copy is not there, SLURM_NODEID=1
printf '%s\\n' "srun $*" >> "$LOG"
printf '%s\\0' "$@" > "$SRUN_ARGV"
rm -rf "$SPOOL"
shift 2  # --ntasks-per-node 1
SLURM_NODEID=1 exec "$@"
"""


def sbatch(tmp_path, script="examples/paper/launch.sh", args=("cfg.yaml", "train.steps=3"), submit_dir=ROOT, **env):
    """Run a copy of `script` from a temp spool dir as sbatch does (cwd = the submit dir's stand-in)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("ray", STUB), ("torchrun", STUB), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    spool = tmp_path / "spool" / "job77"
    spool.mkdir(parents=True, exist_ok=True)
    (spool / "slurm_script").write_text((ROOT / script).read_text())
    (spool / "slurm_script").chmod(stat.S_IRWXU)
    log, argv = tmp_path / "log", tmp_path / "srun_argv"
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RAY_", "S3AC_"))}
    full.update(PATH=f"{bin_dir}:{os.environ['PATH']}", LOG=str(log), SRUN_ARGV=str(argv), SPOOL=str(spool),
                SLURM_JOB_ID="77", SLURM_NNODES="2", SLURM_NODEID="0", SLURM_SUBMIT_DIR=str(submit_dir),
                MASTER_ADDR="10.0.0.1", GPUS_PER_NODE="8", **env)
    res = subprocess.run(["bash", str(spool / "slurm_script"), *args], env=full, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    lines = log.read_text().splitlines() if log.exists() else []
    srun_argv = argv.read_bytes().decode().split("\0")[:-1] if argv.exists() else None
    return res, lines, srun_argv


def test_sbatch_reexecs_the_repository_copy_on_every_node(tmp_path):
    res, lines, argv = sbatch(tmp_path)
    assert res.returncode == 0, res.stderr
    # srun runs the checkout's launch.sh (found through SLURM_SUBMIT_DIR), never the spool copy
    assert argv[:3] == ["--ntasks-per-node", "1", "bash"] and str(ROOT / "examples/paper/launch.sh") in argv
    assert not any("spool" in a for a in argv)
    assert argv[-3:] == ["pipeline", "cfg.yaml", "train.steps=3"]
    # ... and on the other node (no spool copy there) it joins Ray and runs torchrun as node 1 of SLURM_NNODES=2
    assert lines[1].startswith("ray start --address 10.0.0.1:6379")
    assert lines[2].startswith("torchrun --nnodes 2 --node-rank 1 --nproc-per-node 8")
    assert lines[-1].startswith("ray stop --force")


def test_sbatch_without_a_checkout_in_the_submit_dir_says_set_s3ac_root(tmp_path):
    res, lines, argv = sbatch(tmp_path, submit_dir=tmp_path)
    assert res.returncode == 2 and argv is None and lines == []
    assert "S3AC_ROOT" in res.stderr and "examples/paper/launch.sh" in res.stderr
    # S3AC_ROOT wins over the submit directory
    res, lines, argv = sbatch(tmp_path, submit_dir=tmp_path, S3AC_ROOT=str(ROOT))
    assert res.returncode == 0, res.stderr
    assert str(ROOT / "examples/paper/launch.sh") in argv and lines[2].startswith("torchrun --nnodes 2 --node-rank 1")


def test_sbatch_qwen3_5_run_script_finds_launch_sh(tmp_path):
    (tmp_path / "cfg.yaml").write_text("model: {hf_config: /m/hf, actor_init: /m/mcore}\n")
    res, lines, argv = sbatch(tmp_path, script="examples/qwen3_5/run.sh", args=("train", "cfg.yaml"), SKIP_CONVERT="1")
    assert res.returncode == 0, res.stderr
    assert str(ROOT / "examples/paper/launch.sh") in argv and argv[-2:] == ["train", "cfg.yaml"]
    assert "-m megatron_s3ac.trainer.cli train cfg.yaml RAY_ADDRESS=10.0.0.1:6379" in lines[2]


@pytest.mark.parametrize("smi", ["missing", "lists no GPU"])
def test_no_nvidia_smi_and_no_gpus_per_node_is_a_clear_error(tmp_path, smi):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi == "lists no GPU" or shutil.which("nvidia-smi"):  # shadow a real one
        (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
        (bin_dir / "nvidia-smi").chmod(stat.S_IRWXU)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RAY_", "GPUS_PER_NODE"))}
    env["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    res = subprocess.run(["bash", str(ROOT / "examples/paper/launch.sh"), "cfg.yaml"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "GPUS_PER_NODE" in res.stderr and "nvidia-smi" in res.stderr


def test_gpus_per_node_defaults_to_nvidia_smi_count(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\nprintf 'GPU 0: H200 (UUID: a)\\nGPU 1: H200 (UUID: b)\\n'\n")
    (bin_dir / "nvidia-smi").chmod(stat.S_IRWXU)
    rc, lines = run(tmp_path, 0, RAY_ADDRESS="10.9.9.9:6379", GPUS_PER_NODE="")
    assert rc == 0 and "--nproc-per-node 2 " in lines[0]


@pytest.mark.parametrize("token", [True, False])
def test_ray_auth_mode_is_decided_once_for_every_node_and_the_trainer(tmp_path, token):
    """Ray 2.60's `ray start` enables token auth when ~/.ray/auth_token exists, a driver given RAY_ADDRESS never
    does: the script exports one RAY_AUTH_MODE to `ray start` and to torchrun (the trainer's ray.init)."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    if token:
        (home / ".ray" / "auth_token").write_text("0123456789abcdef")
    for rank in (0, 1):
        rc, lines = run(tmp_path, rank, HOME=str(home), RAY_AUTH_MODE="")
        mode = "token" if token else "disabled"
        assert rc == 0 and lines[0].startswith("ray start") and lines[1].startswith("torchrun")
        assert all(line.endswith(f"RAY_AUTH_MODE={mode}") for line in lines[:2]), lines
    (tmp_path / "own").mkdir()
    rc, lines = run(tmp_path / "own", 0, HOME=str(home), RAY_AUTH_MODE="disabled")  # the user's choice is kept
    assert lines[0].endswith("RAY_AUTH_MODE=disabled") and lines[1].endswith("RAY_AUTH_MODE=disabled")

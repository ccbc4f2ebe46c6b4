"""Fifth GPU-path review, finding 3: under Slurm, launch.sh counted the node's GPUs, not the ones its task sees.

examples/paper/launch.sh sized everything from ``GPUS_PER_NODE``, counted by ``nvidia-smi -L`` when not given.
nvidia-smi is NVML's tool and ignores ``CUDA_VISIBLE_DEVICES``; CUDA (torch, Ray's workers, vLLM) honours it. Slurm
sets ``CUDA_VISIBLE_DEVICES`` for each task of a step from the task's GPU allocation; the script's own
``srun --ntasks-per-node 1`` step inherits the batch's ``SLURM_GPUS_PER_TASK`` / ``SLURM_GPU_BIND`` (an
``sbatch --ntasks-per-node=8 --gpus-per-task=1`` job gives each node's one task one GPU), and under sbatch the batch
step counts once and every node's task inherits that ``GPUS_PER_NODE`` (launch.sh exports it before the srun).
Without device cgroups nvidia-smi still lists all 8, so the script ran ``torchrun --nproc-per-node 8`` with one
visible device (ranks 1..7: ``cuda:LOCAL_RANK`` does not exist) and ``ray start --num-gpus 8`` under a
``CUDA_VISIBLE_DEVICES`` of fewer (Ray 2.x refuses: ray/_private/resource_and_label_spec.py
``_resolve_accelerator_resources``, "Attempting to start raylet with 8 GPU, but CUDA_VISIBLE_DEVICES contains
[...]"), or, with ``TRAINER_GPUS_PER_NODE`` < 8, Ray got an empty device list.

Fixed: with ``CUDA_VISIBLE_DEVICES`` set, the node's GPUs are its entries (``GPUS_PER_NODE`` defaults to their
count; a different ``GPUS_PER_NODE``, e.g. the batch step's, exits 2 naming both and the Slurm options that narrow
the view). Run on launch.sh itself with ``nvidia-smi`` / ``ray`` / ``torchrun`` stubbed, as in
test_review4_finding_3 (no Slurm here: the environment is what Slurm gives the task).
"""
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STUBS = {
    # eight GPUs on the node, whatever CUDA_VISIBLE_DEVICES says (NVML enumerates the node's devices)
    "nvidia-smi": 'for i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; done\n',
    "ray": 'echo "ray $* CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}" >> "$S3AC_TEST_LOG"\n',
    "torchrun": 'echo "torchrun $* CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}" >> "$S3AC_TEST_LOG"\n',
}


def _launch(tmp_path, **env_extra):
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        (d / name).write_text("#!/usr/bin/env bash\n" + body)
        (d / name).chmod(0o755)
    log = tmp_path / "launch.log"
    if log.exists():
        log.unlink()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM", "RAY_", "CUDA_VISIBLE", "GLOO_", "GPUS_PER", "TRAINER_GPUS", "NNODES"))}
    # the task srun started on one node (launch.sh's inner branch: SLURM_PROCID_SET from its outer one)
    env.update(PATH=f"{d}:{os.environ['PATH']}", S3AC_TEST_LOG=str(log), SLURM_JOB_ID="4242", SLURM_PROCID_SET="1",
               SLURM_NNODES="1", SLURM_NODEID="0", MASTER_ADDR="10.1.0.1", S3AC_ROOT=ROOT, **env_extra)
    r = subprocess.run(["bash", os.path.join(ROOT, "examples/paper/launch.sh"), "train", "x.yaml"], env=env,
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    lines = log.read_text().splitlines() if log.exists() else []
    return r, next((x for x in lines if x.startswith("ray start")), None), \
        next((x for x in lines if x.startswith("torchrun")), None)


def _flag(line, name):
    parts = (line or "").split()
    return parts[parts.index(name) + 1] if name in parts else None


def test_a_task_bound_to_one_gpu_runs_one_rank_on_it(tmp_path):
    """srun --gpus-per-task=1 (inherited from the batch): the task sees GPU 3 only."""
    r, ray, run = _launch(tmp_path, CUDA_VISIBLE_DEVICES="3")
    assert r.returncode == 0, r.stderr
    assert _flag(run, "--nproc-per-node") == "1", (
        f"{run}: torchrun starts more ranks than the one GPU Slurm gave this task (nvidia-smi counts the node's 8)")
    assert _flag(ray, "--num-gpus") == "1" and ray.endswith("CUDA_VISIBLE_DEVICES=3"), (
        f"{ray}: Ray refuses --num-gpus above the devices CUDA_VISIBLE_DEVICES lists")


def test_a_gpu_count_the_task_cannot_see_is_refused_naming_it(tmp_path):
    """The batch step counted 8 and exported GPUS_PER_NODE; the node's task was bound to 2 of them."""
    r, ray, run = _launch(tmp_path, CUDA_VISIBLE_DEVICES="0,1", GPUS_PER_NODE="8", TRAINER_GPUS_PER_NODE="4")
    assert run is None and ray is None, (
        f"launch.sh started `{ray}` and `{run}`: 8 GPUs per node assumed, the task sees 2 (ranks 2..3 have no "
        f"cuda:LOCAL_RANK, Ray gets no device)")
    assert r.returncode == 2 and "CUDA_VISIBLE_DEVICES=0,1" in r.stderr and "GPUS_PER_NODE=8" in r.stderr, r.stderr


def test_a_task_holding_every_gpu_is_split_as_before(tmp_path):
    r, ray, run = _launch(tmp_path, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7", TRAINER_GPUS_PER_NODE="6")
    assert r.returncode == 0, r.stderr
    assert _flag(run, "--nproc-per-node") == "6"
    assert _flag(ray, "--num-gpus") == "2" and ray.endswith("CUDA_VISIBLE_DEVICES=6,7"), ray
    r, ray, run = _launch(tmp_path, GPUS_PER_NODE="8")  # no Slurm binding: unchanged
    assert r.returncode == 0 and _flag(run, "--nproc-per-node") == "8" and _flag(ray, "--num-gpus") == "8"

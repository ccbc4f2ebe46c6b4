"""Second review, finding 1 (issue 41): separate placement put the engines on the trainer's GPUs.

At ec9434d examples/paper/launch.sh gave both ``ray start --num-gpus`` and ``torchrun --nproc-per-node`` every GPU
of each node; Ray then handed the engine actors its slots 0..N-1 (mapped through the raylet's CUDA_VISIBLE_DEVICES
when set, ray ``_private/worker.py:1139-1164``, else the node's first GPUs) = the trainer's devices, and NCCL refuses
two ranks on one device ("Duplicate GPU detected") or memory runs out first; nothing checked. Now
``TRAINER_GPUS_PER_NODE`` splits each node (torchrun the first, Ray the rest under their CUDA_VISIBLE_DEVICES), and
the separate weight sync refuses engines sharing a trainer rank's GPU before any group forms
(``rollout.engines.pool.shared_devices``, called in ``StageBroadcastSync.connect`` on GPUs).
"""
import os
import stat
import subprocess
from pathlib import Path

import pytest

from megatron_s3ac.rollout.engines.pool import shared_devices

ROOT = Path(__file__).resolve().parents[2]
STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $* CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}" >> "$LOG"
exit 0
"""


def _launch(tmp_path, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("ray", "torchrun", "nvidia-smi"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(stat.S_IRWXU)
    log = tmp_path / "log"
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RAY_", "CUDA_VISIBLE"))}
    full.update({"PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log), "NNODES": "1", "NODE_RANK": "0",
                 "MASTER_ADDR": "10.0.0.1", "GPUS_PER_NODE": "8", **env})
    res = subprocess.run(["bash", str(ROOT / "examples/paper/launch.sh"), "train", "cfg.yaml"], env=full,
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    return res, (log.read_text().splitlines() if log.exists() else [])


def test_separate_split_gives_ray_only_the_engine_gpus(tmp_path):
    res, lines = _launch(tmp_path, TRAINER_GPUS_PER_NODE="4")
    assert res.returncode == 0, res.stderr
    ray_line, torchrun_line = lines[0], lines[1]
    assert ray_line.startswith("ray start --head") and "--num-gpus 4 " in ray_line
    assert ray_line.endswith("CUDA_VISIBLE_DEVICES=4,5,6,7")
    assert torchrun_line.startswith("torchrun") and "--nproc-per-node 4 " in torchrun_line
    # the trainer's ranks use cuda:LOCAL_RANK = GPUs 0..3: disjoint from Ray's
    # a node whose GPUs are already narrowed: the split follows its list
    res, lines = _launch(tmp_path, TRAINER_GPUS_PER_NODE="2", GPUS_PER_NODE="4", CUDA_VISIBLE_DEVICES="3,5,6,7")
    assert res.returncode == 0 and lines[-3].endswith("CUDA_VISIBLE_DEVICES=6,7") and "--num-gpus 2 " in lines[-3]


def test_colocated_default_is_unchanged_and_bad_split_refused(tmp_path):
    res, lines = _launch(tmp_path)
    assert res.returncode == 0 and "--num-gpus 8 " in lines[0] and "--nproc-per-node 8 " in lines[1]
    res, lines = _launch(tmp_path, TRAINER_GPUS_PER_NODE="9")
    assert res.returncode == 2 and "TRAINER_GPUS_PER_NODE=9 must be 1..GPUS_PER_NODE (8)" in res.stderr


def test_shared_devices_names_each_overlap():
    trainer = ["GPU-a", "GPU-b", None]
    assert shared_devices(trainer, [["GPU-c", "GPU-d"]]) == []
    assert shared_devices(trainer, [["GPU-c"], ["GPU-b", "GPU-a"]]) == [
        "trainer rank 1 and engine 1 TP rank 0 on GPU GPU-b", "trainer rank 0 and engine 1 TP rank 1 on GPU GPU-a"]


def test_stage_sync_refuses_engines_on_trainer_gpus(monkeypatch):
    """StageBroadcastSync.connect on one rank (gloo) with CUDA faked: the pool's engine sits on rank 0's GPU."""
    import torch
    import torch.distributed as dist

    from megatron_s3ac.rollout.engines.sglang import broadcast, ipc
    from megatron_s3ac.rollout.sync import weight_sync
    from megatron_s3ac.rollout.sync.rendezvous import free_port

    class Pool:
        tp_sizes = [1]

        def device_keys(self):
            return [["GPU-0"]]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ipc, "device_key", lambda index=None: "GPU-0")
    # one rank, one stage: it holds the pool and leads stage 0 (megatron's parallel state is not needed)
    monkeypatch.setattr(weight_sync, "_roles", lambda has_engine, group: (0, {0: 0}, 0, 0))
    monkeypatch.setattr(weight_sync, "_comm_device", lambda: torch.device("cpu"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        sync = broadcast.StageBroadcastSync(Pool(), master_address="127.0.0.1")
        with pytest.raises(ValueError, match=r"rollout\.placement: separate, but the engines share GPUs with the "
                                             r"trainer: trainer rank 0 and engine 0 TP rank 0 on GPU GPU-0"):
            sync.connect(export_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()

"""megatron-core's torch_dist writer starts a spawn-method Manager (its results queue) at a process's first save;
a SIGKILLed trainer left it and its resource tracker alive under init. A process that saves one torch_dist
checkpoint and is then SIGKILLed: with ``save_queue.install()`` (what ``init_distributed`` does) none of its
descendants outlive it; without it (megatron as shipped, the control that shows the test can fail) they do."""
import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys

    import psutil
    import torch
    import torch.distributed as dist


    def main():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if sys.argv[1] == "install":
            from megatron_s3ac.models.parallel import init_distributed

            init_distributed("gloo")
        else:
            from megatron_s3ac.models import cpu_compat

            cpu_compat.enable()
            dist.init_process_group("gloo")
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor

        os.makedirs(sys.argv[2])
        dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, sys.argv[2])
        kids = [p.pid for p in psutil.Process().children(recursive=True)]
        print("KIDS " + json.dumps(kids), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


    if __name__ == "__main__":
        main()
""")


def _alive(pids):
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _killed_saver(tmp_path, mode, port):
    script = tmp_path / "saver.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    log = tmp_path / f"{mode}.log"
    with open(log, "w") as f:  # a file, not a pipe: surviving children would hold a pipe open
        r = subprocess.run([sys.executable, str(script), mode, str(tmp_path / f"ckpt_{mode}"), str(port)],
                           stdout=f, stderr=subprocess.STDOUT, env=env, timeout=300)
    out = log.read_text()
    assert r.returncode == -9, out[-3000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("KIDS "))
    return json.loads(line[5:])


@pytest.mark.timeout(600)
def test_a_killed_savers_helper_processes_exit(tmp_path):
    from megatron_s3ac.rollout.sync.rendezvous import free_port

    kids = _killed_saver(tmp_path, "install", free_port())
    assert kids  # the Manager's server and its resource tracker
    deadline = time.time() + 15
    while _alive(kids) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(kids), [psutil.Process(p).cmdline() for p in _alive(kids)]

    control = _killed_saver(tmp_path, "plain", free_port())
    try:
        time.sleep(3)
        assert _alive(control)  # megatron as shipped: still there
    finally:
        for pid in _alive(control):
            psutil.Process(pid).kill()

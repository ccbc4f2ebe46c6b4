"""RemoteEngine and EnginePool join the job's Ray cluster when RAY_ADDRESS is set (the launch scripts export it)
instead of calling ray.init(num_cpus=..., num_gpus=...), which Ray 2.x refuses against an existing cluster.
A real head is started with `ray start --head` (own ports, own temp dir, own process group: stopped by its id)."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a Ray head + a driver + two actors: ~25-40 s on 2 busy cores

ROOT = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def ray_head():
    """A one-CPU Ray head with a marker resource and token authentication on; yields (address, HOME holding the
    token). `--block` keeps `ray start` in the foreground so every daemon shares its process group, which is killed
    at the end (never `ray stop`: that stops every Ray on the machine)."""
    port, client, dash, agent, grpc, metrics, rt = _free_ports(7)
    temp = tempfile.mkdtemp(prefix="s3ray", dir="/tmp")  # short: raylet socket paths are length-limited
    cmd = [str(RAY), "start", "--head", "--block", "--port", str(port), "--num-cpus", "1",
           "--resources", '{"s3ac_test_head": 1}', "--node-ip-address", "127.0.0.1", "--disable-usage-stats",
           "--include-dashboard", "false", "--ray-client-server-port", str(client), "--dashboard-port", str(dash),
           "--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(grpc),
           "--metrics-export-port", str(metrics), "--runtime-env-agent-port", str(rt), "--temp-dir", temp]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # workers import megatron_s3ac
    # as on a node where a local ray.init() once wrote ~/.ray/auth_token: Ray 2.60's `ray start` turns token auth on
    home = Path(temp) / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("s3ac0test0token0" * 4)
    env["HOME"] = str(home)
    log = open(Path(temp) / "start.log", "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while "Ray runtime started" not in (Path(temp) / "start.log").read_text():
            assert proc.poll() is None and time.time() < deadline, (Path(temp) / "start.log").read_text()
            time.sleep(0.5)
        assert "Token authentication is enabled" in (Path(temp) / "start.log").read_text()
        yield f"127.0.0.1:{port}", str(home)
    finally:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


DRIVER = textwrap.dedent("""
    import numpy as np
    import ray
    from megatron_s3ac.rollout.base import RolloutEngine, Sample, SamplingParams
    from megatron_s3ac.rollout.engines.pool import EnginePool
    from megatron_s3ac.rollout.engines.cpu.remote import RemoteEngine

    class Echo(RolloutEngine):  # no model: this checks where the actor runs, not generation
        def __init__(self, slot=None):
            pass
        def generate(self, prompt_ids, params, n_samples=1, return_routed_experts=False):
            return [[Sample(list(p), list(p), np.zeros(len(p), np.float32), "stop")] * n_samples for p in prompt_ids]
        def update_weights(self, named_tensors):
            pass
        def sleep(self):
            pass
        def wake(self):
            pass
        def flush_cache(self):
            pass

    remote = RemoteEngine(Echo, num_cpus=1, start_timeout_s=120)  # before the fix: ray.init(num_cpus=1, ...) raised
    assert ray.cluster_resources().get("s3ac_test_head") == 1, ray.cluster_resources()  # the head, not a new Ray
    print("remote", remote.generate([[1, 2]], SamplingParams())[0][0].response_ids)
    remote.close()
    ray.shutdown()
    pool = EnginePool(Echo, 1, cpus_per_engine=1, timeout_s=60, start_timeout_s=120)
    assert ray.cluster_resources().get("s3ac_test_head") == 1
    print("pool", pool.generate([[3], [4]], SamplingParams())[1][0].response_ids)
    pool.close()
""")


def test_remote_engine_and_pool_join_the_cluster_at_ray_address(ray_head, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    address, home = ray_head
    # what examples/paper/launch.sh exports: RAY_ADDRESS, and RAY_AUTH_MODE=token since the node has a token
    env.update(RAY_ADDRESS=address, RAY_AUTH_MODE="token", HOME=home, PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", DRIVER], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "remote [1, 2]" in res.stdout and "pool [4]" in res.stdout

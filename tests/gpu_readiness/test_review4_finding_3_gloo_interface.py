"""Fourth GPU-path review, finding 3: on hosts whose name resolves to a loopback address, gloo told the other nodes
127.0.1.1.

The trainer uses gloo across nodes: megatron-core 0.19.2's gloo groups (``initialize_model_parallel``'s
``create_gloo_process_groups=True``, parallel_state.py:620) and the rank-0 wait group (trainer/step/rank0.py:33,
``dist.new_group(backend="gloo")``). Without ``GLOO_SOCKET_IFNAME`` torch's ProcessGroupGloo.createDefaultDevice
resolves ``gethostname()`` and uses the first address that binds (``doesHostnameResolveToUsableAddress``: a
``bind()`` test, which 127.0.1.1 passes), so on a stock Debian/Ubuntu /etc/hosts every node advertises a loopback
address through the store and no cross-node gloo pair connects (the job hangs at megatron's init until the timeout).
Issue 24's finding 10 fixed the same for the weight-update groups' store (``rendezvous_address``); launch.sh left
gloo to it.

Fixed in examples/paper/launch.sh: with NNODES > 1, GLOO_SOCKET_IFNAME unset and the host name resolving to a 127.*
address (or to nothing: torch then falls back to 127.0.0.1), GLOO_SOCKET_IFNAME is the default route's interface.
Shown by running launch.sh itself with ``hostname`` / ``getent`` / ``ip`` / ``ray`` / ``torchrun`` stubbed: the
environment torchrun is started with is recorded.
"""
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STUBS = {
    "hostname": 'echo node7\n',
    "getent": 'if [ "$1" = ahostsv4 ] && [ "$2" = node7 ] && [ -n "$S3AC_TEST_HOST_ADDR" ]; then echo "$S3AC_TEST_HOST_ADDR STREAM node7"; fi\n',
    "ip": 'echo "default via 10.1.0.254 dev ens7f0 proto dhcp src 10.1.0.17 metric 100"\n',
    "ray": 'exit 0\n',
    "torchrun": 'echo "GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-unset}" > "$S3AC_TEST_LOG"\n',
}


def _launch(tmp_path, host_addr, nnodes=2, extra=None):
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        (d / name).write_text("#!/usr/bin/env bash\n" + body)
        (d / name).chmod(0o755)
    log = tmp_path / "torchrun.env"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RAY_", "CUDA_VISIBLE", "GLOO_"))}
    env.update(PATH=f"{d}:{os.environ['PATH']}", NNODES=str(nnodes), NODE_RANK="1", MASTER_ADDR="10.1.0.1",
               GPUS_PER_NODE="8", RAY_JOIN_TIMEOUT="0", S3AC_TEST_LOG=str(log), S3AC_TEST_HOST_ADDR=host_addr,
               **(extra or {}))
    r = subprocess.run(["bash", os.path.join(ROOT, "examples/paper/launch.sh"), "train", "x.yaml"], env=env,
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return log.read_text().strip()


@pytest.mark.parametrize("addr", ["127.0.1.1", ""])
def test_a_loopback_host_name_gives_gloo_the_default_route_interface(tmp_path, addr):
    got = _launch(tmp_path, addr)
    assert got == "GLOO_SOCKET_IFNAME=ens7f0", (f"{got}: the host name resolves to {addr or 'nothing'}, so torch's "
                                                f"gloo would advertise a loopback address to the other nodes")


def test_a_routable_host_name_an_explicit_setting_and_one_node_are_left_alone(tmp_path):
    assert _launch(tmp_path, "10.1.0.17") == "GLOO_SOCKET_IFNAME=unset"
    assert _launch(tmp_path, "127.0.1.1", extra={"GLOO_SOCKET_IFNAME": "ib0"}) == "GLOO_SOCKET_IFNAME=ib0"
    assert _launch(tmp_path, "127.0.1.1", nnodes=1) == "GLOO_SOCKET_IFNAME=unset"

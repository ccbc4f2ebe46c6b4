"""Finding 11 (issue 24): hand-started multi-node ``examples/qwen3_5/run.sh``: the other nodes wait for node 0's
conversion before launching.

At 2c164be node 0 converted the checkpoint (hours for the large models) before launch.sh started the Ray head,
while the other nodes went straight to launch.sh, whose Ray join gives up after RAY_JOIN_TIMEOUT (300 s). The real
run.sh runs here as node 1 with launch.sh replaced by a stub (S3AC_ROOT pointing at a copy holding the stub) that
records whether the converted checkpoint (``$MCORE/.metadata``, which the converter renames into place at the very
end) existed when it was started. The checkpoint appears only once run.sh has said it waits.
"""
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_SH = os.path.join(ROOT, "examples", "qwen3_5", "run.sh")
STUB = """#!/usr/bin/env bash
MCORE="$(cat "$(dirname "$0")/mcore_path")"
state=unconverted
[ -e "$MCORE/.metadata" ] && state=converted
echo "$state" > "$(dirname "$0")/launched"
echo "$@" >> "$(dirname "$0")/launched"
"""


@pytest.fixture
def node1(tmp_path):
    root = tmp_path / "root"
    (root / "examples" / "paper").mkdir(parents=True)
    stub = root / "examples" / "paper" / "launch.sh"
    stub.write_text(STUB)
    stub.chmod(0o755)
    mcore = tmp_path / "mcore"
    (root / "examples" / "paper" / "mcore_path").write_text(str(mcore))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model: {{hf_config: {tmp_path / 'hf'}, actor_init: {mcore}}}\n")
    env = dict(os.environ, S3AC_ROOT=str(root), NODE_RANK="1", CONVERT_POLL_S="0.2",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    for k in ("SKIP_CONVERT", "SLURM_JOB_ID", "SLURM_NODEID"):
        env.pop(k, None)
    return root / "examples" / "paper", mcore, cfg, env, tmp_path / "stderr.log"


def _start(node1, **env):
    where, mcore, cfg, base_env, log = node1
    err = open(log, "w")
    return subprocess.Popen(["bash", RUN_SH, "train", str(cfg), "train.steps=1"], env={**base_env, **env},
                            stdout=subprocess.DEVNULL, stderr=err)


def test_other_nodes_launch_only_after_the_conversion(node1):
    where, mcore, cfg, _, log = node1
    proc = _start(node1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and "waits for node 0" not in log.read_text():
        time.sleep(0.1)
    mcore.mkdir()
    (mcore / ".metadata").write_text("")  # node 0's conversion ends (renamed into place)
    assert proc.wait(timeout=60) == 0, log.read_text()
    launched = (where / "launched").read_text().split("\n")
    assert launched[0] == "converted", "launch.sh (Ray join, torchrun) started before the checkpoint was converted"
    assert launched[1] == f"train {cfg} train.steps=1"


def test_a_conversion_that_never_ends_fails_with_the_path_not_a_launch(node1):
    where, mcore, cfg, _, log = node1
    proc = _start(node1, CONVERT_WAIT_TIMEOUT="1")
    rc = proc.wait(timeout=60)
    assert not (where / "launched").exists(), "launched without a converted checkpoint"
    assert rc == 1
    assert f"no converted checkpoint at {mcore}/.metadata" in log.read_text()

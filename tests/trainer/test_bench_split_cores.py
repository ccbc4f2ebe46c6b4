"""``bench/bench_async.py --split-cores``: every thread of the trainer's descendants (the engine's processes) lands
on the last core, every thread of the trainer on the others, and the trainer's torch threads match its cores.
Run in a child process (affinity is the caller's own), with a descendant that starts its threads first."""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import json, os, subprocess, sys, threading, time
    sys.path.insert(0, os.path.join(sys.argv[1], "bench"))
    import torch
    from bench_async import split_cores
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    code = "import threading, time\\n[threading.Thread(target=time.sleep, args=(60,), daemon=True).start() " \\
           "for _ in range(3)]\\nprint('up', flush=True)\\ntime.sleep(60)"
    eng = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert eng.stdout.readline().strip() == "up"
    threading.Thread(target=time.sleep, args=(5,), daemon=True).start()  # a trainer thread started before the split
    split_cores()
    aff = lambda pid: {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}
    print(json.dumps({"engine": aff(eng.pid), "trainer": aff(os.getpid()), "threads": torch.get_num_threads()}))
    eng.kill()
""")


def test_split_cores_pins_every_thread():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    import json

    out = subprocess.run([sys.executable, "-c", CHILD, ROOT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got["engine"]) >= 4 and all(v == cores[-1:] for v in got["engine"].values()), got["engine"]
    assert len(got["trainer"]) >= 2 and all(v == cores[:-1] for v in got["trainer"].values()), got["trainer"]
    assert got["threads"] == len(cores) - 1

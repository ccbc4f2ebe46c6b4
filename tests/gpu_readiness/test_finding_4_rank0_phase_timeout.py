"""Finding 4 (issue 24): while rank 0 alone starts its engines, generates a rollout or runs the periodic evaluation,
the other ranks waited inside collectives of the default process group (the first sync's ``all_gather`` in
``rollout/sync/weight_sync.py``, the rollout's ``broadcast_object_list`` in ``trainer/step/rollout_phases.py``, the
"best evaluation" ``broadcast`` in ``trainer/run/train_loop.py``), so NCCL's watchdog (10 min by default; no timeout was set)
aborted them during a long engine start or a 16K-token rollout. The fix: a configurable ``train.dist_timeout_s``
given to ``init_process_group`` and megatron's groups, and the other ranks wait for rank 0's phases on a gloo
group with that deadline (``trainer.step.rank0``), never inside a collective of the default group.

Gloo honours a process group's timeout as NCCL's watchdog does (a blocked collective raises after it), so CPU
shows it: the default process group gets a 4 s timeout (``audit.pg_timeout.run_with_pg_timeout``), rank 0's
real engine is made slow to start and to generate (``slow_rank0_engine``: 6.5 s each, rollout and evaluation
alike), and one RL step with a periodic evaluation runs through ``train_loop``: rank 1 must survive every wait.
On a GPU the NCCL side (its watchdog, the gloo wait group beside an NCCL default group) is the device check
``torchrun --nproc-per-node 2 tools/device_checks/rank0_waits.py`` (``--stand-in``: the same on CPU).
"""
import dataclasses
import inspect
import json
import os
import time

import pytest

from megatron_s3ac.models.gloo_ranks import DistributedTestError
from megatron_s3ac.audit.pg_timeout import run_with_pg_timeout, slow_rank0_engine

SMALL = ["model.tiny=arithmetic_moe", "rollout.prompts_per_step=4", "rollout.k=2", "rollout.max_new_tokens=3",
         "data.num_prompts=64", "data.eval_prompts=8", "algo.actor_minibatches=2", "algo.critic_minibatches=2",
         "algo.critic_epochs=1", "algo.dynamic_sampling=false", "daps.warmup_steps=0", "daps.rampup_steps=1",
         "train.progress=false", "train.tensorboard=false", "eval.greedy=false", "train.save_every=0"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PG_TIMEOUT_S = 4.0  # the stand-in for NCCL's watchdog
SLOW_S = 6.5  # each rank-0-only phase takes longer than that


def _has_key(key: str) -> bool:
    from megatron_s3ac.config import TrainCfg

    return key in {f.name for f in dataclasses.fields(TrainCfg)}


def _run(out_dir, overrides, start_s, generate_s):
    import torch.distributed as dist

    from megatron_s3ac.trainer.step import build
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer
    from megatron_s3ac.trainer.run.train_loop import train_loop

    cfg = load_config(None, SMALL + overrides + [f"train.out_dir={out_dir}"])
    with slow_rank0_engine(build, start_s, generate_s) as events:
        t0 = time.monotonic()
        tr = Trainer(cfg)  # rank 0 starts its engine; the first weight sync
        built_s = time.monotonic() - t0
        train_loop(tr)  # rollout (rank 0 generates), the step, periodic evaluation (rank 0)
        total_s = time.monotonic() - t0
        tr.close()
    return {"rank": dist.get_rank(), "events": list(events), "steps": tr.step_idx, "built_s": built_s,
            "total_s": total_s}


def test_other_ranks_survive_slow_rank0_phases(tmp_path):
    assert SLOW_S > PG_TIMEOUT_S + 1
    try:
        res = run_with_pg_timeout(_run, 2, PG_TIMEOUT_S, str(tmp_path), ["train.steps=1", "train.eval_every=1"],
                                  SLOW_S, SLOW_S, timeout=400)
    except DistributedTestError as e:
        pytest.fail(f"a rank did not survive rank 0's slow phases under a {PG_TIMEOUT_S:g} s process-group "
                    f"timeout:\n{e}")
    r0, r1 = res
    assert r0["steps"] == r1["steps"] == 1
    # rank 0 really was slow in each phase: the engine start, the rollout's and the evaluation's generation
    kinds = [k for k, _ in r0["events"]]
    assert kinds[0] == "start" and kinds.count("generate") >= 2, r0["events"]
    assert all(s >= SLOW_S for _, s in r0["events"]), r0["events"]
    assert r1["events"] == []  # only rank 0 builds an engine
    # and rank 1 waited each of them out, far past the process group's timeout
    assert r1["built_s"] >= SLOW_S and r1["total_s"] >= 3 * SLOW_S, r1
    rows = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    assert len(rows) == 1 and any(k.startswith("eval/heldout") for k in rows[0]), rows


def test_a_wait_past_the_deadline_names_the_phase_and_the_key(tmp_path):
    """train.dist_timeout_s is the other ranks' deadline: past it they stop with an error naming the phase."""
    if not _has_key("dist_timeout_s"):
        pytest.skip("train.dist_timeout_s is not in this version's schema")
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 of 2 failed.*Rank0WaitError: rank 1 waited for rank "
                                                   r"0's rollout generation.*train.dist_timeout_s=5 s"):
        run_with_pg_timeout(_run, 2, 120.0, str(tmp_path), ["train.steps=1", "train.eval_every=0",
                                                             "train.dist_timeout_s=5"], 0.0, 15.0, timeout=400)


def _pg_timeout_probe(timeout_s):
    """init_distributed(timeout_s=...) on a fresh job: the default group's collectives time out after it."""
    import torch.distributed as dist

    from megatron_s3ac.models.parallel import init_distributed

    init_distributed("gloo", timeout_s=timeout_s)
    if dist.get_rank() == 0:
        time.sleep(timeout_s + 4)
    t0 = time.monotonic()
    try:
        dist.barrier()
        return {"raised": False, "waited": time.monotonic() - t0}
    except RuntimeError:
        return {"raised": True, "waited": time.monotonic() - t0}


def test_init_distributed_takes_the_timeout():
    from megatron_s3ac.models.parallel import init_distributed

    if "timeout_s" not in inspect.signature(init_distributed).parameters:
        pytest.skip("init_distributed has no timeout in this version")
    res = run_with_pg_timeout(_pg_timeout_probe, 2, None, 2.0, timeout=120)
    assert res[1]["raised"] and res[1]["waited"] < 5.5, res  # rank 1 gave up after ~2 s, not torch's 30 min


def test_dist_timeout_is_validated_when_the_config_loads():
    if not _has_key("dist_timeout_s"):
        pytest.skip("train.dist_timeout_s is not in this version's schema")
    from megatron_s3ac.config import ConfigError, load_config

    assert load_config(None, SMALL).train.dist_timeout_s == 3600.0
    with pytest.raises(ConfigError, match=r"train.dist_timeout_s=0.0 must be > 0"):
        load_config(None, SMALL + ["train.dist_timeout_s=0"])
    # an engine call may take rollout.sglang.timeout_s: the other ranks must wait at least that long
    with pytest.raises(ConfigError, match=r"train.dist_timeout_s=600 is shorter than rollout.sglang.timeout_s=1800"):
        load_config(None, [f"model.hf_config={ROOT}/examples/hf_configs/qwen2_5_math_1_5b", "rollout.engine=sglang",
                           "data.task=arithmetic", "train.dist_timeout_s=600"])

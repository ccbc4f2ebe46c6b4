"""Finding 4 in the asynchronous loop (train.max_staleness >= 1): rank 0 waits for the engine's prefetched batch
(and, before the weight sync, for every batch still in flight) and then tells every rank whether the engine died.
That verdict was a ``broadcast_object_list`` of the default process group, so the other ranks sat inside a
default-group collective for as long as rank 0 waited on the engine (NCCL's watchdog aborts them after the group's
timeout). It now goes through ``Trainer.rank0`` (``trainer.step.rank0.Rank0Phases``: the gloo group whose deadline is
``train.dist_timeout_s``), as the synchronous rollout's hand-over does.

As in test_finding_4_rank0_phase_timeout.py: the default group times out after 4 s (the watchdog's stand-in), rank
0's engine (the CPU engine in its own Ray actor process) takes 6.5 s to hand back each prefetched batch
(``SlowEngine.generate_async``), two asynchronous steps run: rank 1 must wait every one out.
"""
import pytest

from megatron_s3ac.models.gloo_ranks import DistributedTestError
from megatron_s3ac.audit.pg_timeout import run_with_pg_timeout, slow_rank0_engine
from tests.gpu_readiness.test_finding_4_rank0_phase_timeout import PG_TIMEOUT_S, SLOW_S, SMALL

ASYNC = ["rollout.placement=separate", "actor_layout.ep=2", "train.max_staleness=1", "train.steps=2",
         "train.eval_every=0"]


def _run(out_dir, overrides, generate_s):
    import time

    import torch.distributed as dist

    from megatron_s3ac.trainer.step import build
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer

    cfg = load_config(None, SMALL + ASYNC + overrides + [f"train.out_dir={out_dir}"])
    with slow_rank0_engine(build, 0.0, generate_s) as events:
        tr = Trainer(cfg)
        try:
            t0 = time.monotonic()
            ms = [tr.step() for _ in range(2)]
            steps_s = time.monotonic() - t0
        finally:
            tr.close()
    return {"rank": dist.get_rank(), "events": list(events), "st": [m.get("async/staleness_max") for m in ms],
            "steps_s": steps_s}


@pytest.mark.slow  # waits out a 16 s engine past a 15 s timeout (~28 s); finding 4's rank-0 phase test stays fast
def test_other_ranks_wait_out_slow_async_engine_waits(tmp_path):
    try:
        r0, r1 = run_with_pg_timeout(_run, 2, PG_TIMEOUT_S, str(tmp_path), [], SLOW_S, timeout=400)
    except DistributedTestError as e:
        pytest.fail(f"a rank did not survive rank 0's slow engine waits under a {PG_TIMEOUT_S:g} s process-group "
                    f"timeout:\n{e}")
    assert r0["st"] == r1["st"] == [0.0, 1.0]
    # rank 0 really waited on the engine, twice (batch 0 in step 0, batch 1 before step 0's sync), each longer
    # than the default group's timeout; rank 1 waited with it
    slow = [s for k, s in r0["events"] if k == "generate_async"]
    assert len(slow) == 2 and all(s >= SLOW_S for s in slow), r0["events"]
    assert r1["steps_s"] >= 2 * SLOW_S, r1


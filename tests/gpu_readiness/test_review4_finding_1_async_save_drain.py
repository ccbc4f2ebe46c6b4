"""Fourth GPU-path review, finding 1: a checkpoint of the asynchronous loop waited for the engine inside the save.

``trainer.run.checkpoint._save_checkpoint`` builds ``trainer_state.pt`` on rank 0 only, between two default-group
``dist.barrier()`` calls, and ``AsyncSource.state_dict`` gets each queued batch's samples with ``_result``, which
*waits* for a batch still generating. The plain loop drains the queue in ``sync_weights`` (so nothing is left to wait
for), but ``rollout.sync.overlap`` does not wait for the batches in flight (its point) and partial rollout resumes
the interrupted responses after the sync: at the save, rank 0 waited for a whole generation while every other rank
sat in ``dist.barrier()`` of the default group (NCCL's watchdog aborts them after the group's timeout: the wait
issue 24's finding 4 moved onto the gloo ``Trainer.rank0`` group everywhere else), and an engine that died there
was not recovered (``RemoteEngineDied`` out of the save on rank 0 alone; the others hang in the barrier).

Fixed: ``save_checkpoint`` first calls ``tr.source.before_save()`` on every rank; the asynchronous source collects
the queue there through ``_await`` (rank 0's wait shared over the gloo group; a dead engine rebuilt, re-synced and
its batches resubmitted), so ``state_dict`` has nothing left to wait for. A restart in that window (after the step
counter advanced) tags the rebuilt engine's batches with the version it really holds (``end_step`` resets
``_trained``; it read ``step_idx + 1`` there, one version too new).

As in tests/gpu_readiness/test_finding_4_async_engine_wait.py: the default group times out after 4 s, rank 0's
engine hands each batch back 6.5 s late; here with ``rollout.sync.overlap=true`` and a checkpoint every step.
"""
import pytest

from megatron_s3ac.config.rollout import RolloutLengthTailCfg
from megatron_s3ac.audit.pg_timeout import run_with_pg_timeout, slow_rank0_engine
from megatron_s3ac.models.gloo_ranks import DistributedTestError
from tests.gpu_readiness.test_finding_4_rank0_phase_timeout import PG_TIMEOUT_S, SLOW_S, SMALL

OVERLAP = ["rollout.placement=separate", "actor_layout.ep=2", "train.max_staleness=1", "train.steps=2",
           "train.eval_every=0", "rollout.sync.overlap=true"]


def _run(out_dir, generate_s):
    import torch.distributed as dist

    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.run.train_loop import train_loop
    from megatron_s3ac.trainer.step import build
    from megatron_s3ac.trainer.step.trainer import Trainer

    # SMALL sets train.save_every=0: a checkpoint after every step here
    cfg = load_config(None, SMALL + OVERLAP + ["train.save_every=1", f"train.out_dir={out_dir}"])
    with slow_rank0_engine(build, 0.0, generate_s) as events:
        tr = Trainer(cfg)
        try:
            train_loop(tr)
        finally:
            tr.close()
    return {"rank": dist.get_rank(), "events": list(events), "steps": tr.step_idx}


@pytest.mark.slow  # two slowed engine waits past a 4 s timeout and two checkpoints at world size 2 (~60 s)
def test_overlapped_queue_is_collected_before_the_save_outside_default_group_collectives(tmp_path):
    import os

    try:
        r0, r1 = run_with_pg_timeout(_run, 2, PG_TIMEOUT_S, str(tmp_path), SLOW_S, timeout=500)
    except DistributedTestError as e:
        pytest.fail(f"a rank did not survive rank 0's wait for the overlapped batch at the checkpoint under a "
                    f"{PG_TIMEOUT_S:g} s process-group timeout:\n{e}")
    assert r0["steps"] == r1["steps"] == 2
    # rank 0 waited twice, each longer than the default group's timeout: batch 0 in step 0, batch 1 (in flight
    # through step 0's overlapped sync) at step 0's checkpoint
    slow = [s for k, s in r0["events"] if k == "generate_async"]
    assert len(slow) == 2 and all(s >= SLOW_S for s in slow), r0["events"]
    assert os.path.isdir(os.path.join(str(tmp_path), "checkpoints", "step_000001"))


def test_a_restart_while_saving_tags_the_version_the_rebuilt_engine_holds():
    """The source after a step (``end_step``: step_idx advanced to s + 1, the engine synced to version s + 1) whose
    queued batch's engine died: ``before_save`` restarts it on every rank and the resubmitted batch is tagged s + 1
    (the actor's current weights), not s + 2."""
    from types import SimpleNamespace

    import torch

    from megatron_s3ac.rollout.base import PendingGeneration
    from megatron_s3ac.rollout.engines.remote import RemoteEngineDied
    from megatron_s3ac.trainer.step.async_loop import AsyncSource, Submitted

    calls = []

    def dead():
        raise RemoteEngineDied("killed")

    class Engine:
        def close(self):
            pass

        def generate_async(self, prompts, params, **kw):
            calls.append("resubmitted")
            return PendingGeneration(lambda: [["sample"]])

    tr = SimpleNamespace(rank=0, world=1, step_idx=0, engine=Engine(), prompts=[SimpleNamespace(ids=[1, 2])],
                         r3_on=False, image_kwargs=lambda pids: {}, close_weight_sync=lambda: None,
                         sync_weights=lambda: calls.append("sync"),
                         sync_strategy=SimpleNamespace(attach=lambda e: None),
                         cfg=SimpleNamespace(rollout=SimpleNamespace(stream_rewards=False, max_engine_restarts=3,
                                                                     k=1, temperature=1.0, top_p=1.0,
                                                                     max_new_tokens=2, partial_rollout=False,
                                                                     sync=SimpleNamespace(overlap=False),
                                                                     length_tail=RolloutLengthTailCfg()),
                                             algo=SimpleNamespace(dynamic_sampling_refill=False),
                                             train=SimpleNamespace(seed=1, steps=5)))
    ar = AsyncSource(tr, 1)
    from megatron_s3ac.trainer.step import build

    real = build.build_engine
    build.build_engine = lambda cfg, info, **kw: (Engine(), False)
    tr.info, tr.multimodal = None, False
    try:
        ar._trained = True  # sync_weights of step 0 ran
        tr.step_idx = 1  # Trainer.step advanced the counter
        ar.end_step({}, 0.0, SimpleNamespace(kept=[]))
        e = Submitted(1, torch.tensor([0]), {}, 0, pending=PendingGeneration(dead))
        ar.queue.append(e)
        if not hasattr(ar, "before_save"):
            pytest.fail("AsyncSource has no before_save: the checkpoint's state_dict waits for the engine on rank "
                        "0 inside the save's default-group barriers")
        ar.before_save()
    finally:
        build.build_engine = real
    assert calls == ["sync", "resubmitted"], calls
    assert e.version == 1, e.version  # the rebuilt engine holds the weights after step 0: version 1
    assert e.collected and ar.restarts == 1

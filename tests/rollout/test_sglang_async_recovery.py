"""Engine failure recovery of the asynchronous loop (trainer/step/async_loop.py ``recover``) with an SGLang
``EnginePool`` of 0.5.23 stand-ins: the engine's scheduler dies mid-generation and, as in sglang, the process
holding the engine dies with it (fake_sglang.py ``debug_crash_scheduler_at_forward``: scheduler.py:6370-6373 ->
SIGQUIT -> kill_process_tree(os.getpid()), entrypoints/engine.py:1976-1982, utils/common.py:2548-2552). The pool
reports ``EngineDied``; the loop rebuilds the pool, re-syncs it with the actor's weights, resubmits the lost batch;
the run completes with the restart counted, and the rebuilt engine's tensors equal the trainer's export."""
import pytest

from megatron_s3ac.models.gloo_ranks import run_distributed
from test_sglang_trainer import BASE, arith_dir, sglang_overrides  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow  # Ray + an engine actor + 3 RL steps + a rebuilt actor: minutes on 2 busy cores


def _sglang_killed_run(hf_dir, overrides):
    import ray

    import fake_sglang
    import rollout_fixtures
    import megatron_s3ac.rollout.factory as F
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer
    from stage_broadcast_ranks import _export

    F.SGLANG_ENGINE_CLS = fake_sglang.FakeSGLangEngine  # the factory seam: every pool built from here on
    for m in (fake_sglang, rollout_fixtures):  # the stand-in travels by value into the actors
        ray.cloudpickle.register_pickle_by_value(m)
    tr = Trainer(load_config(None, overrides))
    try:
        pids = []
        eng = tr.engine
        real = eng.generate_stream_async

        def crash_then(*a, **k):  # step 1 submits step 2's batch: its engine's scheduler dies at its 2nd forward
            if tr.step_idx == 1 and not pids:
                pids.append(eng.info[0]["pid"])
                eng.wait([eng.submit(0, "engine.debug_crash_scheduler_at_forward", 2)], "arm the crash")
            return real(*a, **k)

        eng.generate_stream_async = crash_then
        ms = [tr.step() for _ in range(3)]
        pool = tr.engine
        ref = _export(tr.actor[0] if isinstance(tr.actor, (list, tuple)) else tr.actor, tr.info, 1 << 20)
        (served,) = pool.wait([pool.submit(0, "engine.debug_checkpoint_state_dict")], "read back")
        return {"restarts": [m["rollout/engine_restarts"] for m in ms], "killed": pids,
                "new_pid": pool.info[0]["pid"], "same_pool": pool is eng,
                "st": [m.get("async/staleness_max") for m in ms],
                "diff": max(float((served[n].float() - t.float()).abs().max()) for n, t in ref.items()),
                "unsent": sorted(set(served) - set(ref)), "n": len(ref)}
    finally:
        tr.close()


def test_killed_sglang_engine_in_a_pool_is_restarted_resynced_and_resubmitted(arith_dir, tmp_path):
    base = [o for o in BASE if o != "actor_layout.ep=2"]
    over = base + sglang_overrides(arith_dir) + [
        "rollout.placement=separate", "rollout.sglang.num_engines=1", "cluster.gpus=2", "train.max_staleness=1",
        "train.steps=3", f"train.out_dir={tmp_path}"]
    (r,) = run_distributed(_sglang_killed_run, 1, arith_dir, over, timeout=900)
    assert len(r["killed"]) == 1 and not r["same_pool"] and r["new_pid"] != r["killed"][0]
    assert r["restarts"] == [0, 1, 1]
    # step 2's batch died with the engine and was generated again after the re-sync of step 1's update (version 2)
    assert r["st"] == [0.0, 1.0, 0.0]
    assert r["n"] > 10 and r["diff"] == 0.0 and r["unsent"] == []  # the rebuilt engine holds the trainer's export

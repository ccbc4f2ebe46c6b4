"""The trainer around its models: engine placement (colocated engine sleeps while the models train;
separate engine in its own process gives the same step), rollout rewards (isolated verifiers such as
math-verify run in the RewardPool's worker processes, shared with evaluation; cheap ones inline), and
run-directory safety."""
import os

import pytest

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.config import load_config
from tests.trainer.test_trainer import SMALL


def _score(reward, out_dir):
    from megatron_s3ac.trainer.step.trainer import Trainer

    tr = Trainer(load_config(None, SMALL + [f"rollout.reward={reward}", "rollout.reward_timeout_s=20",
                                            f"train.out_dir={out_dir}"]))
    try:
        got = tr.score(["so the answer is \\boxed{57}", "57", "\\boxed{\\frac{114}{2}}", "58", "garbage"],
                        ["57"] * 5)
        pool = tr.reward_pool
        return got, (None if pool is None else pool.stats.total), tr.evaluator is not None and tr.evaluator.reward_pool is pool
    finally:
        tr.close()


def test_math_rewards_go_through_the_worker_pool(tmp_path):
    got, total, shared = run_distributed(_score, 1, "math", str(tmp_path))[0]
    assert got == [1.0, 1.0, 1.0, -1.0, -1.0]  # math-verify: boxed, bare and an equal fraction count
    assert total == 5  # scored by the pool's workers
    assert shared  # the periodic evaluator uses the same pool


def test_cheap_rewards_run_inline(tmp_path):
    got, total, _ = run_distributed(_score, 1, "arithmetic", str(tmp_path))[0]
    assert got == [-1.0, 1.0, -1.0, -1.0, -1.0]  # arithmetic: the response must start with the digits
    assert total is None  # no verifier processes started


def test_fresh_run_refuses_a_dir_with_checkpoints(tmp_path, capsys):
    """train.resume=false over an earlier run's checkpoints: exit 2 naming the checkpoint, nothing run."""
    from megatron_s3ac.trainer.cli import main

    ck = tmp_path / "checkpoints" / "step_000004"
    ck.mkdir(parents=True)
    (ck / "COMPLETE").touch()
    assert main(["train"] + SMALL + [f"train.out_dir={tmp_path}", "train.resume=false"]) == 2
    assert "step_000004 exists from an earlier run" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["checkpoints"]  # no config.yaml, no metrics


def _colocated(out_dir):
    from megatron_s3ac.trainer.step.trainer import Trainer

    tr = Trainer(load_config(None, SMALL + ["algo.dynamic_sampling=false", "actor_layout.ep=2",
                                            f"train.out_dir={out_dir}"]))
    seen = []
    real = tr._update

    def spy(*a, **k):
        seen.append(None if tr.engine is None else tr.engine._is_asleep())
        return real(*a, **k)

    tr._update = spy
    m = tr.step()
    ready = None if tr.engine is None else (not tr.engine._is_asleep() and not tr.engine._stale)
    return seen, ready, m


def test_colocated_engine_sleeps_while_models_train(tmp_path):
    r0, r1 = run_distributed(_colocated, 2, str(tmp_path))
    seen, ready, m = r0
    assert seen == [True, True]  # actor and critic passes ran with the engine's weights released
    assert ready  # the weight sync refilled every tensor after wake (else generate would refuse)
    assert m["mismatch/train_rollout_kl"] == 0.0 or abs(m["mismatch/train_rollout_kl"]) < 1e-5
    assert r1[0] == [None, None]  # ranks without an engine


def _step_metrics(placement, out_dir):
    from megatron_s3ac.trainer.step.trainer import Trainer

    tr = Trainer(load_config(None, SMALL + ["algo.dynamic_sampling=false", "actor_layout.ep=2", "train.eval_every=0",
                                            f"rollout.placement={placement}", f"train.out_dir={out_dir}"]))
    try:
        kind = type(tr.engine).__name__ if tr.engine is not None else None
        ms = [tr.step() for _ in range(2)]  # the second rollout runs on weights synced after the first update
        return kind, [{k: v for k, v in m.items() if not k.startswith("time/")} for m in ms]
    finally:
        tr.close()


@pytest.mark.slow  # > 25 s on 2 cores; the fast suite's 20-minute budget (CI); make test-all runs it
def test_separate_engine_process_gives_the_same_steps(tmp_path):
    kind_c, ref = run_distributed(_step_metrics, 2, "colocated", str(tmp_path / "c"))[0]
    kind_s, got = run_distributed(_step_metrics, 2, "separate", str(tmp_path / "s"))[0]
    assert (kind_c, kind_s) == ("CPUEngine", "RemoteEngine")
    assert got[1]["mismatch/train_rollout_kl"] == pytest.approx(0.0, abs=1e-5)  # the sync reached the other process
    for g, r in zip(got, ref):
        assert g.keys() == r.keys()
        for k in r:
            assert g[k] == pytest.approx(r[k], rel=1e-5, abs=1e-6, nan_ok=True), k

"""demo.coverage_overshoot_evals (trainer/stages/warmup.py): the supervised warm-up trains on for n evaluation
intervals past its target, snapshotting each as a stronger coverage policy, and then hands RL the weights
of the step where it stopped. Reference: the same warm-up without overshoot (it stops at that step)."""
import pytest

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.config import ConfigError, load_config

BASE = ["model.tiny=arithmetic_moe", "actor_layout.ep=1", "data.num_prompts=64", "data.eval_prompts=8",
        "demo.warmup_batch=8", "demo.warmup_eval_every=3", "demo.warmup_max_steps=30", "demo.target_pass_rate=0.0",
        "train.progress=false", "train.tensorboard=false", "algo.name=grpo_x"]


def _warmup(out_dir, overshoot):
    import torch

    from megatron_s3ac.trainer.step.trainer import Trainer
    from megatron_s3ac.trainer.stages.warmup import supervised_warmup

    cfg = load_config(None, BASE + [f"demo.coverage_overshoot_evals={overshoot}", f"train.out_dir={out_dir}"])
    tr = Trainer(cfg)
    flat = lambda: torch.cat([p.detach().double().reshape(-1) for p in tr.actor.parameters()])  # noqa: E731
    snaps = {}
    res = supervised_warmup(tr, lambda m: None, snapshot=lambda step: snaps.__setitem__(step, flat()))
    engine = torch.cat([p.detach().double().reshape(-1) for p in tr.engine.model.parameters()])
    out = {"res": res, "snaps": sorted(snaps), "actor": flat(), "at_stop": snaps[res["steps"]],
           "last": snaps[max(snaps)], "engine_sum": float(engine.sum()), "engine_sq": float((engine ** 2).sum())}
    tr.close()
    return out


def test_overshoot_snapshots_stronger_policies_and_restores_the_stopping_weights(tmp_path):
    import torch

    ref = run_distributed(_warmup, 1, str(tmp_path / "ref"), 0)[0]
    got = run_distributed(_warmup, 1, str(tmp_path / "over"), 2)[0]
    # target 0: reached at the first evaluation (step 3); two more intervals are trained and snapshotted
    assert ref["res"]["steps"] == got["res"]["steps"] == 3 and ref["snaps"] == [3]
    assert got["snaps"] == [3, 6, 9] and [o["step"] for o in got["res"]["overshoot"]] == [6, 9]
    assert "overshoot" not in ref["res"]
    # RL starts from the stopping step's weights: those of the run that stopped there, not the last snapshot's
    assert torch.allclose(got["actor"], got["at_stop"], atol=0) and torch.allclose(got["actor"], ref["actor"], atol=1e-6)
    assert not torch.allclose(got["last"], got["at_stop"], atol=1e-4)
    # and the engine holds them again (the weight sync after the restore)
    assert got["engine_sum"] == pytest.approx(ref["engine_sum"], rel=1e-6)
    assert got["engine_sq"] == pytest.approx(ref["engine_sq"], rel=1e-6)


def test_negative_overshoot_is_refused():
    with pytest.raises(ConfigError, match="demo.coverage_overshoot_evals=-1 must be >= 0"):
        load_config(None, BASE + ["demo.coverage_overshoot_evals=-1"])


def _capped(out_dir):
    from megatron_s3ac.trainer.step.trainer import Trainer
    from megatron_s3ac.trainer.stages.warmup import supervised_warmup

    cfg = load_config(None, BASE + ["demo.coverage_overshoot_evals=2", "demo.target_pass_rate=1.0",
                                    "demo.warmup_max_steps=6", f"train.out_dir={out_dir}"])
    tr = Trainer(cfg)
    snaps = []
    res = supervised_warmup(tr, lambda m: None, snapshot=snaps.append)
    tr.close()
    return res, snaps


def test_step_cap_before_the_target_reports_the_cap(tmp_path):
    # target 1.0 is not reached by 6 steps: no overshoot, the result names the cap (6), as without overshoot
    res, snaps = run_distributed(_capped, 1, str(tmp_path))[0]
    assert res["steps"] == 6 and res["overshoot"] == [] and snaps == [3, 6]

"""The rehearsal's residency audit (issue 41: "residency per phase against the planner"): the ``run`` phase
records what each model keeps on its device in each phase of a step on every rank (audit.residency) and holds it to
the planner's per-phase residency for the same shrunk config and layout (plan.memory.residency).

Independent references: by hand, the comparison's rules on small dicts; on a run, the offload steps the trainer
takes (trainer.step.placement) undone in the rank processes the way a regression would: the critic left on the
device through the actor's phases, the weight sync and the rollout (``Placement.place`` skipping it) must be named with its phase, model,
kind and both byte counts; a clean run must pass with every measured figure within the tolerance.
"""
import os

import pytest

from megatron_s3ac.models.gloo_ranks import run_distributed

from tests._examples import ROOT

TINY = ["model.tiny=arithmetic_moe", "rollout.prompts_per_step=4", "rollout.k=2", "rollout.max_new_tokens=4",
        "data.num_prompts=40", "data.eval_prompts=4", "algo.actor_minibatches=1", "algo.critic_minibatches=1",
        "algo.critic_epochs=1", "train.progress=false", "train.tensorboard=false", "train.eval_every=0",
        "algo.dynamic_sampling=false", "daps.enabled=false", "rollout.reward=rehearsal_length_parity",
        "train.offload_idle=true", "train.steps=2", "train.save_every=0"]


def test_compare_by_hand():
    from megatron_s3ac.audit.residency import compare

    planned = {"weight_sync": {"actor": {"params": 100, "grads": 0, "optimizer": 0},
                               "critic": {"params": 0, "grads": 0, "optimizer": 0}},
               "actor_update": {"actor": {"params": 100, "grads": 100, "optimizer": 300},
                                "critic": {"params": 0, "grads": 0, "optimizer": 0}}}
    ok = {"actor_update": {"actor": {"params": 100, "grads": 101, "optimizer": 250},
                           "critic": {"params": 0, "grads": 0, "optimizer": 0}},
          "engine_wake": {"actor": {"params": 100, "grads": 0, "optimizer": 0},  # held to weight_sync's figures
                          "critic": {"params": 0, "grads": 0, "optimizer": 0}}}
    rows, defects = compare(ok, planned, 0.02)
    assert defects == []
    assert [(r["phase"], r["model"], r["kind"], r["ratio"]) for r in rows if r["measured"] or r["planned"]] == [
        ("actor_update", "actor", "params", 1.0), ("actor_update", "actor", "grads", 1.01),
        ("actor_update", "actor", "optimizer", 250 / 300), ("engine_wake", "actor", "params", 1.0)]
    assert len(rows) == 2 * 2 * 3  # every measured (phase, model, kind), the zeros too
    bad = {"actor_update": {"actor": {"params": 100, "grads": 103, "optimizer": 0}},
           "engine_wake": {"critic": {"params": 7, "grads": 0, "optimizer": 0}}}
    _, defects = compare(bad, planned, 0.02, "pipeline stage 1")
    assert defects == [
        "pipeline stage 1: actor_update: the actor's grads hold 103 B, 1.030 x the planner's 100 B (tolerance 2%)",
        "pipeline stage 1: engine_wake: the critic's params are resident (7 B) where the planner has 0 B "
        "(offloaded in this phase)"]


def _tiny_config(tmp):
    from omegaconf import OmegaConf

    import megatron_s3ac.trainer.rehearse_run  # noqa: F401 - registers the rehearsal's reward
    from megatron_s3ac.config import load_config

    path = os.path.join(str(tmp), "run.yaml")
    OmegaConf.save(OmegaConf.structured(load_config(None, TINY + [f"train.out_dir={tmp}/run"])), path)
    return path


def _critic_never_offloaded(*a, **k):
    """The rank body with the critic's offload undone (``Placement.place`` skips it): the critic stays on the device
    through the actor's phases, the weight sync and the colocated engine's generation."""
    import megatron_s3ac.trainer.rehearse_run as rr
    from megatron_s3ac.trainer.step.placement import Placement

    real = Placement.place

    def place(self, m, on=(), off=(), kinds=("params", "grads", "optimizer")):
        return real(self, m, [x for x in on if x != "critic"], [x for x in off if x != "critic"], kinds)

    Placement.place = place
    return rr._rank(*a, **k)


def _tiny_rank(config_path, reverted):
    import megatron_s3ac.trainer.rehearse_run as rr

    return (_critic_never_offloaded if reverted else rr._rank)(config_path, [], "train")


@pytest.mark.parametrize("reverted", [False, True])
def test_residency_of_a_tiny_colocated_job(tmp_path, reverted):
    """One gloo rank, the tiny MoE with its critic, colocated offload, the rehearsal's own rank body: clean, every
    figure within the tolerance; reverted, the critic named where the planner has it offloaded."""
    import megatron_s3ac.trainer.rehearse_run as rr

    res = run_distributed(_tiny_rank, 1, _tiny_config(tmp_path), reverted, timeout=300)[0]
    assert res["error"] is None, res["error"]
    rows, defects = rr.residency_check([res["result"]])
    phases = {r["phase"] for r in rows}
    assert {"values", "old_logprobs", "actor_update", "critic_update", "engine_wake", "weight_sync"} <= phases
    if not reverted:
        assert defects == [], defects
        held = [r for r in rows if r["measured"] or r["planned"]]
        assert held and all(r["ratio"] is not None and r["ratio"] <= 1 + rr.RESIDENCY_TOLERANCE for r in held), held
        assert all(r["measured"] == 0 for r in rows if r["phase"] == "rollout")  # the engine generates alone
        return
    assert any(d.startswith("rollout: the critic's params are resident (") and "where the planner has 0 B" in d
               for d in defects), defects
    for phase in ("old_logprobs", "actor_update", "engine_wake", "weight_sync"):
        assert any(d.startswith(f"{phase}: the critic's params are resident (") for d in defects), defects


def _rehearse_run(capsys, monkeypatch, rank=None):
    import megatron_s3ac.trainer.rehearse_run as rr
    from megatron_s3ac.trainer.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("TRAINER_GPUS_PER_NODE", raising=False)
    if rank is not None:  # the rank processes run ``rank`` in place of the rehearsal's own body
        real = rr.run_with_pg_timeout
        monkeypatch.setattr(rr, "run_with_pg_timeout", lambda fn, *a, **k: real(rank, *a, **k))
    rc = main(["rehearse", "examples/paper/qwen25_math_1p5b_k1.yaml",
               "model.hf_config=examples/hf_configs/qwen2_5_math_1_5b"])
    return rc, capsys.readouterr().out


@pytest.mark.slow
def test_rehearsal_reports_residency_per_phase(capsys, monkeypatch):
    """The 1.5B example (2 ranks, DP 2): the residency block in the run phase, every phase within the tolerance."""
    rc, out = _rehearse_run(capsys, monkeypatch)
    assert rc == 0, out
    assert "[ok] run" in out and "residency per phase (measured / planned bytes" in out
    for phase in ("rollout", "values", "old_logprobs", "actor_update", "critic_update", "weight_sync"):
        assert f"residency {phase}" in out, out


@pytest.mark.slow
def test_rehearsal_names_a_critic_never_offloaded(capsys, monkeypatch):
    rc, out = _rehearse_run(capsys, monkeypatch, _critic_never_offloaded)
    assert rc == 1, out
    first = next(line for line in out.splitlines() if line.startswith("rehearsal: first defect: "))
    assert first.startswith("rehearsal: first defect: run: pipeline: coverage -> value pretraining -> RL, eval + "
                            "checkpoint each step: residency: rollout: the critic's params are resident ("), first
    assert "where the planner has 0 B (offloaded in this phase)" in first

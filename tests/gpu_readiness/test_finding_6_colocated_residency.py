"""Finding 6: what is resident beside a colocated engine, measured at each phase of a step (the residency audit,
megatron_s3ac.audit.residency) and compared with the planner's phase figures for the same config.

The trainer (the tiny demo model, one gloo rank, S3AC with its critic, train.offload_idle=true, the colocated CPU
engine) runs two steps under the audit. Independent reference: the bytes of each model's own storages (params,
grads, optimizer) counted before any offload. Before the fix the engine woke and took its weights with both models
wholly resident (the critic, the actor's fp32 grads and Adam states), and the planner had no per-phase residency;
after it: the engine wakes beside the actor's params only, nothing is resident while it generates, each forward and
update has only its own model, and every figure equals the planner's (params and grads exactly; the optimizer at
most the planner's padded share). Value pretraining never builds its third model beside an awake engine.

What CPU cannot show: that the freed memory reaches the driver before the engine wakes (``torch.cuda.empty_cache``
after every offload, trainer.step.placement.release_device_cache, is a no-op here), and SGLang's KV pool size. The device
check tools/device_checks/colocated_residency.py runs the same audit on a GPU and checks the caching allocator holds
no unused memory at the engine's wake (``--stand-in``: its CPU dry run); the KV pool is SGLang's own
(tools/device_checks/sglang_colocated.py starts one beside the trainer).
"""
import pytest

from megatron_s3ac.models.gloo_ranks import run_distributed

CFG = ["model.tiny=arithmetic_moe", "rollout.prompts_per_step=4", "rollout.k=2", "rollout.max_new_tokens=4",
       "data.num_prompts=40", "data.eval_prompts=4", "algo.actor_minibatches=1", "algo.critic_minibatches=1",
       "algo.critic_epochs=1", "train.progress=false", "train.tensorboard=false", "train.eval_every=0",
       "algo.dynamic_sampling=false", "daps.enabled=false", "rollout.reward=test_nonzero", "train.offload_idle=true"]


def planned_residency(tr):
    """The planner's per-phase residency (plan.memory.residency, stage 0) for ``tr``'s model, layouts, world size and
    knobs (plan.preflight.trainer_knobs), or None from a planner without one (before the fix)."""
    import torch.distributed as dist

    from megatron_s3ac.plan.memory import Cluster, Workload, estimate
    from megatron_s3ac.plan.preflight import trainer_knobs
    from megatron_s3ac.config import layout_of

    cfg = tr.cfg
    actor = layout_of(cfg.actor_layout)
    critic = layout_of(cfg.critic_layout) if cfg.critic_layout else actor
    knobs = trainer_knobs(cfg)
    knobs.critic = tr.critic_ddp is not None
    w = Workload(prompt_len=64, response_len=cfg.rollout.max_new_tokens, prompts_per_step=cfg.rollout.prompts_per_step,
                 k=cfg.rollout.k)
    est = estimate(tr.info, actor, Cluster(gpus=dist.get_world_size()), w, knobs, critic)
    return getattr(est.stages[0], "resident", None)


def _audit(out_dir):
    from megatron_s3ac.rollout.rewards import register_reward
    from megatron_s3ac.audit.residency import ResidencyAudit, snapshot
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer

    import megatron_s3ac.trainer.step.build as B

    register_reward("test_nonzero", isolate=False)(lambda resp, ref: float(len(resp) % 2) * 2 - 1)
    seen, real_models, real_engine = {}, Trainer._build_models, B.build_engine

    def build_models(self, par):  # the trainer under construction, for the spy below
        real_models(self, par)
        seen["tr"] = self

    def build_engine(cfg, info, **kw):  # what the engine's start (SGLang: its KV pool sizing) finds resident
        seen["at_engine_start"] = snapshot(seen["tr"])
        return real_engine(cfg, info, **kw)

    Trainer._build_models, B.build_engine = build_models, build_engine
    tr = Trainer(load_config(None, CFG + [f"train.out_dir={out_dir}"]))
    Trainer._build_models, B.build_engine = real_models, real_engine
    # the reference: each model's storages while wholly resident (models_resident where the fix has it)
    ctx = tr.models_resident() if hasattr(tr, "models_resident") else None
    if ctx is not None:
        ctx.__enter__()
    full0 = snapshot(tr)
    if ctx is not None:
        ctx.__exit__(None, None, None)
    audit = ResidencyAudit(tr)
    steps = [tr.step()]
    n = len(audit.log)  # the second step's phases are compared (the optimizer states exist by then)
    steps.append(tr.step())
    after = snapshot(tr)
    # the optimizer states exist now: the full figures again, for the comparison with the planner
    ctx = tr.models_resident() if hasattr(tr, "models_resident") else None
    if ctx is not None:
        ctx.__enter__()
    full = snapshot(tr)
    if ctx is not None:
        ctx.__exit__(None, None, None)
    out = {"at_engine_start": seen["at_engine_start"], "full0": full0, "full": full, "log": audit.log[n:], "after": after, "planned": planned_residency(tr),
           "opt_steps": [m.get("actor/opt_steps") for m in steps]}
    # a checkpoint between steps needs both models: saved, loaded, and the run goes on
    from megatron_s3ac.trainer.run.checkpoint import load_checkpoint, save_checkpoint

    load_checkpoint(tr, save_checkpoint(tr, 2))
    out["after_ckpt"] = snapshot(tr)
    out["step3_opt_steps"] = tr.step().get("actor/opt_steps")
    tr.close()
    return out


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    return run_distributed(_audit, 1, str(tmp_path_factory.mktemp("res")), timeout=300)[0]


def _phase(r, name):
    hits = [s for p, s in r["log"] if p == name]
    assert hits, f"phase {name} never ran ({[p for p, _ in r['log']]})"
    return hits[-1]


ZERO = {"params": 0, "grads": 0, "optimizer": 0}


def test_engine_starts_with_the_models_on_the_host(audited):
    """SGLang sizes its KV pool from the memory free when it starts: the models are not there then (nor while it
    generates)."""
    assert audited["at_engine_start"] == {"actor": ZERO, "critic": ZERO}
    assert audited["full0"]["actor"]["params"] > 0 and audited["full0"]["critic"]["grads"] > 0


def test_engine_wakes_and_loads_beside_the_actors_params_only(audited):
    r = audited
    assert all(s >= 1 for s in r["opt_steps"])
    params_only = {"actor": {**ZERO, "params": r["full"]["actor"]["params"]}, "critic": ZERO}
    assert _phase(r, "engine_wake") == params_only
    assert _phase(r, "weight_sync") == params_only


def test_each_phase_keeps_only_its_model(audited):
    r, full = audited, audited["full"]
    assert _phase(r, "rollout") == {"actor": ZERO, "critic": ZERO}
    assert _phase(r, "values") == {"actor": ZERO, "critic": full["critic"]}
    assert _phase(r, "old_logprobs") == {"actor": full["actor"], "critic": ZERO}
    assert _phase(r, "actor_update") == {"actor": full["actor"], "critic": ZERO}
    assert _phase(r, "critic_update") == {"actor": ZERO, "critic": full["critic"]}
    assert r["after"] == {"actor": ZERO, "critic": ZERO}  # between steps the engine is awake: both on the host


def test_checkpoint_between_steps_under_colocated_offload(audited):
    assert audited["after_ckpt"] == {"actor": ZERO, "critic": ZERO}  # the models left again, the engine woke
    assert audited["step3_opt_steps"] >= 1


def test_measured_residency_equals_the_planners(audited):
    r = audited
    planned = r["planned"]
    if planned is None:
        pytest.fail("the planner gives no per-phase residency (plan.memory: StageEstimate.resident)")
    for phase in ("rollout", "values", "old_logprobs", "actor_update", "critic_update", "weight_sync"):
        got = _phase(r, phase)
        for model in ("actor", "critic"):
            p, g = planned[phase][model], got[model]
            assert (g["params"], g["grads"]) == (p["params"], p["grads"]), (phase, model, g, p)
            assert g["optimizer"] <= p["optimizer"] and (g["optimizer"] > 0) == (p["optimizer"] > 0), \
                (phase, model, g, p)


def _vpt(over):
    """The pipeline's value pretraining (coverage given) with a spy on what the engine does meanwhile."""
    import megatron_s3ac.trainer.stages.value_pretrain as V
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.stages.pipeline import Pipeline

    seen = {}
    real = V.value_pretrain

    def spy(tr, rows, log=None):
        seen["engine_asleep"] = tr.engine._is_asleep()
        return real(tr, rows, log=log)

    V.value_pretrain = spy
    p = Pipeline(load_config(None, over))
    res = p.run()
    seen["status"] = res["value_pretrain"]["status"]
    seen["engine_awake_after"] = not p.tr.engine._is_asleep()
    p.tr.close()
    return seen


def test_value_pretraining_builds_no_third_model_beside_an_awake_engine(tmp_path):
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from megatron_s3ac.models.tiny_models import char_tokenizer
    from megatron_s3ac.data.prompts import ARITH_CHARS
    from megatron_s3ac.tasks.arithmetic import tiny_arithmetic_hf_config

    hf = str(tmp_path / "hf")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_arithmetic_hf_config()).save_pretrained(hf)
    char_tokenizer(ARITH_CHARS).save_pretrained(hf)
    cov = tmp_path / "coverage.jsonl"
    cov.write_text("".join(json.dumps({"prompt_ids": [4, 5, 6], "response_ids": [7, 8], "reward": r}) + "\n"
                           for r in (1.0, -1.0, 1.0, -1.0)))
    over = [o for o in CFG if not o.startswith(("model.tiny", "train.offload_idle", "rollout.reward"))] + [
        f"model.hf_config={hf}", "rollout.engine=cpu", f"value_pretrain.coverage_path={cov}",
        "value_pretrain.epochs=1", "value_pretrain.batch_size=4", "pipeline.stop_after=value_pretrain",
        f"train.out_dir={tmp_path / 'run'}"]
    seen = run_distributed(_vpt, 1, over, timeout=300)[0]
    assert seen["status"] == "ran"
    assert seen["engine_asleep"], "value pretraining built its critic copy beside an awake colocated engine"
    assert seen["engine_awake_after"]  # and the engine was woken, refilled, for the RL stage

"""Trainer: config validation, a few-step end-to-end run at world size 2 (EP=2 and TP=2), value
pretraining freezing, NaN-skip, critic LR/epochs, atomic checkpoints, resume after kill -9."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_s3ac.rollout.rewards import register_reward
from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["model.tiny=arithmetic_moe", "rollout.prompts_per_step=8", "rollout.k=4", "rollout.max_new_tokens=4",
         "data.num_prompts=200", "data.eval_prompts=16", "algo.actor_minibatches=4", "algo.critic_minibatches=4",
         "daps.warmup_steps=0", "daps.rampup_steps=1", "train.progress=false", "train.tensorboard=false"]


@register_reward("test_char_parity", isolate=False)
def char_parity(response: str, reference: str) -> float:
    """A test reward that varies on an untrained model's output (the arithmetic reward is -1 almost
    everywhere, which gives critic-free baselines zero advantages and no update at all)."""
    return 1.0 if sum(map(ord, response)) % 2 else -1.0


def capture_batches(tr) -> list:
    """Test seam: the typed RolloutBatch of every step, after its advantages phase (old_logp,
    old_values, adv, returns filled), by wrapping the phase on this Trainer instance."""
    seen, real = [], tr.advantages

    def spy(batch):
        m = real(batch)
        seen.append(batch)
        return m

    tr.advantages = spy
    return seen


# ---- config validation (no ranks) ------------------------------------------------------------
@pytest.mark.parametrize("overrides,msg", [
    (["algo.name=ppo"], r"algo.name: unknown algorithm 'ppo'; registered: \['flash_reinforce', 'grpo_x'"),
    (["algo.policy_loss=ppo"], r"algo.policy_loss: unknown policy loss 'ppo'; registered: \['cispo', 'dppo_tv'"),
    (["algo.name=grpo_x", "rollout.k=1"], "grpo_x needs rollout.k >= 2"),
    (["algo.critic_epochs=0"], "algo.critic_epochs=0 must be >= 1"),
    (["algo.dual_clip_c=1.0"], "algo.dual_clip_c=1.0 must be > 1"),
    (["rollout.placement=far"], r"rollout.placement: Invalid value 'far', expected one of \[colocated, separate\]$"),
    (["data.task=chess"], r"data.task: Invalid value 'chess', expected one of \[arithmetic, multistep, chain, math\]$"),
    (["cluster.gpus=0", "cluster.gpu_mem_gib=-1"], r"cluster.gpus=0 must be > 0\n  - cluster.gpu_mem_gib=-1.0 must be > 0"),
    (["demo.coverage_k=0"], "demo.coverage_k=0 must be >= 1"),
    (["rollout.reward=nope"], "unknown reward 'nope'"),
    (["data.task=math", "model.tiny=null", "model.hf_config=/nonexistent"], "data.path=None does not exist"),
    (["model.tiny=null"], "set exactly one of model.tiny and model.hf_config"),
    (["algo.icepop_low=2.0"], "icepop_low/high"),
    (["algo.actor_lr=abc"], "actor_lr"),
    (["algo.no_such_key=1"], "no_such_key"),
    (["notakeyvalue"], "key=value"),
])
def test_config_errors(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, SMALL + overrides)


def test_config_layout_checked_against_model():
    from megatron_s3ac.config import validate

    cfg = load_config(None, SMALL + ["actor_layout.ep=3"])
    with pytest.raises(ConfigError, match="num_experts 4 is not divisible by ep 3"):
        validate(cfg, world_size=3)


def test_example_configs_validate():
    for name in ("cpu_demo.yaml", "cpu_demo_grpo.yaml", "cpu_demo_chain.yaml"):
        load_config(os.path.join(ROOT, "examples", name))


def test_gpu_example_configs_match_the_schema():
    """The cluster configs name model paths that do not exist here; their keys and types must still
    be the trainer's (an unknown or misspelled key fails the merge)."""
    import glob

    from omegaconf import OmegaConf

    from megatron_s3ac.config import Config

    paths = glob.glob(os.path.join(ROOT, "examples", "*", "*.yaml"))
    assert len(paths) >= 6
    for p in paths:
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(p)))


# ---- end to end on 2 ranks ---------------------------------------------------------------------
def _e2e(overrides, out_dir):
    from megatron_s3ac.trainer.step.trainer import Trainer

    # a random model gets (almost) no rewards: without the group filter every step updates
    cfg = load_config(None, SMALL + ["algo.dynamic_sampling=false"] + overrides + [f"train.out_dir={out_dir}"])
    tr = Trainer(cfg)
    init = [p.detach().clone() for p in tr.actor.parameters()]
    res = {"steps": [tr.step() for _ in range(2)]}
    res["trained"] = any(not torch.equal(a, b) for a, b in zip(init, tr.actor.parameters()))
    if tr.critic_opt is not None:
        res["lr"] = (tr.actor_opt.param_groups[0]["lr"], tr.critic_opt.param_groups[0]["lr"])
    # a non-finite loss skips the optimizer step and leaves the weights unchanged
    before = [p.detach().clone() for p in tr.actor.parameters()]
    real = tr._actor_loss

    def nan_loss(mb, logits):
        loss, n, met = real(mb, logits)
        loss = loss * float("nan")
        met["loss_sum"] = loss.detach()
        return loss, n, met

    tr._actor_loss = nan_loss
    if tr.critic is not None:
        tr._critic_loss = lambda mb, v, _f=tr._critic_loss: (lambda l, n, m: (l * float("inf"), n, dict(m, loss_sum=l.detach() * float("inf"))))(*_f(mb, v))
    res["nan_step"] = tr.step()
    res["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, tr.actor.parameters()))
    return res


@pytest.mark.parametrize("layout", [["actor_layout.ep=2"], ["actor_layout.tp=2", "algo.policy_loss=ppo_clip"]],
                         ids=["ep2", "tp2-ppo_clip"])
def test_s3ac_few_steps_world2(layout, tmp_path):
    r0 = run_distributed(_e2e, 2, layout, str(tmp_path))[0]
    # the policy loss is the registered one named by algo.policy_loss (default: CISPO's metrics)
    only = "actor/clip_frac_dual" if "algo.policy_loss=ppo_clip" in layout else "actor/clip_frac_high"
    assert all(only in m for m in r0["steps"])
    assert r0["trained"]
    for m in r0["steps"]:  # no group filter (_e2e): every step trains both models
        assert m["mismatch/train_rollout_kl"] == pytest.approx(0.0, abs=1e-5)  # weight sync is exact
        assert m["rollout/response_len"] > 0
        assert m["actor/opt_steps"] >= 1
        assert m["critic/opt_steps"] == 2 * 4  # critic: epochs x mini-batches optimizer steps
        checked = [k for k in m if k.startswith(("actor/grad_norm", "critic/value_loss"))]
        assert len(checked) >= 2 and all(math.isfinite(m[k]) for k in checked)
    actor_lr, critic_lr = r0["lr"]
    assert critic_lr == pytest.approx(5 * actor_lr)
    nan = r0["nan_step"]
    assert nan["actor/opt_steps"] == 0 and nan["actor/skipped_minibatches"] > 0
    assert nan["critic/opt_steps"] == 0 and nan["critic/skipped_minibatches"] > 0
    assert nan["skipped_steps_total"] == 1
    assert r0["unchanged"]


@pytest.mark.parametrize("algo", ["grpo_x", "reinforce_pp", "flash_reinforce"])
def test_baselines_run(algo, tmp_path):
    k = ["rollout.k=1", "algo.actor_minibatches=2"] if algo != "grpo_x" else []
    r0 = run_distributed(_e2e, 2, ["actor_layout.ep=2", f"algo.name={algo}", "daps.enabled=false",
                                   "rollout.reward=test_char_parity"] + k, str(tmp_path))[0]
    assert all(0 < m["rollout/pass_rate"] < 1 for m in r0["steps"])  # varied rewards: nonzero advantages
    assert all("critic/opt_steps" not in m and m["actor/opt_steps"] >= 1 for m in r0["steps"])
    assert r0["trained"]  # the baseline's updates changed the actor
    assert r0["unchanged"]  # and a non-finite loss did not


# ---- value pretraining ---------------------------------------------------------------------------
def _vpt(out_dir):
    from megatron_s3ac.trainer.step.trainer import Trainer
    from megatron_s3ac.trainer.stages.value_pretrain import value_pretrain

    cfg = load_config(None, SMALL + ["actor_layout.ep=2", f"train.out_dir={out_dir}", "value_pretrain.batch_size=8"])
    tr = Trainer(cfg)
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt_ids": p.ids, "response_ids": torch.randint(3, 15, (3,), generator=g).tolist(),
             "reward": float(i % 2 * 2 - 1)} for i, p in enumerate(tr.prompts[:32])]
    before = {n: p.detach().clone() for n, p in tr.critic.named_parameters()}
    hist = []
    summary = value_pretrain(tr, rows, log=hist.append)
    frozen_kinds = (".self_attention.", ".input_layernorm.", ".mlp.router.")
    changed = {n: not torch.equal(before[n], p) for n, p in tr.critic.named_parameters()}
    return summary, changed, frozen_kinds, hist


def test_value_pretrain_freezes_attention_and_router(tmp_path):
    summary, changed, kinds, hist = run_distributed(_vpt, 2, str(tmp_path))[0]
    assert summary["vpt/steps"] == 2 * 4  # 2 epochs x 32 rows / batch 8
    assert summary["vpt/frozen_params"] > 0
    frozen = [n for n in changed if any(k in "." + n for k in kinds)]
    assert len(frozen) >= 3  # attention, its pre-norm and the router, per layer
    assert not [n for n in frozen if changed[n]], "frozen parameters changed"
    assert changed["module.output_layer.weight"] if "module.output_layer.weight" in changed else changed["output_layer.weight"]
    assert any(c for n, c in changed.items() if ".experts." in n)
    assert len(hist) == summary["vpt/steps"]
    for m in hist:
        assert 0 <= m["vpt/head_sq_share"] <= 1 and m["vpt/clipped"] in (0.0, 1.0)
        assert math.isfinite(m["vpt/value_loss"]) and math.isfinite(m["vpt/grad_norm"])


# ---- checkpoints -------------------------------------------------------------------------------
def test_latest_checkpoint_ignores_partial_saves(tmp_path):
    from megatron_s3ac.trainer.run.checkpoint import latest_checkpoint

    root = tmp_path / "checkpoints"
    (root / "step_000002").mkdir(parents=True)
    (root / "step_000002" / "COMPLETE").touch()
    (root / "step_000004.tmp").mkdir()  # killed during save: never renamed
    (root / "step_000006").mkdir()  # no COMPLETE marker
    assert latest_checkpoint(str(tmp_path)) == str(root / "step_000002")


def _torchrun(args, env_extra=None, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_s3ac.trainer.cli", "train"] + args
    # output to a file, not a pipe: helper processes that dist_checkpointing spawned can outlive a
    # killed rank and would keep a pipe open
    out = next(a.split("=", 1)[1] for a in args if a.startswith("train.out_dir="))
    log = out + f".{int(bool(env_extra))}.{len(os.listdir(os.path.dirname(out)))}.log"
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    r.stderr = open(log).read()
    return r


def _metrics(d):
    with open(os.path.join(d, "metrics.jsonl")) as f:
        rows = [json.loads(l) for l in f]
    drop = ("time/",)
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]


@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted(tmp_path):
    common = SMALL + ["actor_layout.ep=2", "train.steps=4", "train.save_every=2", "train.eval_every=0"]
    a, b = tmp_path / "a", tmp_path / "b"
    r = _torchrun(common + [f"train.out_dir={a}"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = _torchrun(common + [f"train.out_dir={b}"], {"S3AC_TESTING_FAIL_AT_STEP": "3"})
    assert r.returncode != 0  # died after step 3, checkpoint of step 2 on disk
    assert os.path.exists(b / "checkpoints" / "step_000002" / "COMPLETE")
    r = _torchrun(common + [f"train.out_dir={b}"])
    assert r.returncode == 0, r.stderr[-3000:]
    ma, mb = _metrics(a), _metrics(b)
    assert [m["step"] for m in mb] == [0, 1, 2, 3]
    assert ma == mb


# ---- R3: routing replay in the trainer (EP=2) ----------------------------------------------------
def _r3(out_dir, extra=()):
    import numpy as np

    from megatron_s3ac.trainer.step.trainer import Trainer

    cfg = load_config(None, SMALL + ["actor_layout.ep=2", "algo.name=grpo_x", "daps.enabled=false",
                                     "algo.dynamic_sampling=false", f"train.out_dir={out_dir}", *extra])
    tr = Trainer(cfg)
    res = {"r3_on": tr.r3_on, "moe_layers": list(tr._moe_layers)}
    seen = capture_batches(tr)
    m = tr.step()
    b = seen[-1]
    res["faithful"] = {k: v for k, v in m.items() if k.startswith(("r3/", "mismatch/"))}
    res["max_gap"] = float(((b.old_logp - b.rollout_logp).abs() * b.mask).max())
    res["routes_rows"] = [int(np.asarray(r).shape[0]) for r in b.routes]
    res["lens"] = (b.prompt_len + b.resp_len).tolist()
    # corrupt the rollout routes (rank 0 holds the samples and sends each rank its rows, so every rank
    # gets the corruption): with replay active the trainer must follow them, so its log-probs leave the engine's
    real = tr.rollout

    def scrambled(pids, round_idx=0, ready=None):
        out = real(pids, round_idx, ready)
        for s in out.samples:
            if s.get("routes") is not None:  # rank 0 (elsewhere: metadata only)
                s["routes"] = (np.asarray(s["routes"]).astype(np.int64) + 1) % 4  # another expert pair, still distinct
        return out

    tr.rollout = scrambled
    m = tr.step()
    b = seen[-1]
    res["scrambled"] = {k: v for k, v in m.items() if k.startswith(("r3/", "mismatch/"))}
    res["scrambled_max_gap"] = float(((b.old_logp - b.rollout_logp).abs() * b.mask).max())
    return res


def test_r3_replays_engine_routes_world2(tmp_path):
    r0 = run_distributed(_r3, 2, str(tmp_path))[0]
    assert r0["r3_on"] and r0["moe_layers"] == [0, 1]  # auto: on for the MoE model, every MoE layer
    assert r0["routes_rows"] == [n - 1 for n in r0["lens"]]  # the engine's routed experts travel with samples
    f = r0["faithful"]
    assert f["r3/agreement"] == pytest.approx(1.0)  # same weights: native top-k == rollout routes
    assert r0["max_gap"] < 1e-5 and f["r3/logprob_abs_diff"] < 1e-5  # fp32: old log-probs == engine's
    s = r0["scrambled"]
    assert s["r3/agreement"] < 0.5  # native routing no longer matches the (corrupted) rollout routes
    assert r0["scrambled_max_gap"] > 1e-3  # replay is active: the trainer followed the given routes
    assert s["r3/native_logprob_abs_diff"] < 1e-5 < s["r3/logprob_abs_diff"]


def test_r3_config_refusals():
    from megatron_s3ac.config import validate
    from megatron_s3ac.trainer.step.trainer import _r3_setting  # noqa: F401 (train.r3 -> R3 switch)

    with pytest.raises(ConfigError, match="train.r3"):
        load_config(None, SMALL + ["train.r3=sometimes"])
    cfg = load_config(None, SMALL + ["train.r3=off"])
    from megatron_s3ac.config import model_info_for

    assert _r3_setting(cfg, model_info_for(cfg))[1] is False
    cfg = load_config(None, SMALL)
    assert _r3_setting(cfg, model_info_for(cfg))[1] is True  # auto -> on for MoE

    class Dense:
        is_moe, model_type = False, "qwen3"

    cfg = load_config(None, SMALL + ["train.r3=on"])
    with pytest.raises(ConfigError, match="no MoE layers"):
        _r3_setting(cfg, Dense())
    validate(cfg)


# ---- periodic evaluation ----------------------------------------------------------------------
def _eval_vs_no_eval(out_dir):
    from megatron_s3ac.trainer.run.train_loop import train_loop
    from megatron_s3ac.trainer.step.trainer import Trainer

    common = SMALL + ["actor_layout.ep=2", "train.steps=3", "algo.dynamic_sampling=false"]
    runs = {}
    for name, extra in (("eval", ["train.eval_every=1", "train.save_every=1", "train.keep_last=1", "eval.k=2"]),
                        ("plain", ["train.eval_every=0"])):
        cfg = load_config(None, common + extra + [f"train.out_dir={out_dir}/{name}"])
        tr = Trainer(cfg)
        train_loop(tr)
        runs[name] = tr.evaluator.history if tr.evaluator is not None else None
        tr.close()
    return runs


@pytest.mark.slow  # > 25 s on 2 cores; the fast suite's 20-minute budget (CI); make test-all runs it
def test_eval_mid_training_leaves_training_identical_world2(tmp_path):
    from megatron_s3ac.trainer.run.plotting import plot_run

    history = run_distributed(_eval_vs_no_eval, 2, str(tmp_path))[0]
    with_eval, plain = _metrics(tmp_path / "eval"), _metrics(tmp_path / "plain")
    assert all("eval/heldout/avg@2" in m and "eval/heldout/greedy" in m and "eval/average" in m for m in with_eval)
    strip = lambda ms: [{k: v for k, v in m.items() if not k.startswith("eval/")} for m in ms]  # noqa: E731
    assert strip(with_eval) == plain  # same seed: evaluation changed no training number
    # the best evaluated checkpoint survives keep_last=1, and BEST names it
    steps, avg = zip(*history["eval"])
    best = steps[max(range(len(avg)), key=lambda i: (avg[i], -i))]
    ck = tmp_path / "eval" / "checkpoints"
    assert (ck / "BEST").read_text().strip() == f"step_{best:06d}"
    assert sorted(os.listdir(ck)) == sorted({"BEST", f"step_{best:06d}", "step_000003"})
    assert os.path.exists(tmp_path / "eval" / "eval" / "eval_step3.json")
    pngs = plot_run(str(tmp_path / "eval"))
    assert any(p.endswith("eval.png") for p in pngs)


def _mini_demo(out_dir):
    from megatron_s3ac.trainer.stages.demo import run_demo

    cfg = load_config(os.path.join(ROOT, "examples", "cpu_demo.yaml"), [
        "rollout.prompts_per_step=16", "rollout.k=4", "data.num_prompts=300", "data.eval_prompts=24",
        "demo.warmup_max_steps=40", "demo.warmup_eval_every=20", "demo.target_pass_rate=1.0",
        "demo.coverage_prompts=16", "demo.coverage_k=2", "demo.coverage_checkpoints=2", "value_pretrain.batch_size=16",
        "train.steps=2", "train.eval_every=1", "eval.k=3", "eval.batch_size=16", "train.progress=false",
        "train.tensorboard=false",
        f"train.out_dir={out_dir}"])
    return run_demo(cfg)


@pytest.mark.slow  # > 25 s on 2 cores; the fast suite's 20-minute budget (CI); make test-all runs it
def test_standalone_eval_reproduces_demo_pass_rates_world2(tmp_path):
    """Issue 8: evaluating the saved warm-up and trained models with the eval package on a fresh engine
    gives exactly the before/after pass rates the demo reports (and the trainer's periodic eval logs)."""
    from megatron_s3ac.eval.runner import BenchmarkSpec, evaluate
    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
    from megatron_s3ac.data.prompts import CharVocab

    res = run_distributed(_mini_demo, 2, str(tmp_path))[0]
    e = res["eval"]
    bench = {"heldout": BenchmarkSpec(e["set"], reward="arithmetic")}
    for when in ("before", "after"):
        engine = CPUEngine.from_pretrained(e["models"][when], tokenizer=None)
        # same seed and batch size: the sampling seeds are per (seed, set, batch index)
        greedy = evaluate(engine, CharVocab(), bench, k=1, seed=e["seed"], batch_size=e["batch_size"],
                          params=SamplingParams(temperature=0.0, max_new_tokens=e["max_new_tokens"]))
        sampled = evaluate(engine, CharVocab(), bench, k=e["sampled_k"], seed=e["seed"], batch_size=e["batch_size"],
                           params=SamplingParams(temperature=e["sampled_temperature"], max_new_tokens=e["max_new_tokens"]))
        assert greedy["benchmarks"]["heldout"]["avg_at_k"] == res[when]["greedy"]
        assert sampled["benchmarks"]["heldout"]["avg_at_k"] == res[when]["sampled"]
    last = _metrics(tmp_path)[-1]  # the periodic evaluation after the last step saw the same model
    assert last["eval/heldout/greedy"] == res["after"]["greedy"]
    assert last["eval/heldout/avg@3"] == res["after"]["sampled"]


def test_fault_seam_exits_at_the_named_step_only():
    code = ("from megatron_s3ac import faults; faults.after_step(2); print('after 2', flush=True); "
            "faults.after_step(3); print('after 3', flush=True)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, S3AC_TESTING_FAIL_AT_STEP="3"))
    assert r.returncode == 9 and r.stdout.split("\n")[:2] == ["after 2", ""]
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "S3AC_TESTING_FAIL_AT_STEP"})
    assert r.returncode == 0 and "after 3" in r.stdout  # unset: no effect

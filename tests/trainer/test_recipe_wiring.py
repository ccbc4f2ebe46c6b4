"""Issue 17's switches in the trainer: DAPO refill (bounded), the entropy-control hook, a fixed actor
lambda, the value-head init std, and the multistep task; config refusals in-process, the rest on 2
gloo ranks with a coin-flip reward (so groups are informative without a trained model)."""
import math
import zlib

import pytest
import torch

from megatron_s3ac import algorithms as A
from megatron_s3ac.rollout.rewards import register_reward
from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.config import ConfigError, load_config

COIN = "test_recipe_coin"
BASE = ["model.tiny=arithmetic_moe", "rollout.prompts_per_step=8", "rollout.k=4", "rollout.max_new_tokens=4",
        "data.num_prompts=200", "data.eval_prompts=16", "algo.actor_minibatches=4", "algo.critic_minibatches=4",
        "daps.enabled=false", "train.progress=false", "train.tensorboard=false", "train.eval_every=0"]


@register_reward(COIN, isolate=False)
def coin(response: str, reference: str) -> float:
    """+1 / -1 by a hash of the response: about half right, deterministic."""
    return 1.0 if zlib.crc32(response.encode()) % 2 else -1.0


@pytest.mark.parametrize("overrides,msg", [
    (["data.task=multistep"], "scored by rollout.reward=multistep"),
    (["algo.entropy_control=nope"], "unknown entropy control 'nope'"),
    (["algo.entropy_control=gepo_candidate", "algo.entropy_control_params={bogus: 1}"], "bogus"),
    (["algo.entropy_control=gepo_candidate", "rollout.k=1", "algo.actor_minibatches=1"], "needs rollout.k >= 2"),
    (["algo.actor_lambda=1.5"], "algo.actor_lambda=1.5 must be in"),
    (["model.value_head_init_std=0"], "value_head_init_std"),
    (["algo.dynamic_sampling_refill=true", "algo.dynamic_sampling=false"], "needs the group filter"),
    (["algo.refill_max_factor=0.5"], "refill_max_factor"),
    (["data.task=multistep", "rollout.reward=multistep", "data.ops=x"], "ops must be"),
    (["data.task=chain"], "scored by rollout.reward=chain"),
    (["data.task=chain", "rollout.reward=chain", "data.chain=mul"], "chain kind must be one of"),
    (["data.task=chain", "rollout.reward=chain", "data.min_len=9", "data.max_len=8"], "min_len <= max_len"),
])
def test_config_refusals(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, BASE + overrides)


def _refill_run(out_dir):
    from megatron_s3ac.trainer.step.trainer import Trainer

    cfg = load_config(None, BASE + [f"rollout.reward={COIN}", "algo.dynamic_sampling_refill=true",
                                    "algo.refill_max_factor=2", "algo.entropy_control=gepo_candidate",
                                    "algo.entropy_control_params={tau: 0.0, attenuation: 0.5}",
                                    "algo.actor_lambda=0.95", "model.value_head_init_std=0.01",
                                    f"train.out_dir={out_dir}"])
    tr = Trainer(cfg)
    head = tr.critic.module.output_layer
    res = {"head": (head.weight.detach().clone(), head.bias.detach().clone())}
    seen, real = [], tr.advantages

    def spy(batch):
        m = real(batch)
        seen.append((batch.adv.clone(), batch.old_values.clone(), batch.scores.clone(), batch.mask.clone(),
                     batch.global_len()))  # this rank's shard of the step's batch (whole groups here)
        return m

    tr.advantages = spy
    res["steps"] = [tr.step() for _ in range(2)]
    res["seen"] = seen
    return res


def test_refill_entropy_hook_lambda_and_head_init_world2(tmp_path):
    r0 = run_distributed(_refill_run, 2, str(tmp_path))[0]
    w, b = r0["head"]  # N(0, 0.01^2) from the documented generator, bias 0
    g = torch.Generator().manual_seed(1234 + 31)
    assert torch.equal(w, (torch.randn(tuple(w.shape), generator=g, dtype=torch.float64) * 0.01).to(w.dtype))
    assert torch.count_nonzero(b) == 0
    for m, (adv, values, scores, mask, n) in zip(r0["steps"], r0["seen"]):
        # refill: the step trains on exactly prompts_per_step informative groups, drawn within 2 x 8
        assert m["refill/reached_target"] == 1.0 and m["filter/kept_groups"] == 8 and n == 8 * 4
        assert 8 <= m["refill/drawn_groups"] <= 16
        assert m["refill/drawn_groups"] == 8 + m["filter/discarded_groups"] + m["refill/surplus_groups"]
        assert m["filter/discarded_trajectories"] == 4 * m["filter/discarded_groups"]
        groups = scores.reshape(-1, 4)
        assert bool(((groups.max(1).values - groups.min(1).values) > 0).all())  # only informative groups
        assert "entropy_control/group_entropy_mean" in m
    # step 0: the hook is still in warm-up (no statistics yet), so adv is plain GAE with lambda 0.95
    adv, values, scores, mask, _ = r0["seen"][0]
    ref, _ = A.compute_gae(A.terminal_rewards(scores, mask), values.clamp(-1, 1), mask, lam=0.95)
    assert torch.allclose(adv, ref, atol=1e-6)
    assert r0["steps"][0]["entropy_control/low_groups"] == 0
    # step 1: tau = 0 splits groups at the running mean: some are shaped
    m1 = r0["steps"][1]
    assert m1["entropy_control/low_groups"] + m1["entropy_control/high_groups"] > 0


def _multistep_run(out_dir):
    from megatron_s3ac.trainer.step.trainer import Trainer

    cfg = load_config(None, BASE + ["data.task=multistep", "rollout.reward=multistep", "rollout.max_new_tokens=16",
                                    "data.min_operands=3", "data.max_operands=4", "algo.dynamic_sampling_refill=true",
                                    "algo.refill_max_factor=1.5", f"train.out_dir={out_dir}"])
    tr = Trainer(cfg)
    res = {"vocab": tr.info.vocab_size, "prompt": tr.prompts[0].text, "ref": tr.prompts[0].reference,
           "n_eval": len(tr.eval_prompts)}
    res["step"] = tr.step()
    return res


def test_multistep_task_trains_world2(tmp_path):
    """The multistep task builds its vocabulary (17 ids), prompts and model; a random model earns no
    reward, so refill draws its whole budget (floor(1.5 x 8) = 12 groups) and the step is empty."""
    from megatron_s3ac.tasks.multistep import multistep_reference

    r0 = run_distributed(_multistep_run, 2, str(tmp_path))[0]
    assert r0["vocab"] == 17 and r0["n_eval"] == 16
    assert r0["ref"] == multistep_reference(r0["prompt"]) and "," in r0["ref"]
    m = r0["step"]
    if m["refill/reached_target"] == 0.0:
        assert m["refill/drawn_groups"] == 12 and m.get("filter/empty_batch", 0) in (0, 1)
    assert m["rollout/response_len"] > 0 and math.isfinite(m["rollout/reward_mean"])


def _chain_run(out_dir):
    from megatron_s3ac.trainer.step.trainer import Trainer

    cfg = load_config(None, BASE + ["data.task=chain", "rollout.reward=chain", "data.chain=add", "data.min_len=6",
                                    "data.max_len=7", "rollout.max_new_tokens=15", "actor_layout.ep=1",
                                    f"train.out_dir={out_dir}"])
    tr = Trainer(cfg)
    res = {"vocab": tr.info.vocab_size, "pos": tr.info.hf.get("max_position_embeddings"),
           "prompts": [(p.text, p.reference) for p in tr.prompts[:20]], "n_eval": len(tr.eval_prompts)}
    res["step"] = tr.step()
    tr.close()
    return res


def test_chain_task_builds_and_steps(tmp_path):
    """The chain task builds its vocabulary (16 ids), prompts whose references are the chain, and a model
    with room for prompt + answer; a random model's rollouts are scored by the chain reward (all wrong)."""
    from megatron_s3ac.tasks.chain import chain_answer

    r0 = run_distributed(_chain_run, 1, str(tmp_path))[0]
    assert r0["vocab"] == 16 and r0["n_eval"] == 16 and r0["pos"] >= 1 + 16 + 15
    for text, ref in r0["prompts"]:
        assert ref == chain_answer("add", text) and len(ref) in (12, 14)
    m = r0["step"]
    assert m["rollout/response_len"] > 0 and m["rollout/reward_mean"] == -1.0

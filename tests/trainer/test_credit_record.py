"""train.credit_every: the trainer writes each step's per-token advantages, rewards and V(s0) to
credit.jsonl (trainer/step/credit_record.py). Checked against hand formulas: GRPO-X's advantage is the
group-normalised reward on every token; S3AC's V(s0) is the critic's value of the prompt alone
(Trainer.critic_v0 before the step's update). One gloo rank, a coin-flip reward (informative groups)."""
import json
import math
import os
import zlib
from collections import defaultdict

import pytest

from megatron_s3ac.rollout.rewards import register_reward
from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.config import ConfigError, load_config

COIN = "test_credit_coin"
BASE = ["model.tiny=arithmetic_moe", "rollout.prompts_per_step=4", "rollout.k=4", "rollout.max_new_tokens=4",
        "data.num_prompts=64", "data.eval_prompts=8", "algo.actor_minibatches=2", "algo.critic_minibatches=2",
        "daps.enabled=false", "train.progress=false", "train.tensorboard=false", "train.eval_every=0",
        f"rollout.reward={COIN}", "train.credit_every=1", "actor_layout.ep=1"]


@register_reward(COIN, isolate=False)
def coin(response: str, reference: str) -> float:
    return 1.0 if zlib.crc32(response.encode()) % 2 else -1.0


def _run(out_dir, algo):
    import torch

    from megatron_s3ac.trainer.step.trainer import Trainer

    cfg = load_config(None, BASE + [f"algo.name={algo}", f"train.out_dir={out_dir}"])
    tr = Trainer(cfg)
    v0 = None
    if tr.uses_critic:
        v0 = tr.critic_v0(torch.arange(len(tr.prompts))).tolist()  # the critic before any update
    tr.step()
    tr.step()
    tr.close()
    return {"v0": v0}


def _rows(out_dir):
    return [json.loads(ln) for ln in open(os.path.join(out_dir, "credit.jsonl"))]


def test_grpo_x_records_the_group_normalised_reward(tmp_path):
    run_distributed(_run, 1, str(tmp_path), "grpo_x")
    rows = _rows(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1] and all(r["v0"] is None and r["k"] == 4 for r in rows)
    for r in rows:
        groups = defaultdict(list)
        for p, s in zip(r["pid"], r["reward"]):
            groups[p].append(s)
        assert r["pid"] and all(len(g) == 4 for g in groups.values())
        for p, s, adv in zip(r["pid"], r["reward"], r["adv"]):
            g = groups[p]
            mean = sum(g) / 4
            std = math.sqrt(sum((x - mean) ** 2 for x in g) / 3)
            want = (s - mean) / (std + 1e-6)
            assert 1 <= len(adv) <= 4 and all(a == pytest.approx(want, abs=2e-4) for a in adv)


def test_s3ac_records_v0_of_the_critic_before_its_update(tmp_path):
    res = run_distributed(_run, 1, str(tmp_path), "s3ac")[0]
    rows = _rows(str(tmp_path))
    first = rows[0]
    assert len(first["v0"]) == len(first["pid"]) == len(first["adv"])
    for p, v in zip(first["pid"], first["v0"]):
        assert v == pytest.approx(res["v0"][p], abs=2e-4)
    # token-level credit: the advantages differ along a response (GAE on the critic's values)
    assert any(len(set(a)) > 1 for a in first["adv"] if len(a) > 1)


def test_negative_credit_every_is_refused():
    with pytest.raises(ConfigError, match="train.credit_every=-1 must be >= 0"):
        load_config(None, BASE + ["train.credit_every=-1"])


def _one_step(out_dir, algo):
    from megatron_s3ac.trainer.step.trainer import Trainer

    cfg = load_config(None, BASE + [f"algo.name={algo}", f"train.out_dir={out_dir}"])
    tr = Trainer(cfg)
    tr.step()
    tr.close()


def test_sharded_gather_at_dp2_records_the_same_rows_as_one_rank(tmp_path):
    """DP = 2 (two gloo ranks, each owning half of the step's rows): credit.jsonl (written by rank 0 after
    gathering every rank's rows, trainer/step/credit_record.py) holds the same rows as the same run at one rank,
    where nothing is gathered. Step 0 only: its rollout comes from the same initial weights and seed at both
    world sizes (later steps follow updates whose DP reductions differ in rounding). S3AC: both the actor's
    rows (advantages, rewards) and the critic's (V(s0)) are gathered."""
    one, two = str(tmp_path / "w1"), str(tmp_path / "w2")
    run_distributed(_one_step, 1, one, "s3ac")
    run_distributed(_one_step, 2, two, "s3ac")
    (a,), (b,) = _rows(one), _rows(two)
    assert a["step"] == b["step"] == 0
    assert a["pid"] == b["pid"] and a["reward"] == b["reward"] and len(a["pid"]) >= 8  # >= 2 groups: both ranks own rows
    assert [len(x) for x in a["adv"]] == [len(x) for x in b["adv"]]
    for x, y in zip(a["adv"], b["adv"]):
        assert x == pytest.approx(y, abs=2e-4)
    assert a["v0"] == pytest.approx(b["v0"], abs=2e-4) and len(b["v0"]) == len(b["pid"])
    assert len(set(b["v0"])) > 1  # the critic's values of distinct prompts, not one rank's rows repeated

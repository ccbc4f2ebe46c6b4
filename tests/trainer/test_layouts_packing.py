"""The trainer's step is the same computation at every parallel layout and micro-batch layout.

All runs start from the same actor and critic weights (layout-free torch_dist checkpoints saved once at
world size 1), so the first step must give the same rollout, old log-probs, values, advantages and
gradient norms whether the actor runs at EP=2 (reference), with sequence packing under a token
budget, at PP=2, or with the critic at its own layout (TP=2 while the actor is at EP=2).
"""
import os

import pytest
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.trainer.step.batch import collate, micro_batches, pack_rows, per_token
from megatron_s3ac.config import load_config
from tests.trainer.test_trainer import SMALL, capture_batches

BASE = SMALL + ["algo.dynamic_sampling=false", "daps.enabled=false", "train.eval_every=0"]
# layout-invariant figures (per-micro-batch averages such as clip fractions depend on the split)
SAME = ("rollout/", "mismatch/train_rollout_kl", "critic/explained_variance", "critic/v0_mean", "adv/",
        "r3/logprob_abs_diff", "r3/agreement")


# ---- pure helpers ------------------------------------------------------------------------------
def test_pack_rows_first_fit_decreasing():
    lengths = [7, 3, 9, 2, 5, 12, 4]
    bins = pack_rows(lengths, budget=10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= 10 or len(b) == 1  # an over-long sample sits alone
    assert [sorted(b) for b in bins] == [[5], [2], [0, 1], [4, 6], [3]]  # FFD by hand: 12 | 9 | 7+3 | 5+4 | 2


def test_packed_micro_batch_layout():
    samples = [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9], "logprobs": [-1.0, -2.0], "reward": 1.0, "pid": 0},
               {"prompt_ids": [4, 4], "response_ids": [3], "logprobs": [-0.5], "reward": -1.0, "pid": 1},
               {"prompt_ids": [1, 2, 3, 4], "response_ids": [5, 6, 7], "logprobs": [-1.0] * 3, "reward": 1.0, "pid": 2}]
    b = collate(samples, pad_to=8)
    rows, real = torch.arange(3), torch.ones(3, dtype=torch.bool)
    (mb,) = micro_batches(b, rows, real, token_budget=16, pad_to=8)  # 5 + 3 + 7 = 15 tokens -> one row of 16
    assert mb.input_ids.shape == (1, 16)
    order = mb.row_ids.tolist()
    seqs = [samples[i]["prompt_ids"] + samples[i]["response_ids"] for i in order]
    flat = [t for s in seqs for t in s]
    assert mb.input_ids[0, :15].tolist() == flat
    # positions restart per sample; a token sees only its own sample's earlier tokens
    starts = [0]
    for s in seqs[:-1]:
        starts.append(starts[-1] + len(s))
    for a, s in zip(starts, seqs):
        assert mb.position_ids[0, a:a + len(s)].tolist() == list(range(len(s)))
        blk = mb.attention_mask[0, 0, a:a + len(s)]
        visible = (~blk).nonzero()[:, 1]
        assert visible.min() >= a and visible.max() < a + len(s)
        assert torch.equal(~blk[:, a:a + len(s)], torch.ones(len(s), len(s), dtype=torch.bool).tril())
    # per_token maps any per-position output back to [n, T]: position p predicts token p + 1
    out = mb.input_ids.roll(-1, dims=1).float()
    got = per_token(out, mb)
    for j, i in enumerate(order):
        r = len(samples[i]["response_ids"])
        assert got[j, :r].tolist() == [float(t) for t in samples[i]["response_ids"]]
    # padded micro-batches give the same per-token view
    (pmb,) = micro_batches(b, rows, real, mbs=0, pad_to=8)
    assert torch.equal(per_token(pmb.input_ids.roll(-1, dims=1).float(), pmb) * pmb.mask,
                       (got * mb.mask)[torch.argsort(mb.row_ids)])


def test_typed_batch_select_and_typos():
    samples = [{"prompt_ids": [5, 6], "response_ids": [8, 9, 7][: i + 1], "logprobs": [-1.0] * (i + 1),
                "reward": float(i), "pid": 10 + i, "routes": f"r{i}"} for i in range(3)]
    b = collate(samples, pad_to=8)
    b.adv = torch.arange(3.0)
    sub = b.select(torch.tensor([2, 0]))
    assert sub.pid.tolist() == [12, 10] and sub.routes == ["r2", "r0"] and sub.adv.tolist() == [2.0, 0.0]
    assert torch.equal(sub.mask, b.mask[[2, 0]]) and sub.old_logp is None
    with pytest.raises(AttributeError):
        b.scroes  # noqa: B018 - a misspelt field is an error, not a silent missing key
    (mb,) = micro_batches(b, torch.tensor([1, 2]), torch.tensor([True, False]), pad_to=8)
    assert mb.mask[1].sum() == 0 and mb["input_ids"] is mb.input_ids and mb.get("position_ids") is None
    with pytest.raises(AttributeError):
        mb["inputs_ids"]


# ---- one trainer step at several layouts (2 gloo ranks) ------------------------------------------
def _save_init(out_dir, actor_dir, critic_dir):
    from megatron.core import dist_checkpointing

    from megatron_s3ac.trainer.step.trainer import Trainer

    tr = Trainer(load_config(None, BASE + [f"train.out_dir={out_dir}"]))
    for d, m in ((actor_dir, tr.actor), (critic_dir, tr.critic)):
        os.makedirs(d, exist_ok=True)
        dist_checkpointing.save(m.sharded_state_dict(), d)


def _one_step(overrides, out_dir):
    from megatron_s3ac.trainer.step.trainer import Trainer

    tr = Trainer(load_config(None, BASE + overrides + [f"train.out_dir={out_dir}"]))
    seen = capture_batches(tr)
    m = tr.step()
    (b,) = seen
    # this rank's shard: each rank holds only its own rows (gid) and the values of the rows it owns
    sh = b.shard
    return {"m": m, "gid": sh.gid, "actor_rows": sh.owned["actor"], "critic_rows": sh.owned["critic"],
            "n": sh.n_global, "old_logp": b.old_logp, "values": b.old_values, "mask": b.mask, "pad_to": tr.pad_to}


def _whole(per_rank, key, rows_key):
    """The whole batch's [N, T] tensor from every rank's own rows; every row covered."""
    n = per_rank[0]["n"]
    full, seen = torch.zeros(n, per_rank[0][key].shape[1]), torch.zeros(n, dtype=torch.bool)
    for r in per_rank:
        own = r[rows_key]
        full[r["gid"][own]] = r[key][own] * r["mask"][own]
        seen[r["gid"][own]] = True
    assert seen.all(), "some rows were owned by no rank"
    return full


@pytest.fixture(scope="module")
def init_ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("init")
    run_distributed(_save_init, 1, str(d / "run"), str(d / "actor"), str(d / "critic"))
    return [f"model.actor_init={d / 'actor'}", f"model.critic_init={d / 'critic'}"]


@pytest.fixture(scope="module")
def reference(init_ckpts, tmp_path_factory):
    return run_distributed(_one_step, 2, init_ckpts + ["actor_layout.ep=2"], str(tmp_path_factory.mktemp("ref")))


def _assert_same_step(got, ref):
    # each rank holds its own rows (sharded data flow): compare the whole batch assembled from its owners
    for key, rows in (("old_logp", "actor_rows"), ("values", "critic_rows")):
        g, r = _whole(got, key, rows), _whole(ref, key, rows)
        assert r.abs().sum() > 0
        torch.testing.assert_close(g, r, atol=2e-5, rtol=0)
    gm, rm = got[0]["m"], ref[0]["m"]
    keys = [k for k in rm if k.startswith(SAME)]
    assert keys and set(keys) <= set(gm), set(keys) - set(gm)
    for k in keys:
        assert gm[k] == pytest.approx(rm[k], rel=1e-4, abs=2e-5, nan_ok=True), k
    for k in ("actor/grad_norm", "critic/grad_norm", "actor/opt_steps", "critic/opt_steps"):
        assert gm[k] == pytest.approx(rm[k], rel=2e-3), k  # Adam steps in between: float noise only
    # token-weighted metric means do not depend on how rows fall into micro-batches or ranks
    for k in ("actor/ratio_mean", "actor/keep_frac", "critic/value_loss_tok", "critic/value_mean"):
        assert gm[k] == pytest.approx(rm[k], rel=1e-3, abs=1e-5), k


@pytest.mark.parametrize("overrides", [
    ["actor_layout.ep=2", "algo.max_tokens_per_micro_batch=24"],
    ["actor_layout.pp=2"],
    ["actor_layout.pp=2", "algo.max_tokens_per_micro_batch=24"],
    ["actor_layout.ep=2", "critic_layout.tp=2"],
    ["actor_layout.ep=2", "actor_layout.cp=2", "critic_layout.cp=2"],
    pytest.param(["actor_layout.ep=2", "actor_layout.cp=2", "algo.max_tokens_per_micro_batch=12"],
                 marks=pytest.mark.slow),
], ids=["ep2-packed", "pp2", "pp2-packed", "actor-ep2-critic-tp2", "cp2", "cp2-packed"])
def test_first_step_is_layout_free(overrides, init_ckpts, reference, tmp_path):
    got = run_distributed(_one_step, 2, init_ckpts + overrides, str(tmp_path))
    if "actor_layout.cp=2" in overrides:  # the sequences really were split: 2 x cp chunks (x 8)
        assert got[0]["pad_to"] == 32
    _assert_same_step(got, reference)

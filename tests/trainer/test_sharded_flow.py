"""The sharded data flow (issue 15): each DP rank receives only its rows (whole groups where the
algorithm needs them) and the R3 routes of its rows cut to its pipeline stage's layers; mini-batches
keep the whole batch's composition; metrics reduced from per-shard sums equal the whole-batch formulas.
The transport runs over real gloo ranks (4 processes, torch.distributed only)."""
import numpy as np
import pytest
import torch

from megatron_s3ac.algorithms.registry import AdvInputs, get_adv_est
from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.trainer.step.batch import collate
from megatron_s3ac.trainer.step.metrics import reduce_sums, s3ac_gae_metric_sums, s3ac_gae_metrics
from megatron_s3ac.trainer.step.sharding import RankRole, RowShard, class_sources, owned_rows, plan_shares


def test_owned_rows_are_contiguous_whole_groups():
    blocks = [owned_rows(24, 4, d, 4) for d in range(4)]
    assert sorted(sum(blocks, [])) == list(range(24))
    assert [len(b) for b in blocks] == [8, 4, 4, 8] or all(len(b) % 4 == 0 for b in blocks)
    for b in blocks:  # whole groups, contiguous
        assert b == list(range(b[0], b[0] + len(b))) and b[0] % 4 == 0 and len(b) % 4 == 0
    assert owned_rows(8, 4, 3, 4) == []  # 2 groups over 4 DP ranks: two ranks own nothing
    with pytest.raises(ValueError, match="not whole groups"):
        owned_rows(10, 4, 0, 2)


def _roles_pp2_dp2():
    """4 ranks, megatron order tp-cp-ep-dp-pp: rank = dp + 2 * pp; stage 0 has MoE layers 0, 1."""
    return [RankRole(r % 2, 2, r % 2, 2, (0, 1) if r < 2 else (2, 3)) for r in range(4)]


def test_plan_classes_and_fillers():
    roles = _roles_pp2_dp2()
    shares = plan_shares(8, 2, roles, routes=True)
    assert shares[0].rows == shares[2].rows == (0, 1, 2, 3) and shares[1].rows == (4, 5, 6, 7)
    assert shares[2].layers == (2, 3) and shares[0].route_rows == (0, 1, 2, 3)
    assert class_sources(roles) == {0: [0, 2], 1: [1, 3]}
    # a DP rank without rows holds row 0 as a filler it does not own (with routes: the actor replays it)
    few = plan_shares(2, 2, roles, routes=True)
    assert few[1].rows == (0,) and few[1].owned["actor"] == () and few[1].route_rows == (0,)
    # critic at its own layout (DP 1 while the actor has DP 2): a rank holds the union of both
    cr = [RankRole(r % 2, 2, 0, 1, ()) for r in range(2)]
    sh = plan_shares(8, 1, cr, routes=False)
    assert sh[1].rows == tuple(range(8)) and sh[1].owned["actor"] == (4, 5, 6, 7) and sh[1].route_rows == ()
    shard = RowShard.of(8, sh, 1)
    assert shard.nested and shard.primary["critic"].sum() == 0 and shard.primary["actor"].sum() == 4


def test_minibatches_keep_their_composition():
    """Over the DP ranks, each mini-batch's rows are exactly the mini-batch (no row twice or lost)."""
    roles = [RankRole(d, 4, d, 4) for d in range(4)]
    shares = plan_shares(32, 4, roles, routes=False)
    shards = [RowShard.of(32, shares, r) for r in range(4)]
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    for mb in perm.tensor_split(5):
        got = []
        for sh in shards:
            pos, real = sh.minibatch_rows(mb, "actor")
            got += sh.gid[pos[real]].tolist()
            assert set(sh.gid[pos[real]].tolist()) <= set(mb.tolist())
        assert sorted(got) == sorted(mb.tolist())
    pos, real = shards[0].minibatch_rows(torch.tensor([31]), "actor")  # nothing of rank 0's: a masked filler
    assert pos.tolist() == [0] and real.tolist() == [False]
    # the filler is a row the model owns (its R3 routes are here), also when the rank holds other rows
    cr = [RankRole(r % 2, 2, 0, 1) for r in range(2)]  # actor DP 2, critic DP 1: rank 1 holds every row
    sh1 = RowShard.of(8, plan_shares(8, 1, cr, routes=True), 1)
    pos, real = sh1.minibatch_rows(torch.tensor([0, 1]), "actor")
    assert sh1.gid[pos].tolist() == [4] and real.tolist() == [False]


def test_s3ac_metrics_from_shard_sums_equal_the_whole_batch():
    """Reference: the registry's s3ac_gae on the whole batch; here sums over 3 uneven shards, added."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(3)
    n, T = 12, 7
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    scores = torch.where(torch.rand(n, generator=g) > 0.5, 1.0, -1.0)
    values = torch.randn(n, T, generator=g) * 0.8
    cfg = SimpleNamespace(reward_min=-1.0, reward_max=1.0, clamp_values=True, actor_alpha=1.5, critic_lambda=1.0,
                          actor_lambda=None)
    est = get_adv_est("s3ac_gae")
    whole = est(AdvInputs(scores, mask, values, 1), cfg)
    total = None
    for rows in (torch.arange(0, 5), torch.arange(5, 6), torch.arange(6, 12)):
        part = est(AdvInputs(scores[rows], mask[rows], values[rows], 1), cfg)  # row-local: same rows
        torch.testing.assert_close(part.adv, whole.adv[rows])
        s = reduce_sums(s3ac_gae_metric_sums(values[rows], part.returns, part.adv, scores[rows], mask[rows], -1.0, 1.0))
        total = s if total is None else {k: total[k] + s[k] for k in s}
    got = s3ac_gae_metrics(total)
    assert got.keys() == whole.metrics.keys()
    for k, v in whole.metrics.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def _distribute_rank(n, group):
    import torch.distributed as dist

    from megatron_s3ac.trainer.step.scatter import distribute

    rank = dist.get_rank()
    roles = _roles_pp2_dp2()
    rng = np.random.default_rng(0)  # the same samples on rank 0 as in the test's reference
    samples = [{"prompt_ids": [1, 2, 3], "response_ids": [4] * (1 + i % 3), "logprobs": [-0.5] * (1 + i % 3),
                "reward": float(i), "pid": i // group, "finish": "stop", "plen": 3, "rlen": 1 + i % 3,
                "routes": rng.integers(0, 8, size=(3 + i % 3, 4, 2)).astype(np.uint8),
                "images": _image(i) if i % 3 == 0 else None} for i in range(n)]
    keep = ("pid", "reward", "finish", "plen", "rlen")  # what every rank holds (RolloutPhases.rollout)
    mine = samples if rank == 0 else [{k: s[k] for k in keep} for s in samples]
    local, shares = distribute(mine, group, roles, routes=True)
    batch = collate(local)  # the images travel with their rows into the rank's batch
    return ([(s["gid"], s["reward"], s["routes"], s["response_ids"], im) for s, im in zip(local, batch.images)],
            shares[rank].layers, samples)


def _image(i):
    """An image prompt's ImageInputs (one 1 x 2 x 2 grid of 12-dim patches, values from ``i``)."""
    from megatron_s3ac.models.multimodal import ImageInputs

    return ImageInputs(torch.arange(48, dtype=torch.float32).view(4, 12) + i, torch.tensor([[1, 2, 2]]))


def test_distribute_sends_each_rank_its_rows_and_layers():
    n, group = 12, 2
    res = run_distributed(_distribute_rank, 4, n, group)
    samples = res[0][2]
    for rank, (local, layers, _) in enumerate(res):
        want = owned_rows(n, group, rank % 2, 2)
        assert [g for g, *_ in local] == want
        assert layers == ((0, 1) if rank < 2 else (2, 3))
        for g, reward, routes, resp, im in local:
            assert reward == samples[g]["reward"] and resp == samples[g]["response_ids"]
            np.testing.assert_array_equal(routes, samples[g]["routes"][:, list(layers), :])
            src = samples[g]["images"]
            assert (im is None) == (src is None)
            if src is not None:
                assert torch.equal(im.pixel_values, src.pixel_values) and torch.equal(im.image_grid_thw, src.image_grid_thw)


def test_metadata_mask_and_shard_width_match_the_whole_batch():
    from megatron_s3ac.trainer.step.batch import RolloutMeta, collate

    samples = [{"prompt_ids": [1, 2], "response_ids": [3] * n, "logprobs": [-1.0] * n, "reward": float(n), "pid": n,
                "plen": 2, "rlen": n} for n in (1, 4, 2)]
    whole = collate(samples)
    meta = RolloutMeta.of(samples)
    assert torch.equal(meta.mask(), whole.mask) and torch.equal(meta.scores, whole.scores)
    part = collate(samples[:1], width=int(meta.resp_len.max()))  # a shard keeps the whole batch's T
    assert part.mask.shape == (1, 4) and torch.equal(part.mask, whole.mask[:1])
    assert part.to("cpu").mask is part.mask


def _algo_step(algo, out_dir):
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer
    from tests.trainer.test_trainer import SMALL, capture_batches

    k = [] if algo == "grpo_x" else ["rollout.k=1", "algo.actor_minibatches=2"]
    tr = Trainer(load_config(None, SMALL + ["actor_layout.ep=2", f"algo.name={algo}", "daps.enabled=false",
                                            "algo.dynamic_sampling=false", "rollout.reward=test_char_parity",
                                            f"train.out_dir={out_dir}"] + k))
    seen = capture_batches(tr)
    tr.step()
    (b,) = seen
    own = b.shard.owned["actor"]
    return {"gid": b.shard.gid[own], "scores": b.scores[own], "mask": b.mask[own], "adv": b.adv[own],
            "k": tr.cfg.rollout.k, "n": b.global_len()}


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo_x", "reinforce_pp"])
def test_critic_free_advantages_of_a_shard_equal_the_whole_batch(algo, tmp_path):
    """grpo_x needs groups (each rank owns whole groups); reinforce_pp normalises over the whole batch.
    Reference: the algorithm's function on the whole batch assembled from the ranks' own rows."""
    from megatron_s3ac.algorithms.advantages import grpo_advantages, reinforce_pp_advantages

    res = run_distributed(_algo_step, 2, algo, str(tmp_path))
    k, n = res[0]["k"], res[0]["n"]
    gid = torch.cat([r["gid"] for r in res])
    assert sorted(gid.tolist()) == list(range(n))  # every row owned by exactly one DP rank
    assert all(0 < len(r["gid"]) < n for r in res)  # and each rank holds only its share
    order = torch.argsort(gid)
    scores, mask, adv = (torch.cat([r[key] for r in res])[order] for key in ("scores", "mask", "adv"))
    if algo == "grpo_x":
        for r in res:  # whole groups of K on one rank
            groups = r["gid"] // k
            assert all((groups == g).sum() == k for g in groups.unique())
        ref = grpo_advantages(scores, k, normalize_std=True, mask=mask)
    else:
        ref = reinforce_pp_advantages(scores, mask)
    assert scores.abs().sum() > 0 and ref.abs().sum() > 0
    torch.testing.assert_close(adv * mask, ref * mask)

"""Critic-free baselines (GRPO, REINFORCE++, FlashREINFORCE) and the DAPO group filter."""
import math

import pytest
import torch

from megatron_s3ac.algorithms import (
    dynamic_sampling_filter,
    flash_reinforce_advantages,
    flash_reinforce_trust_region,
    grpo_advantages,
    reinforce_pp_advantages,
)

from _algo_reference import bernoulli_kl

F64 = torch.float64


def test_grpo_hand_values():
    r = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(r, group_size=4)
    s = math.sqrt(4 / 3)  # unbiased std of [1, 1, -1, -1]
    assert adv.tolist() == pytest.approx([1 / (s + 1e-6)] * 2 + [-1 / (s + 1e-6)] * 2 + [0.0] * 4)
    assert grpo_advantages(r, 4, normalize_std=False).tolist() == pytest.approx([1, 1, -1, -1, 0, 0, 0, 0])
    tok = grpo_advantages(r[:4], 4, normalize_std=False, mask=torch.tensor([[1, 0], [1, 1], [0, 0], [1, 0]]))
    assert tok.tolist() == [[1, 0], [1, 1], [0, 0], [-1, 0]]
    assert grpo_advantages(torch.tensor([1.0, -1.0]), 1).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError):
        grpo_advantages(r, 3)


def test_reinforce_pp_hand_values():
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = reinforce_pp_advantages(torch.tensor([1.0, -1.0]), mask, eps=0.0)
    # token returns [1, 1], [-1]; mean 1/3, unbiased var 4/3
    s = math.sqrt(4 / 3)
    assert adv.flatten().tolist() == pytest.approx([(2 / 3) / s, (2 / 3) / s, (-4 / 3) / s, 0.0])


def test_reinforce_pp_with_kl_and_group_baseline_matches_loop():
    B, T = 4, 6
    lengths = [6, 3, 4, 1]
    mask = (torch.arange(T) < torch.tensor(lengths)[:, None]).to(F64)
    kl = torch.rand(B, T, dtype=F64)
    R = torch.tensor([1.0, -1.0, -1.0, -1.0], dtype=F64)
    adv = reinforce_pp_advantages(R, mask, group_size=2, kl=kl, kl_coef=0.1, gamma=0.9, eps=0.0)
    Rb = [1.0, -1.0, 0.0, 0.0]  # group means 0 and -1 subtracted
    rets = []
    for b in range(B):
        acc = 0.0
        row = [0.0] * lengths[b]
        for t in reversed(range(lengths[b])):
            r_t = -0.1 * kl[b, t].item() + (float(Rb[b]) if t == lengths[b] - 1 else 0.0)
            acc = r_t + 0.9 * acc
            row[t] = acc
        rets.append(row)
    flat = [x for row in rets for x in row]
    mu = sum(flat) / len(flat)
    sd = math.sqrt(sum((x - mu) ** 2 for x in flat) / (len(flat) - 1))
    for b in range(B):
        for t in range(T):
            exp = (rets[b][t] - mu) / sd if t < lengths[b] else 0.0
            assert adv[b, t].item() == pytest.approx(exp, abs=1e-9)


def test_flash_reinforce_advantages_batch_mean():
    adv = flash_reinforce_advantages(torch.tensor([1.0, -1.0, 1.0, 1.0]))
    assert adv.tolist() == [0.5, -1.5, 0.5, 0.5]
    tok = flash_reinforce_advantages(torch.tensor([1.0, -1.0]), mask=torch.tensor([[1, 1], [1, 0]]))
    assert tok.tolist() == [[1.0, 1.0], [-1.0, 0.0]]


def test_flash_reinforce_trust_region_hand():
    beh = torch.tensor([[math.log(0.5), math.log(0.9), 0.0], [math.log(0.5), math.log(0.5), 0.0]], dtype=F64)
    cur = torch.tensor([[math.log(0.6), math.log(0.9), -9.0], [math.log(0.5), math.log(0.5), -9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    admitted, kl = flash_reinforce_trust_region(cur, beh, mask, delta=3e-3)
    k0 = (bernoulli_kl(0.5, 0.6) + bernoulli_kl(0.9, 0.9)) / 2  # = 0.0102 > delta
    assert kl.tolist() == pytest.approx([k0, 0.0], abs=1e-12)
    assert admitted.tolist() == [False, True]


def test_dynamic_sampling_filter_contiguous_and_ids():
    r = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    keep, st = dynamic_sampling_filter(r, group_size=2)
    assert keep.tolist() == [False, False, True, True, False, False]
    assert st == {
        "kept_groups": 1,
        "discarded_groups": 2,
        "kept_trajectories": 2,
        "discarded_trajectories": 4,
        "discarded_all_positive": 1,
        "discarded_all_nonpositive": 1,
    }
    ids = torch.tensor([7, 3, 7, 3, 9, 9])  # interleaved groups
    keep, st = dynamic_sampling_filter(torch.tensor([1.0, 1.0, -1.0, 1.0, 0.0, 0.0]), group_ids=ids)
    assert keep.tolist() == [True, False, True, False, False, False]
    assert st["kept_groups"] == 1 and st["discarded_trajectories"] == 4
    with pytest.raises(ValueError):
        dynamic_sampling_filter(r)

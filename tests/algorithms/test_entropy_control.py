"""Entropy-control hook for GRPO-X: the registry, 'none' is the identity, and the GEPO candidate's
thresholds and asymmetric attenuation on hand-worked numbers."""
import math

import pytest
import torch

from megatron_s3ac.algorithms.entropy_control import (ENTROPY_CONTROLS, EntropyControl, group_entropy,
                                                      make_entropy_control, register_entropy_control)


def test_none_is_identity_and_default():
    ctl = make_entropy_control()
    adv = torch.randn(4, 3)
    out, met = ctl(adv, torch.rand(4, 3), torch.ones(4, 3), 2)
    assert out is adv and met == {} and ctl.state_dict() == {}
    assert "none" in ENTROPY_CONTROLS and "gepo_candidate" in ENTROPY_CONTROLS


def test_registry_errors():
    with pytest.raises(KeyError, match="registered"):
        make_entropy_control("no_such")
    with pytest.raises(ValueError, match="already"):
        register_entropy_control("none")(type("Other", (EntropyControl,), {}))


def test_group_entropy_masks_padding():
    ent = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert group_entropy(ent, mask, 2).tolist() == [2.0]  # (1 + 2 + 3) / 3
    assert group_entropy(ent, mask, 1).tolist() == [1.5, 3.0]
    with pytest.raises(ValueError):
        group_entropy(ent, mask, 3)


def _const_entropy(levels, group_size, t=2):
    """[B, T] entropy where every token of group g is levels[g]."""
    return torch.tensor(levels, dtype=torch.float32).repeat_interleave(group_size)[:, None].expand(-1, t).clone()


def test_gepo_candidate_hand_worked():
    ctl = make_entropy_control("gepo_candidate", tau=0.5, attenuation=0.5, decay=0.9, warmup_steps=1)
    # step 1 (warm-up): groups H = [1, 3] -> no shaping; stats mean 2, second moment (1 + 9) / 2 = 5, sigma 1
    adv1 = torch.tensor([1.0, -1.0, 1.0, -1.0])
    out, met = ctl(adv1, _const_entropy([1.0, 3.0], 2), torch.ones(4, 2), 2)
    assert torch.equal(out, adv1) and met["low_groups"] == 0
    assert (ctl.mean, ctl.sq_mean) == (2.0, 5.0) and ctl.thresholds() == (1.5, 2.5)
    # step 2: H = [1 (low), 2 (inside), 3 (high)]: positive halved in the low group, negative in the high
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    state = ctl.state_dict()
    out, met = ctl(adv, _const_entropy([1.0, 2.0, 3.0], 2), torch.ones(6, 2), 2)
    assert out.tolist() == [0.5, -1.0, 1.0, -1.0, 1.0, -0.5]
    assert met["low_groups"] == 1 and met["high_groups"] == 1 and met["group_entropy_mean"] == 2.0
    # statistics after step 2: mean 0.9*2 + 0.1*2 = 2; second moment 0.9*5 + 0.1*(1+4+9)/3
    assert ctl.mean == pytest.approx(2.0) and ctl.sq_mean == pytest.approx(4.5 + 14 / 30)
    # token-level advantages [B, T]: same rule per token, by sign
    tok = torch.tensor([[1.0, -2.0], [3.0, 0.0]])
    fresh = make_entropy_control("gepo_candidate", tau=0.5, attenuation=0.5, decay=0.9)
    fresh.load_state_dict(state)  # resume: continues from step 1's statistics
    out, _ = fresh(tok, _const_entropy([1.0, 3.0], 1), torch.ones(2, 2), 1)
    assert out.tolist() == [[0.5, -2.0], [3.0, 0.0]]  # row 0 low (1 < 1.5): positive halved; row 1 high: no negatives


def test_gepo_candidate_validation_and_no_op_settings():
    with pytest.raises(ValueError):
        make_entropy_control("gepo_candidate", attenuation=1.5)
    ctl = make_entropy_control("gepo_candidate", attenuation=1.0)  # attenuation 1: identity in values
    adv = torch.randn(8)
    for _ in range(3):
        out, _ = ctl(adv, torch.rand(8, 4), torch.ones(8, 4), 4)
        assert torch.equal(out, adv)
    assert math.isfinite(ctl.mean)

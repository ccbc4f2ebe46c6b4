"""Packed (THD) layout helpers and packed GAE."""
import torch

from megatron_s3ac.algorithms import compute_gae, compute_gae_packed, packed_to_padded, padded_to_packed


def test_round_trip():
    cu = torch.tensor([0, 3, 4, 9])
    x = torch.arange(9.0)
    pad, present = packed_to_padded(x, cu)
    assert pad.tolist() == [[0, 1, 2, 0, 0], [3, 0, 0, 0, 0], [4, 5, 6, 7, 8]]
    assert present.sum().item() == 9
    assert torch.equal(padded_to_packed(pad, cu), x)


def test_packed_gae_equals_per_sequence_padded():
    cu = torch.tensor([0, 5, 7, 15])
    total = 15
    v = torch.randn(total, dtype=torch.float64)
    r = torch.zeros(total, dtype=torch.float64)
    mask = torch.zeros(total)
    # sequence = prompt tokens (masked) then response tokens; reward on each last response token
    for s, e, p in ((0, 5, 2), (5, 7, 1), (7, 15, 3)):
        mask[s + p : e] = 1
        r[e - 1] = 1.0 if s != 5 else -1.0
    adv, ret = compute_gae_packed(r, v, mask, cu, lam=torch.tensor([0.9, 1.0, 0.5]))
    for i, (s, e) in enumerate(((0, 5), (5, 7), (7, 15))):
        a_i, r_i = compute_gae(r[None, s:e], v[None, s:e], mask[None, s:e], lam=[0.9, 1.0, 0.5][i])
        assert torch.allclose(adv[s:e], a_i[0]) and torch.allclose(ret[s:e], r_i[0])
    assert (adv[mask == 0] == 0).all()

"""Storage (compact dtype, pack/unpack) and alignment (padding, packing, SP split, layer selection)
checked against a direct, position-by-position construction of what each router row must hold."""
import numpy as np
import pytest
import torch

from megatron_s3ac.r3.align import (align_microbatch, filler, pad_last_row, packed_placements,
                                    padded_placements)
from megatron_s3ac.r3.storage import (compact_routes, pack_routes, routes_bytes_per_token,
                                      sglang_bytes_per_token, unpack_routes)

E, K, L = 8, 2, 4
MOE = [1, 2, 3]  # layer 0 dense: its rows are 0 in the SGLang layout


def sample_routes(T, seed):
    """[T-1, L, K] distinct random ids per MoE row, zeros on the dense layer (as SGLang returns)."""
    g = np.random.default_rng(seed)
    r = np.zeros((T - 1, L, K), np.uint8)
    for t in range(T - 1):
        for layer in MOE:
            r[t, layer] = g.permutation(E)[:K]
    return r


def expected_rows(routes, placements, b, s, layers, sp_rank, sp_size):
    """Direct construction: position p of row `row` -> router row (p - lo) * b + row."""
    s_loc = s // sp_size
    out = np.tile(filler(K, E), (s_loc * b, len(layers), 1))
    routed = np.zeros(s_loc * b, bool)
    for r, (row, start, _) in zip(routes, placements):
        for t in range(r.shape[0]):
            p = start + t
            if sp_rank * s_loc <= p < (sp_rank + 1) * s_loc:
                out[(p - sp_rank * s_loc) * b + row] = r[t, layers]
                routed[(p - sp_rank * s_loc) * b + row] = True
    return out, routed


@pytest.mark.parametrize("num_experts,dtype", [(8, np.uint8), (256, np.uint8), (257, np.int16),
                                               (32768, np.int16), (40000, np.int32)])
def test_compact_dtype(num_experts, dtype):
    ids = np.array([[[0, num_experts - 1]]], dtype=np.int64)
    out = compact_routes(ids, num_experts)
    assert out.dtype == dtype and (out == ids).all()


def test_compact_refuses_out_of_range():
    with pytest.raises(ValueError, match="outside"):
        compact_routes(np.array([[[0, 256]]]), 256)


@pytest.mark.parametrize("num_experts", [128, 512, 40000])
def test_pack_roundtrip(num_experts):
    r = compact_routes(np.random.default_rng(0).integers(0, num_experts, (37, 6, 8)), num_experts)
    blob = pack_routes(r)
    assert len(blob) == 16 + r.nbytes
    back = unpack_routes(blob)
    assert back.dtype == r.dtype and back.shape == r.shape and (back == r).all()


def test_bytes_per_token():
    assert routes_bytes_per_token(48, 8, 128) == 384          # uint8
    assert routes_bytes_per_token(60, 10, 512) == 1200        # int16
    assert sglang_bytes_per_token(48, 8) == 48 * 8 * 4 * 4 / 3


def test_pad_last_row_distinct():
    r = sample_routes(5, 0)
    p = pad_last_row(r, E)
    assert p.shape == (5, L, K) and (p[:4] == r).all()
    assert (p[4] == np.arange(K)).all()
    with pytest.raises(ValueError):
        filler(9, 8)  # top_k > num_experts cannot be distinct


@pytest.mark.parametrize("sp_size", [1, 2])
@pytest.mark.parametrize("layers", [MOE, [1], [2, 3]])
def test_align_padded(sp_size, layers):
    lengths = [9, 12, 6]
    routes = [sample_routes(T, i) for i, T in enumerate(lengths)]
    pl = padded_placements(lengths)
    for sp_rank in range(sp_size):
        mb = align_microbatch(routes, pl, (3, 12), layers, E, sp_rank=sp_rank, sp_size=sp_size)
        want, routed = expected_rows(routes, pl, 3, 12, layers, sp_rank, sp_size)
        assert mb.indices.dtype == torch.uint8 and mb.layers == tuple(layers)
        np.testing.assert_array_equal(mb.indices.numpy().transpose(1, 0, 2), want)
        np.testing.assert_array_equal(mb.routed.numpy(), routed)
        assert mb.layer(layers[0]).dtype == torch.int64


@pytest.mark.parametrize("sp_size", [1, 2])
def test_align_packed_and_left_padded(sp_size):
    lengths = [9, 12, 6]
    routes = [sample_routes(T, i) for i, T in enumerate(lengths)]
    for pl, shape in [(packed_placements(lengths), (1, 28)),
                      ([(0, 3, 9), (1, 0, 12), (2, 6, 6)], (3, 12))]:  # left padding: any start
        for sp_rank in range(sp_size):
            mb = align_microbatch(routes, pl, shape, MOE, E, sp_rank=sp_rank, sp_size=sp_size)
            want, routed = expected_rows(routes, pl, *shape, MOE, sp_rank, sp_size)
            np.testing.assert_array_equal(mb.indices.numpy().transpose(1, 0, 2), want)
            np.testing.assert_array_equal(mb.routed.numpy(), routed)


def test_align_input_without_last_token():
    """A trainer that feeds tokens[:-1] (length T-1) needs no filler row."""
    routes = [sample_routes(9, 0)]
    mb = align_microbatch(routes, [(0, 0, 8)], (1, 8), MOE, E)
    assert mb.routed.all()


def test_align_refusals():
    routes = [sample_routes(9, 0)]
    with pytest.raises(ValueError, match="route rows"):
        align_microbatch(routes, [(0, 0, 10)], (1, 12), MOE, E)
    with pytest.raises(ValueError, match="does not fit"):
        align_microbatch(routes, [(0, 6, 9)], (1, 12), MOE, E)
    with pytest.raises(ValueError, match="divisible"):
        align_microbatch(routes, [(0, 0, 9)], (1, 11), MOE, E, sp_size=2)
    with pytest.raises(ValueError, match="duplicate"):  # the dense layer's zero rows, replayed by mistake
        align_microbatch(routes, [(0, 0, 9)], (1, 12), [0, 1], E)
    with pytest.raises(ValueError, match="outside"):
        align_microbatch(routes, [(0, 0, 9)], (1, 12), MOE, 4)

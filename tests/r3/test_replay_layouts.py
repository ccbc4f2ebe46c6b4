"""With replay on, the experts every router used equal the rollout's for 100% of (token, MoE layer)
pairs, at TP=2 (+SP), EP=2 and PP=2, padded and packed; and the log-probs equal the single-rank
replayed run (so the alignment is the same tokens at every layout, not just self-consistent).

The rollout routes are random distinct experts per token: far from the model's native top-k, so a
token that was not replayed (or replayed with another token's row) cannot pass by luck.
"""
import pytest
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from tests.r3 import _r3_common as C


def run_layout(layout, ckpt_dir, save_ref):
    """Per rank: load the model, run each layout kind with replay (training pass), check the used
    experts; on the reference rank also measure native routing. Returns log-probs and counts."""
    from megatron_s3ac.r3.metrics import record_native_routes, routing_agreement
    from megatron_s3ac.r3.replay import routing_replay

    info, config, model, ddp = C.build(layout)
    C.save_or_load(model, ckpt_dir, save_ref)
    smp = C.samples()
    result = {}
    for kind in ("padded", "packed"):
        mbs, pls, sids = C.microbatches(kind, smp)
        routes = C.aligned(ddp, config, info, mbs, pls, sids, smp)
        used = C.UsedExperts(model)
        ddp.zero_grad_buffer()
        with routing_replay([ddp], routes):
            lps = C.run(ddp, info, mbs, forward_only=False)
        used.remove()
        checked = C.check_used_equals_rollout(used, config, mbs, pls, sids, smp)
        result[kind] = dict(lp=lps, checked=checked, layers=sorted(used.maps))
        if save_ref:  # native routing on the same data: how far the rollout routes are from it
            with record_native_routes([ddp]) as native:
                result[kind]["lp_native"] = C.run(ddp, info, mbs, forward_only=True)
            result[kind]["agreement"] = routing_agreement(native, routes)
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from megatron_s3ac.models.parallel import ParallelLayout

    d = tmp_path_factory.mktemp("r3_ref")
    return str(d / "w"), run_distributed(run_layout, 1, ParallelLayout(), str(d / "w"), True)[0]


def test_reference_replay_is_not_native(reference):
    """Sanity of the setup: native routing disagrees with the rollout routes, and replay changes
    the log-probs; all 3 MoE layers (1, 2, 3) are replayed, dense layer 0 is not."""
    _, ref = reference
    for kind in ("padded", "packed"):
        agree, total = ref[kind]["agreement"]
        assert total == sum(n - 1 for n in C.LENGTHS) * 3
        assert agree / total < 0.5
        assert ref[kind]["layers"] == [1, 2, 3]
        diff = max((a - b).abs().max() for a, b in zip(ref[kind]["lp"], ref[kind]["lp_native"]))
        assert diff > 1e-3


LAYOUTS = {"tp2_sp": (2, dict(tp=2)), "ep2": (2, dict(ep=2)), "pp2": (2, dict(pp=2)),
           "tp2_ep2": (4, dict(tp=2, ep=2, etp=1))}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "tp2_ep2" else n
                                  for n in LAYOUTS])
def test_replay_at_layout(reference, name):
    from megatron_s3ac.models.parallel import ParallelLayout

    ckpt, ref = reference
    world, kw = LAYOUTS[name]
    outs = run_distributed(run_layout, world, ParallelLayout(**kw), ckpt, False)
    for kind in ("padded", "packed"):
        # every rank checked all its tokens on all its MoE layers; together they cover every layer
        layers = sorted({layer for o in outs for layer in o[kind]["layers"]})
        assert layers == [1, 2, 3]
        assert all(o[kind]["checked"] > 0 for o in outs)
        lps = [o[kind]["lp"] for o in outs if o[kind]["lp"]]
        assert lps
        for lp in lps:
            for got, want in zip(lp, ref[kind]["lp"]):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

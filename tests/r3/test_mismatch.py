"""A trainer whose native routing differs from the rollout's (router weights perturbed slightly, as
numerics drift between engine and trainer would): natively some (token, layer) pairs disagree with
the rollout routes; with replay every pair agrees and the train-vs-rollout log-prob gap drops.

The rollout here is the unperturbed model's own forward (RouterReplay RECORD): its native top-k
are the "engine" routes, its log-probs the behaviour log-probs.
"""
import numpy as np
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from tests.r3 import _r3_common as C


def _to_sample_routes(recorded, mbs, pls, sids, lengths):
    """RECORD rows ([s*b, K] per layer, single rank) -> per sample [T-1, L, K] uint8 (layer 0 dense: 0)."""
    out = {}
    for rec, mb, pl, ids in zip(recorded, mbs, pls, sids):
        b, s = mb["input_ids"].shape
        for (row, start, n), i in zip(pl, ids):
            r = np.zeros((n - 1, C.L, C.K), np.uint8)
            for layer, idx in rec.items():
                r[:, layer] = idx.view(s, b, C.K)[start:start + n - 1, row].numpy()
            out[i] = r
    return [out[i] for i in range(len(lengths))]


def run_mismatch(scale):
    from megatron_s3ac.models.parallel import ParallelLayout
    from megatron_s3ac.r3.metrics import gap_means, logprob_gap, record_native_routes, routing_agreement
    from megatron_s3ac.r3.replay import chunk_routers, routing_replay

    info, config, model, ddp = C.build(ParallelLayout())
    tokens = C.samples()
    mbs, pls, sids = C.microbatches("padded", tokens)
    with record_native_routes([ddp]) as rec:  # the rollout: native routes + behaviour log-probs
        lp_rollout = C.run(ddp, info, mbs, forward_only=True)
    smp = [(t, r) for (t, _), r in zip(tokens, _to_sample_routes(rec, mbs, pls, sids, C.LENGTHS))]
    routes = C.aligned(ddp, config, info, mbs, pls, sids, smp)

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the trainer drifts from the engine
        for _, router in chunk_routers(model):
            w = router.weight
            w.add_(scale * w.std() * torch.randn(w.shape, generator=g))

    with record_native_routes([ddp]) as native:
        lp_native = C.run(ddp, info, mbs, forward_only=True)
    used = C.UsedExperts(model)
    with routing_replay([ddp], routes):
        lp_replay = C.run(ddp, info, mbs, forward_only=True)
    used.remove()
    C.check_used_equals_rollout(used, config, mbs, pls, sids, smp)

    def gap(lps):
        return gap_means([logprob_gap(a, b, mb["mask"]) for a, b, mb in zip(lps, lp_rollout, mbs)])

    return dict(native_agreement=routing_agreement(native, routes), gap_native=gap(lp_native),
                gap_replay=gap(lp_replay))


def test_replay_removes_routing_disagreement_and_lowers_gap():
    r = run_distributed(run_mismatch, 1, 0.3)[0]
    agree, total = r["native_agreement"]
    assert 0 < agree < total, r  # natively, some (token, layer) pairs route differently
    # with replay: 100% agreement (checked inside the rank) and a smaller log-prob gap
    assert r["gap_replay"]["logprob_abs_diff"] < 0.5 * r["gap_native"]["logprob_abs_diff"], r
    assert r["gap_replay"]["kl_k3"] < r["gap_native"]["kl_k3"], r

"""Full activation recomputation re-runs the routers during backward; REPLAY_BACKWARD makes them
pop the replayed indices of the micro-batch being recomputed. At PP=2 with two micro-batches in
flight (1F1B: stage 0 runs F0 F1 B0 B1, so when B0 recomputes, the latest target is micro-batch
1's), the gradients equal the run without recomputation, every recomputed router call used the
rollout's experts, and they differ from the gradients under native routing (replay matters)."""
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from tests.r3 import _r3_common as C

# through build_transformer_config's own switch: megatron's recompute_granularity="full", recompute_method="uniform", 1 layer
RECOMPUTE = dict(recompute="full", recompute_num_layers=1)


def run_recompute(layout):
    smp = C.samples()
    out = {}
    for name, overrides, replay in (("plain", {}, True), ("recompute", RECOMPUTE, True), ("native", {}, False)):
        info, config, model, ddp = C.build(layout, **overrides)
        out[name], used, routes, mbs = C.train_step_recording(ddp, config, info, model, smp, replay)
        if name == "recompute":
            # each micro-batch's routers ran twice (no-grad forward + recompute), both with its routes
            for layer, maps in used.maps.items():
                assert len(maps) == 2 * len(mbs)
                want = [C.one_hot(r, layer, info.num_experts) for r in routes]
                hits = [sum(bool(torch.equal(m, w)) for m in maps) for w in want]
                assert hits == [2] * len(mbs), f"layer {layer}: per-micro-batch matches {hits}"
    return out


def test_recompute_backward_uses_replayed_routing():
    from megatron_s3ac.models.parallel import ParallelLayout

    for grads in run_distributed(run_recompute, 2, ParallelLayout(pp=2)):
        plain, recompute, native = grads["plain"], grads["recompute"], grads["native"]
        assert plain.keys() == recompute.keys()
        for k in plain:
            torch.testing.assert_close(recompute[k], plain[k], atol=1e-6, rtol=1e-5, msg=lambda m: f"{k}: {m}")
        routers = [k for k in plain if k.endswith("router.weight")]
        assert routers and all(plain[k].abs().sum() > 0 for k in routers)  # the router keeps its gradient
        assert max((plain[k] - native[k]).abs().max() for k in plain) > 1e-4

"""The live export reuses its plan (pieces, metadata, buckets) between syncs, and stays exact:
after an in-place update (what an optimizer step does) and after a HostOffload round trip, a
cached export equals a freshly planned one, and the cached export exchanges no metadata
(no all_gather_object). TP=2 on 2 gloo ranks, a tiny Qwen3-MoE (row- and column-split tensors)."""
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed


def _export(model, info, counter):
    from megatron_s3ac.convert.export import export_hf_weights

    before = counter[0]
    out = {n: t.clone() for b in export_hf_weights([model], info, bucket_bytes=50_000) for n, t in b}
    return out, counter[0] - before


def run():
    import torch.distributed as dist

    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.offload import HostOffload
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.models.tiny_models import tiny_config

    counter = [0]
    orig = dist.all_gather_object

    def counting(*a, **k):
        counter[0] += 1
        return orig(*a, **k)

    dist.all_gather_object = counting
    info = model_info(tiny_config("qwen3_moe").to_dict())
    lay = ParallelLayout(tp=2)
    initialize_model_parallel(lay, seed=3)
    torch.manual_seed(0)
    model = build_actor(info, build_transformer_config(info, lay))
    first, calls_first = _export(model, info, counter)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.25)
    cached, calls_cached = _export(model, info, counter)
    h = HostOffload([model])
    h.offload()
    h.onload()
    after_offload, _ = _export(model, info, counter)
    model.__dict__.pop("_s3ac_export_plans")
    fresh, calls_fresh = _export(model, info, counter)
    return dict(first=first, cached=cached, after_offload=after_offload, fresh=fresh,
                calls=(calls_first, calls_cached, calls_fresh))


def test_cached_export_is_exact():
    res = run_distributed(run, 2)
    r0 = res[0]
    assert res[1]["fresh"] == {}  # the non-leader yields empty buckets
    assert r0["calls"] == (1, 0, 1)
    fresh = r0["fresh"]
    assert fresh and fresh.keys() == r0["cached"].keys() == r0["first"].keys()
    for n, t in fresh.items():
        assert torch.equal(r0["cached"][n], t), n
        assert torch.equal(r0["after_offload"][n], t), n
        torch.testing.assert_close(t, r0["first"][n] * 1.5 + 0.25)

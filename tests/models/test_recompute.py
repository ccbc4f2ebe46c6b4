"""Activation recompute (train.recompute) leaves fp32 gradients unchanged, with and without R3.

At PP=2 and EP=2 (2 gloo ranks) a tiny Qwen3-MoE (layer 0 dense) is built from one seed for each
setting and run forward+backward over two micro-batches through megatron's schedules:
  none / full (uniform, 1 layer per chunk) / selective (core_attn, mlp, moe)
must give the same main_grads (the reference is the run without recompute). Under routing replay
(R3's REPLAY_FORWARD, then REPLAY_BACKWARD for the recompute, see r3/replay.py) the recomputed
router calls must use the rollout's experts (each router runs twice per micro-batch, both times on
the micro-batch's routes), and the gradients must equal the replayed run without recompute, and
differ from native routing (so replay is what makes them equal).
"""
import pytest
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from tests.r3 import _r3_common as C

SELECTIVE = ["core_attn", "mlp", "moe"]  # layernorm / moe_act need TE (refused: see below)
MODES = {"none": dict(recompute="none"), "full": dict(recompute="full"),
         "selective": dict(recompute="selective", recompute_modules=SELECTIVE)}


def _build(layout, mode):
    """C.build with the recompute settings passed through build_transformer_config's own switch."""
    import torch.distributed as dist

    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.optim import wrap_ddp
    from megatron_s3ac.models.parallel import initialize_model_parallel
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.r3.config import R3Config

    info = model_info(C.cfg_dict())
    layout.validate(info, dist.get_world_size())
    initialize_model_parallel(layout, seed=3)
    torch.manual_seed(11)
    config = build_transformer_config(info, layout, **MODES[mode], **R3Config().transformer_config_overrides(info))
    model = build_actor(info, config)
    return info, config, model, wrap_ddp(model, config, distributed_optimizer=False)


def run_modes(layout):
    smp = C.samples()
    out, calls = {}, {}
    for mode in MODES:
        for replay in (False, True):
            info, config, model, ddp = _build(layout, mode)
            if mode == "full":
                assert config.recompute_granularity == "full" and config.recompute_num_layers == 1
            out[(mode, replay)], used, routes, _ = C.train_step_recording(ddp, config, info, model, smp, replay)
            if replay:
                calls[mode] = {}
                for layer, maps in used.maps.items():
                    want = [C.one_hot(r, layer, info.num_experts) for r in routes]
                    # router calls per micro-batch whose routing map equals that micro-batch's routes
                    calls[mode][layer] = ([sum(bool(torch.equal(m, w)) for m in maps) for w in want], len(maps))
    return out, calls


@pytest.mark.slow  # six model builds per layout
@pytest.mark.parametrize("layout_kw", [dict(pp=2), dict(ep=2)], ids=["pp2", "ep2"])
def test_recompute_same_gradients(layout_kw):
    from megatron_s3ac.models.parallel import ParallelLayout

    for grads, calls in run_distributed(run_modes, 2, ParallelLayout(**layout_kw)):
        ref, ref_replay = grads[("none", False)], grads[("none", True)]
        assert sum(int(v.abs().sum() > 0) for v in ref.values()) > len(ref) // 2  # not vacuous
        for mode in ("full", "selective"):
            for replay, want in ((False, ref), (True, ref_replay)):
                got = grads[(mode, replay)]
                assert got.keys() == want.keys()
                for k in want:
                    torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-5,
                                               msg=lambda m: f"{mode} replay={replay} {k}: {m}")
        # replay decides the gradients: native routing differs
        assert max((ref_replay[k] - ref[k]).abs().max() for k in ref) > 1e-4
        n_mb = 2
        for mode, per_layer in calls.items():
            assert per_layer, "no MoE router on this rank"
            for layer, (hits, n_calls) in per_layer.items():
                runs = 1 if mode == "none" else 2  # recompute re-runs the router in backward
                assert n_calls == runs * n_mb, f"{mode} layer {layer}: {n_calls} router calls"
                assert hits == [runs] * n_mb, f"{mode} layer {layer}: per-micro-batch matches {hits}"


def test_te_only_recompute_modules_refused():
    from megatron_s3ac.models.recompute import _have_te, recompute_kwargs

    if _have_te():
        pytest.skip("Transformer Engine installed")
    with pytest.raises(ValueError, match=r"recompute_modules \['layernorm'\] need Transformer Engine"):
        recompute_kwargs("selective", ["core_attn", "layernorm"])
    with pytest.raises(ValueError, match="recompute_num_layers applies to train.recompute='full' only"):
        recompute_kwargs("selective", None, 2)
    with pytest.raises(ValueError, match="train.recompute must be one of"):
        recompute_kwargs("partial")
    assert recompute_kwargs("full", num_layers=2) == dict(recompute_granularity="full", recompute_method="uniform",
                                                          recompute_num_layers=2)

"""Actor logits / critic values and gradients at TP=2, EP=2, PP=2, TP2xEP2 equal the single-rank run.

The reference run (1 rank) initialises the model from a seed, saves it with dist_checkpointing and
records outputs and gradients. Each parallel run loads that checkpoint at its layout, runs forward +
backward through megatron's schedules (DDP + finalize_model_grads), and writes its gradients as a
sharded checkpoint (grad copied into each param), which the reference layout reads back: the
resharding is megatron's, the comparison is tensor by tensor.
"""
import os

import pytest
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.models.tiny_models import tiny_config

B, S = 2, 12


def _batch(vocab):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (B, S + 1), generator=g)
    target_v = torch.rand(B, S, generator=g) * 2 - 1
    return ids, target_v


def _build(cfg_dict, role, layout):
    from megatron_s3ac.models.actor_critic import build_actor, build_critic, build_transformer_config
    from megatron_s3ac.models.optim import wrap_ddp
    from megatron_s3ac.models.parallel import initialize_model_parallel
    from megatron_s3ac.models.registry import model_info

    info = model_info(cfg_dict)
    import torch.distributed as dist

    layout.validate(info, dist.get_world_size())
    initialize_model_parallel(layout, seed=3)
    torch.manual_seed(11)
    config = build_transformer_config(info, layout)
    model = build_actor(info, config) if role == "actor" else build_critic(info, config)
    return info, config, model, wrap_ddp(model, config, distributed_optimizer=False)


def _loss_fn(info, role, target_v, batch, out):
    from megatron_s3ac.models.logprobs import gather_vocab, vocab_parallel_log_probs

    if role == "actor":
        lp = vocab_parallel_log_probs(out, batch["labels"], info.vocab_size)
        return -lp.sum(), torch.tensor(lp.numel()), {"out": gather_vocab(out.detach(), info.vocab_size)}
    err = (out - target_v) ** 2
    return err.sum(), torch.tensor(err.numel()), {"out": out.detach()}


def run_layout(cfg_dict, role, layout, ckpt_dir, grad_dir, save_ref):
    """Load (or, for the reference, create and save) the model; forward+backward; save grads."""
    from functools import partial

    from megatron.core import dist_checkpointing

    from megatron_s3ac.models.pipeline import forward_backward

    info, config, model, ddp = _build(cfg_dict, role, layout)
    if save_ref:
        os.makedirs(ckpt_dir, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
    ids, target_v = _batch(info.vocab_size)
    mb = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    ddp.zero_grad_buffer()
    out = forward_backward([ddp], [mb], partial(_loss_fn, info, role, target_v))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.main_grad)
    os.makedirs(grad_dir, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), grad_dir)
    return out[0]["out"] if out else None


def read_ckpt(cfg_dict, role, layout, ckpt_dir):
    from megatron.core import dist_checkpointing

    _, _, model, _ = _build(cfg_dict, role, layout)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "_extra_state" not in k}


def check_layout(cfg, role, layout, world, ref_dir, tmp_path, ref_out, ref_grads, label=""):
    """Run ``role`` at ``layout`` on ``world`` ranks from the reference weights in ``ref_dir / "w"``:
    every rank's output equals the single-rank ``ref_out``, and every gradient (saved by the layout run,
    read back at one rank) equals ``ref_grads``, most of them nonzero."""
    from megatron_s3ac.models.parallel import ParallelLayout

    outs = run_distributed(run_layout, world, cfg, role, layout, str(ref_dir / "w"), str(tmp_path / "g"), False)
    outs = [o for o in outs if o is not None]
    assert outs, "no rank returned outputs"
    for o in outs:
        print(f"{label}: max |out diff| = {(o - ref_out).abs().max().item():.3e}")
        assert o.shape == ref_out.shape
        torch.testing.assert_close(o, ref_out, atol=1e-5, rtol=0)
    grads = run_distributed(read_ckpt, 1, cfg, role, ParallelLayout(), str(tmp_path / "g"))[0]
    assert grads.keys() == ref_grads.keys()
    nonzero = 0
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], atol=2e-5, rtol=1e-4, msg=lambda m: f"{k}: {m}")
        nonzero += int(ref_grads[k].abs().sum() > 0)
    assert nonzero > len(ref_grads) // 2  # the comparison is not vacuous


LAYOUTS = {
    "tp2": (2, dict(tp=2)),
    "ep2": (2, dict(ep=2)),
    "pp2": (2, dict(pp=2)),
    "tp2ep2": (4, dict(tp=2, ep=2, etp=1)),
    "pp2_uneven": (2, dict(pp=2, first_stage_layers=1)),
    "pp3_auto": (3, dict(pp=3)),  # 4 layers over 3 stages: split automatically, [1, 2, 1]
}
CASES = [("qwen3_moe", r, l) for r in ("actor", "critic") for l in ("tp2", "ep2", "pp2", "tp2ep2")] + \
        [("qwen2", r, l) for r in ("actor", "critic") for l in ("tp2", "pp2_uneven")] + \
        [("qwen3", "actor", "tp2")] + \
        [("qwen3_moe", "actor", "pp3_auto"), ("qwen2", "critic", "pp3_auto")]


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    from megatron_s3ac.models.parallel import ParallelLayout

    cache = {}

    def get(model_type, role):
        if (model_type, role) not in cache:
            d = tmp_path_factory.mktemp(f"{model_type}_{role}")
            cfg = tiny_config(model_type).to_dict()
            out = run_distributed(run_layout, 1, cfg, role, ParallelLayout(), str(d / "w"), str(d / "g"), True)[0]
            grads = run_distributed(read_ckpt, 1, cfg, role, ParallelLayout(), str(d / "g"))[0]
            cache[(model_type, role)] = (cfg, d, out, grads)
        return cache[(model_type, role)]

    return get


@pytest.mark.parametrize("model_type,role,layout_name", CASES)
def test_layout_matches_single_rank(refs, model_type, role, layout_name, tmp_path):
    from megatron_s3ac.models.parallel import ParallelLayout

    cfg, d, ref_out, ref_grads = refs(model_type, role)
    world, kw = LAYOUTS[layout_name]
    check_layout(cfg, role, ParallelLayout(**kw), world, d, tmp_path, ref_out, ref_grads, f"{model_type} {role} {layout_name}")

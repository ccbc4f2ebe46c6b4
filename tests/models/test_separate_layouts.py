"""Actor and critic in one job at different parallel layouts (actor TP=2, critic EP=2 / DP=2).

Each model is built and run inside its own ParallelContext; their outputs and gradients must equal
the single-rank references, and running one model must not disturb the other.
"""
import os
from functools import partial

import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.models.tiny_models import tiny_config
from tests.models.test_parallel_equivalence import _batch, _loss_fn, read_ckpt, run_layout


def _two_layouts(cfg_dict, actor_layout, critic_layout, actor_ckpt, critic_ckpt, grad_dir):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_s3ac.models.actor_critic import build_actor, build_critic, build_transformer_config
    from megatron_s3ac.models.optim import wrap_ddp
    from megatron_s3ac.models.parallel import ParallelContext
    from megatron_s3ac.models.pipeline import forward_backward
    from megatron_s3ac.models.registry import model_info

    info = model_info(cfg_dict)
    world = dist.get_world_size()
    actor_layout.validate(info, world)
    critic_layout.validate(info, world)
    actor_ctx = ParallelContext(actor_layout, seed=3)
    critic_ctx = ParallelContext(critic_layout, seed=3)

    def load_in(ctx, layout, build, ckpt):
        """build(info, config) at ``layout`` inside ``ctx``, loaded from ``ckpt``: (model, DDP)."""
        with ctx.active():
            assert parallel_state.get_tensor_model_parallel_world_size() == layout.tp
            assert parallel_state.get_expert_model_parallel_world_size() == layout.ep
            cfg = build_transformer_config(info, layout)
            model = build(info, cfg)
            model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt))
            return model, wrap_ddp(model, cfg, distributed_optimizer=False)

    _, a_ddp = load_in(actor_ctx, actor_layout, build_actor, actor_ckpt)
    critic, c_ddp = load_in(critic_ctx, critic_layout, build_critic, critic_ckpt)

    ids, target_v = _batch(info.vocab_size)
    mb = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    outs = {}
    # interleave: actor, critic, actor again (the second actor pass must not see critic state)
    for name, ctx, ddp, role in [("actor", actor_ctx, a_ddp, "actor"), ("critic", critic_ctx, c_ddp, "critic"),
                                 ("actor2", actor_ctx, a_ddp, "actor")]:
        with ctx.active():
            ddp.zero_grad_buffer()
            res = forward_backward([ddp], [mb], partial(_loss_fn, info, role, target_v))
            outs[name] = res[0]["out"] if res else None
    with critic_ctx.active():
        with torch.no_grad():
            for p in critic.parameters():
                p.copy_(p.main_grad)
        os.makedirs(grad_dir, exist_ok=True)
        dist_checkpointing.save(critic.sharded_state_dict(), grad_dir)
    return outs


def test_actor_tp2_critic_ep2_in_one_job(tmp_path):
    from megatron_s3ac.models.parallel import ParallelLayout

    cfg = tiny_config("qwen3_moe").to_dict()
    d = tmp_path
    ref_actor = run_distributed(run_layout, 1, cfg, "actor", ParallelLayout(), str(d / "wa"), str(d / "ga"), True)[0]
    ref_critic = run_distributed(run_layout, 1, cfg, "critic", ParallelLayout(), str(d / "wc"), str(d / "gc"), True)[0]
    ref_cgrads = run_distributed(read_ckpt, 1, cfg, "critic", ParallelLayout(), str(d / "gc"))[0]

    outs = run_distributed(_two_layouts, 2, cfg, ParallelLayout(tp=2), ParallelLayout(ep=2),
                           str(d / "wa"), str(d / "wc"), str(d / "g2"))
    for o in outs:
        torch.testing.assert_close(o["actor"], ref_actor, atol=1e-5, rtol=0)
        torch.testing.assert_close(o["actor2"], ref_actor, atol=1e-5, rtol=0)
        torch.testing.assert_close(o["critic"], ref_critic, atol=1e-5, rtol=0)
    grads = run_distributed(read_ckpt, 1, cfg, "critic", ParallelLayout(), str(d / "g2"))[0]
    for k in ref_cgrads:
        torch.testing.assert_close(grads[k], ref_cgrads[k], atol=2e-5, rtol=1e-4, msg=lambda m: f"{k}: {m}")

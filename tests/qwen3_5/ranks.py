"""Rank bodies for run_distributed (module-level so the forkserver can import them)."""
import torch


def packed_mask_refused(cfg):
    """A block-diagonal (packed) mask must raise: megatron's GDN would ignore it."""
    from megatron_s3ac.convert.verify import make_layout
    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.parallel import initialize_model_parallel
    from megatron_s3ac.models.registry import model_info

    info = model_info(cfg)
    initialize_model_parallel(make_layout(), seed=1)
    model = build_actor(info, build_transformer_config(info, make_layout()))
    ids = torch.randint(0, 96, (1, 8))
    pos = torch.arange(8)[None]
    causal = torch.ones(8, 8, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        model(ids, pos, causal)  # an explicit causal mask is fine
        packed = causal.clone()
        packed[..., 4:, :4] = True
        try:
            model(ids, pos, packed)
        except NotImplementedError as e:
            return str(e)
    return None


def r3_replay(cfg, mcore_dir, layout, smp):
    """Load the converted model at ``layout`` with routing replay, replay the engine's routes on right-
    padded micro-batches, check every router used exactly the engine's experts (raises otherwise).
    Returns (per micro-batch [b, s] log-probs on the last stage, pairs checked, replayed layers)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.optim import wrap_ddp
    from megatron_s3ac.models.parallel import initialize_model_parallel
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.r3.config import R3Config
    from megatron_s3ac.r3.replay import routing_replay
    from tests.r3 import _r3_common as C

    info = model_info(cfg)
    layout.validate(info, dist.get_world_size())
    initialize_model_parallel(layout, seed=1)
    config = build_transformer_config(info, layout, **R3Config().transformer_config_overrides(info))
    model = build_actor(info, config)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), mcore_dir))
    ddp = wrap_ddp(model, config, distributed_optimizer=False)
    mbs, pls, sids = C.microbatches("padded", smp)
    routes = C.aligned(ddp, config, info, mbs, pls, sids, smp)
    used = C.UsedExperts(model)
    with torch.no_grad(), routing_replay([ddp], routes):
        lps = C.run(ddp, info, mbs, forward_only=True)
    used.remove()
    checked = C.check_used_equals_rollout(used, config, mbs, pls, sids, smp)
    return lps, checked, sorted(used.maps)

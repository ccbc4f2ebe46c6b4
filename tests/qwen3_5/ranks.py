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


def _trainer_cfg(hf_dir, actor_init, out_dir, tp, ep):
    from megatron_s3ac.config import Config, LayoutCfg, ModelCfg, TrainCfg

    return Config(model=ModelCfg(hf_config=hf_dir, actor_init=actor_init),
                  actor_layout=LayoutCfg(tp=tp, ep=ep, etp=1 if ep > 1 else None), train=TrainCfg(out_dir=out_dir))


def carried_through_training(hf_dir, actor_init, out_dir, tp, ep):
    """The trainer's own path: ``build_parallel`` + ``build_actor`` from ``actor_init`` (a converted VL
    checkpoint, or a training checkpoint's actor/), ``save_checkpoint`` (step 3, optimizer state per rank),
    and the live export the weight sync uses. Returns (this rank's carried bytes, the step dir, exported
    names)."""
    import types

    import torch.distributed as dist

    from megatron_s3ac.convert import export_hf_weights
    from megatron_s3ac.trainer.step import build as B
    from megatron_s3ac.trainer.run.checkpoint import save_checkpoint
    from megatron_s3ac.config import model_info_for

    cfg = _trainer_cfg(hf_dir, actor_init, out_dir, tp, ep)
    info = model_info_for(cfg)
    B.build_parallel(cfg, uses_critic=False)
    m = B.build_actor(cfg, info, B.layout_of(cfg.actor_layout), {})
    carried = getattr(m.module, "s3ac_carried", None)
    tr = types.SimpleNamespace(cfg=cfg, actor=m.module, actor_opt=m.opt, critic=None, rank=dist.get_rank(),
                               step_idx=3, skipped_steps=0, stream=types.SimpleNamespace(state_dict=dict), daps=None)
    step_dir = save_checkpoint(tr, keep_last=2)
    names = [n for bucket in export_hf_weights([m.module], info, bucket_bytes=1 << 20) for n, _ in bucket]
    return (carried.nbytes() if carried is not None else None), step_dir, names

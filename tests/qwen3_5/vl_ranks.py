"""Rank bodies of the VL forward tests (tests/qwen3_5/test_vl_forward.py)."""
import torch


def vl_actor_critic_outputs(hf_dir, mcore_dir, layout, ids, images, head_w, head_b, trainable=False):
    """Actor and critic built as the trainer builds them (``build_actor`` + carried tensors loaded from the
    converted checkpoint, the vision tower from them; the critic's backbone copied from the actor, its value
    head set to ``head_w``/``head_b``, the actor's vision tower shared), one forward of the micro-batch
    {input_ids, images} each through ``models.pipeline.forward_backward``. Returns (full-vocab logits
    [b, s, Vp], values [b, s]) on the first TP rank of DP rank 0, else None."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_s3ac.convert.carried import attach_vision_from_carried, load_model
    from megatron_s3ac.models.actor_critic import build_actor, build_critic, build_transformer_config
    from megatron_s3ac.models.parallel import initialize_model_parallel
    from megatron_s3ac.models.pipeline import forward_backward
    from megatron_s3ac.models.registry import load_hf_config, model_info
    from megatron_s3ac.models.vision import attach_vision, vision_meta, vision_of

    info = model_info(load_hf_config(hf_dir))
    layout.validate(info, dist.get_world_size())
    initialize_model_parallel(layout, seed=1)
    config = build_transformer_config(info, layout)
    actor = build_actor(info, config)
    load_model(actor, mcore_dir)
    assert attach_vision_from_carried(actor, info, trainable=trainable)
    critic = build_critic(info, config)
    sd = {k: v for k, v in actor.state_dict().items() if not k.startswith(("output_layer", "vision_tower."))}
    critic.module.load_state_dict(sd, strict=False)
    with torch.no_grad():
        critic.module.output_layer.weight.copy_(head_w)
        critic.module.output_layer.bias.copy_(head_b)
    attach_vision(critic.module, vision_of(actor), False, vision_meta(actor)[0])

    def keep(batch, output):
        return output.sum() * 0, torch.tensor(1), {"out": output.detach()}

    mb = {"input_ids": ids, "images": images}
    with torch.no_grad():
        logits = forward_backward([actor.eval()], [mb], keep, forward_only=True)[0]["out"]
        values = forward_backward([critic.eval()], [mb], keep, forward_only=True)[0]["out"]
    if layout.tp > 1:
        parts = [torch.empty_like(logits) for _ in range(layout.tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    return (logits, values) if first else None


def vl_trainer_path(hf_dir, actor_init, out_dir, tp, ep, trainable, samples):
    """The trainer's own construction (``build_parallel`` + ``build_actor`` of a VL checkpoint with
    ``train.vision.trainable``) and data path: ``collate`` of image + text samples, DP sharding, padded
    micro-batches of 1 and of 3 rows (``MicroBatcher``), ``forward_only`` log-probs; then one optimizer step
    of ``run_minibatches`` on -sum(log-probs), the export the weight sync sends, and the carried blocks a
    checkpoint would write. Returns a dict of what the test checks (rank 0's, plus per-rank vision grads)."""
    from functools import partial

    import torch.distributed as dist

    from megatron_s3ac.convert import export_hf_weights
    from megatron_s3ac.convert.carried import ATTR, model_sharded_state_dict
    from megatron_s3ac.models.vision import VISION_ATTR, vision_of
    from megatron_s3ac.trainer.step import build as B
    from megatron_s3ac.trainer.step.batch import collate, per_token, next_token_targets
    from megatron_s3ac.config import (AlgoCfg, Config, LayoutCfg, ModelCfg, TrainCfg, VisionCfg,
                                              model_info_for)
    from megatron_s3ac.trainer.step.losses import forward_outputs
    from megatron_s3ac.trainer.step.minibatch import MicroBatcher, forward_only, run_minibatches

    cfg = Config(model=ModelCfg(hf_config=hf_dir, actor_init=actor_init), algo=AlgoCfg(actor_lr=1e-2),
                 actor_layout=LayoutCfg(tp=tp, ep=ep, etp=1 if ep > 1 else None),
                 train=TrainCfg(out_dir=out_dir, vision=VisionCfg(trainable=trainable)))
    info = model_info_for(cfg)
    B.build_parallel(cfg, uses_critic=False)
    m = B.build_actor(cfg, info, B.layout_of(cfg.actor_layout), {})
    tower = vision_of(m.module)
    batch = collate(samples, pad_to=8)
    fo = partial(forward_outputs, what="native_logp", vocab_size=info.vocab_size, temperature=1.0)
    logp = {mbs: forward_only(m.ddp, batch, ["logp"], fo, MicroBatcher(mbs=mbs))[0][0] for mbs in (1, 3)}

    # a parameter in DDP's grad buffers (what the optimizer steps) has a main_grad
    vision_in_opt = any(getattr(p, "main_grad", None) is not None for p in tower.parameters())
    ddp_ids = {id(q) for q in m.ddp.parameters()}
    tower_in_ddp = any(id(p) in ddp_ids for p in tower.parameters())
    before = {n: p.detach().clone() for n, p in tower.hf_named_parameters()}
    lm_before = {n: p.detach().clone() for n, p in m.module.named_parameters() if not n.startswith(VISION_ATTR)}

    def loss(mb, out):
        from megatron_s3ac.models.logprobs import vocab_parallel_log_probs

        lp = per_token(vocab_parallel_log_probs(out, next_token_targets(mb), info.vocab_size, 1.0), mb)
        return -(lp * mb.mask).sum(), mb.mask.sum().long(), {}

    grads = {}
    for r in run_minibatches(m.ddp, m.opt, batch, [(0, torch.arange(len(samples)))], loss, MicroBatcher(mbs=2),
                             before_step=lambda out: {n: p.main_grad.clone() for n, p in tower.hf_named_parameters()
                                                      if getattr(p, "main_grad", None) is not None}):
        grads = r.before_step
    changed = {n: not torch.equal(before[n], p.detach()) for n, p in tower.hf_named_parameters()}
    lm_changed = any(not torch.equal(lm_before[n], p.detach()) for n, p in m.module.named_parameters()
                     if not n.startswith(VISION_ATTR))
    buckets = list(export_hf_weights([m.module], info, bucket_bytes=1 << 16))
    names = [n for bucket in buckets for n, _ in bucket]
    synced = None
    if dist.get_rank() == 0:  # the weight sync's consumer: a multimodal CPU engine of the VL checkpoint
        from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine

        engine = CPUEngine.from_pretrained(hf_dir, tokenizer=None, multimodal=True)
        for bucket in buckets:
            engine.update_weights(bucket)
        visual = dict(engine.model.model.visual.named_parameters())
        synced = all(torch.equal(visual[n[len("model.visual."):]], p.detach())
                     for n, p in tower.hf_named_parameters())
    # what a checkpoint writes of the vision tower: this rank's carried blocks after model_sharded_state_dict
    model_sharded_state_dict(m.module)
    params = dict(tower.hf_named_parameters())
    blocks_current = all(
        torch.equal(t, params[k[len("s3ac_carried."):]].detach()[tuple(slice(o, o + n) for o, n in zip(off, t.shape))])
        for (k, off), t in getattr(m.module, ATTR).blocks.items() if k.startswith("s3ac_carried.model.visual."))
    return dict(rank=dist.get_rank(), logp=logp, mask=batch.mask, vision_in_opt=vision_in_opt, changed=changed,
                lm_changed=lm_changed, names=names, blocks_current=blocks_current, grads=grads,
                requires_grad=[p.requires_grad for p in tower.parameters()], tower_in_ddp=tower_in_ddp,
                synced=synced)


def vl_r3_replay(hf_dir, mcore_dir, layout, ids, images, lens, smp):
    """R3 on image prompts: the VL actor (vision tower from the carried tensors) with routing replay of the
    rollout routes ``smp`` [(tokens [T], routes [T-1, layers, top_k])] over every position, image tokens
    included; one padded micro-batch {input_ids, images}. Returns (log-probs [b, s] on the last stage or None,
    (token, layer) pairs checked on this rank, the MoE layers replayed here)."""
    import torch.distributed as dist

    from megatron_s3ac.convert.carried import attach_vision_from_carried, load_model
    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.optim import wrap_ddp
    from megatron_s3ac.models.parallel import initialize_model_parallel
    from megatron_s3ac.models.registry import load_hf_config, model_info
    from megatron_s3ac.r3.align import padded_placements
    from megatron_s3ac.r3.config import R3Config
    from megatron_s3ac.r3.replay import routing_replay
    from tests.r3 import _r3_common as C

    info = model_info(load_hf_config(hf_dir))
    layout.validate(info, dist.get_world_size())
    initialize_model_parallel(layout, seed=1)
    config = build_transformer_config(info, layout, **R3Config().transformer_config_overrides(info))
    model = build_actor(info, config)
    load_model(model, mcore_dir)
    assert attach_vision_from_carried(model, info)
    ddp = wrap_ddp(model, config, distributed_optimizer=False)
    labels = torch.roll(ids, -1, dims=1)
    mask = torch.zeros(ids.shape)
    for i, n in enumerate(lens):
        mask[i, :n - 1] = 1
    mbs = [{"input_ids": ids, "images": images, "labels": labels, "mask": mask}]
    pls, sids = [padded_placements(lens)], [list(range(len(lens)))]
    routes = C.aligned(ddp, config, info, mbs, pls, sids, smp)
    used = C.UsedExperts(model)
    with torch.no_grad(), routing_replay([ddp], routes):
        lps = C.run(ddp, info, mbs, forward_only=True)
    used.remove()
    checked = C.check_used_equals_rollout(used, config, mbs, pls, sids, smp)
    return (lps[0] if lps else None), checked, sorted(used.maps)

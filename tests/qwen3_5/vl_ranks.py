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

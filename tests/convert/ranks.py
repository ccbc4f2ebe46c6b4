"""Rank bodies for run_distributed (module-level so the forkserver can import them)."""


def megatron_keys(hf_dirs):
    """Per HF dir: ({key: global shape} of tensors, set of object unique keys) of the TP1 actor."""
    return [_keys(d) for d in hf_dirs]


def _keys(hf_dir):
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.models.registry import model_info

    info = model_info(hf_dir)
    initialize_model_parallel(ParallelLayout(), seed=1)
    sd = build_actor(info, build_transformer_config(info, ParallelLayout())).sharded_state_dict()
    apply_factories(sd)
    tensors, objects = {}, set()
    for v in nested_values(sd):
        if isinstance(v, ShardedTensor):
            tensors[v.key] = tuple(v.global_shape)
        elif isinstance(v, ShardedObject):
            objects.add(v.unique_key)
    return tensors, objects


def export_at(hf_dir, ckpt_dir, tp, pp, ep, save_dir=None, bucket_bytes=20_000):
    """Load ``ckpt_dir`` at the layout, optionally save it again (a 'training' checkpoint), export."""
    import os

    from megatron.core import dist_checkpointing

    from megatron_s3ac.convert import export_hf_weights
    from megatron_s3ac.convert.verify import load_actor, make_layout

    info, model = load_actor(hf_dir, ckpt_dir, make_layout(tp, pp, ep))
    if save_dir is not None:
        os.makedirs(save_dir, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), save_dir)
    out, nbuckets = {}, 0
    for bucket in export_hf_weights([model], info, bucket_bytes=bucket_bytes):
        nbuckets += 1
        for name, t in bucket:
            assert name not in out
            out[name] = t.clone()
    return out, nbuckets

"""Rank bodies for tests/rollout/test_colocated_sync.py (module-level: the spawned ranks import them by name)."""
import functools
import os


def make_engine(hf_dir, tp_size, base_gpu_ids, served_shapes, slot):
    """Engine ``slot.index``: the 0.5.23 stand-in behind SGLangEngine with ``tp_size`` TP ranks on CPU slots
    base_gpu_ids[index] .. + tp_size - 1 (the device keys sglang's GPU numbering gives them)."""
    from fake_sglang import FakeSGLangEngine
    from megatron_s3ac.rollout.sglang_engine import SGLangConfig, SGLangEngine

    cfg = SGLangConfig(model_path=hf_dir, tp_size=tp_size, base_gpu_id=base_gpu_ids[slot.index])
    return SGLangEngine(cfg, engine_cls=FakeSGLangEngine, served_shapes=served_shapes,
                        name=f"sglang engine {slot.index}")


def engines(hf_dir, tp_size, base_gpu_ids, served_shapes=None):
    from process_engine_pool import ProcessEnginePool

    factory = functools.partial(make_engine, hf_dir, tp_size, list(base_gpu_ids), served_shapes)
    return ProcessEnginePool(hf_dir, len(base_gpu_ids), factory=factory)


def colocated_rank(hf_dir, ckpt_dir, tp, pp, ep, tp_size, base_gpu_ids, bucket_bytes):
    """Two syncs of the perturbed actor into stand-in engines (each in its own process, driven by rank 0) through
    per-GPU handles. Returns per rank: its pid, the bytes it broadcast per sync; on rank 0 also, per sync and
    engine, {name: max |engine - export|}, the served names nobody sent, the engines' payload logs and engine 0's
    calls."""
    import torch.distributed as dist

    from megatron_s3ac.convert.verify import load_actor, make_layout
    from megatron_s3ac.rollout.colocated import ColocatedIPCSync
    from stage_broadcast_ranks import _export
    from weight_sync_ranks import perturb_

    info, model = load_actor(hf_dir, ckpt_dir, make_layout(tp, pp, ep))
    rank = dist.get_rank()
    pool = engines(hf_dir, tp_size, base_gpu_ids) if rank == 0 else None
    sync = ColocatedIPCSync(pool, timeout_s=120)
    out = {"pid": os.getpid(), "bytes": [], "diffs": [], "unsent": [], "plan": None}
    for _ in range(2):
        perturb_(model)
        st = sync.sync([model], info, bucket_bytes)
        out["bytes"].append(st.bytes)
        ref = _export(model, info, bucket_bytes)
        if rank == 0:
            per_engine = []
            for served in pool.wait([pool.submit(e, "engine.debug_checkpoint_state_dict")
                                     for e in range(len(base_gpu_ids))], "read back"):
                per_engine.append({n: float((served[n] - t).abs().max()) for n, t in ref.items()})
                out["unsent"].append(sorted(set(served) - set(ref)))
            out["diffs"].append(per_engine)
            out["ref_bytes"] = sum(t.numel() * t.element_size() for t in ref.values())
    out["plan"] = sync.roles["plan"]
    if rank == 0:
        out["logs"] = pool.wait([pool.submit(e, "engine.debug_payload_log.copy") for e in range(len(base_gpu_ids))],
                                "payload logs")
        out["calls"] = pool.wait([pool.submit(0, "engine.calls.copy")], "calls")[0]
    sync.close()
    if pool is not None:
        pool.close()
    return out


def refused_rank(hf_dir, ckpt_dir, pp, base_gpu_ids, missing=None):
    """A sync that must fail: engines on devices no trainer rank has (``base_gpu_ids``), or engines that do not serve
    ``missing``. Returns (error text, engine 0's calls) per rank."""
    import torch.distributed as dist

    from megatron_s3ac.convert.verify import load_actor, make_layout
    from megatron_s3ac.rollout.colocated import ColocatedIPCSync
    from megatron_s3ac.rollout.sglang_engine import served_weight_shapes

    info, model = load_actor(hf_dir, ckpt_dir, make_layout(1, pp, 1))
    pool = None
    if dist.get_rank() == 0:
        shapes = None
        if missing:
            shapes = served_weight_shapes(hf_dir)
            shapes.pop(missing)
        pool = engines(hf_dir, 1, base_gpu_ids, shapes)
    try:
        ColocatedIPCSync(pool, timeout_s=60).sync([model], info, 20_000)
    except Exception as err:
        out = f"{type(err).__name__}: {err}"
    else:
        out = None
    calls = pool.wait([pool.submit(0, "engine.calls.copy")], "calls")[0] if pool is not None else None
    if pool is not None:
        pool.close()
    return out, calls

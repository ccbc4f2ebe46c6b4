"""Rank bodies for tests/rollout/test_colocated_sync.py (module-level: the spawned ranks import them by name)."""
import os


def engines(hf_dir, tp_size, base_gpu_ids, served_shapes=None):
    """Stand-in engines, each in its own process: engine e's TP ranks on CPU slots base_gpu_ids[e] .. + tp_size - 1
    (the device keys sglang's GPU numbering gives them)."""
    from process_engine_pool import ProcessEnginePool

    return ProcessEnginePool(hf_dir, len(base_gpu_ids), served_shapes, tp_size=tp_size, base_gpu_ids=base_gpu_ids)


def colocated_rank(hf_dir, ckpt_dir, tp, pp, ep, tp_size, base_gpu_ids, bucket_bytes):
    """Two syncs of the perturbed actor into stand-in engines (each in its own process, driven by rank 0) through
    per-GPU handles. Returns per rank: its pid, the bytes it broadcast per sync; on rank 0 also, per sync and
    engine, {name: max |engine - export|}, the served names nobody sent, the engines' payload logs and engine 0's
    calls."""
    import torch.distributed as dist

    from megatron_s3ac.convert.verify import load_actor, make_layout
    from megatron_s3ac.rollout.engines.sglang.colocated import ColocatedIPCSync
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


def refused_rank(hf_dir, ckpt_dir, pp, base_gpu_ids, missing=None, extra=None):
    """A sync that must fail: engines on devices no trainer rank has (``base_gpu_ids``), engines that do not serve
    ``missing`` (refused by the controller's check of the whole export, before anything moves), or, with ``extra``,
    a stream transform (as the FP8 quantizer is one) that adds an unserved tensor ``extra`` to ``missing``'s bucket
    (refused per bucket, midway). Returns (error text, engine 0's calls, its answer to generate afterwards) per
    rank."""
    import torch.distributed as dist

    from megatron_s3ac.convert.verify import load_actor, make_layout
    from megatron_s3ac.rollout.engines.sglang.colocated import ColocatedIPCSync
    from megatron_s3ac.rollout.engines.sglang.engine import served_weight_shapes
    from stage_broadcast_ranks import adds, refused_outcome

    info, model = load_actor(hf_dir, ckpt_dir, make_layout(1, pp, 1))
    pool = None
    if dist.get_rank() == 0:
        shapes = None
        if missing and extra is None:
            shapes = served_weight_shapes(hf_dir)
            shapes.pop(missing)
        pool = engines(hf_dir, 1, base_gpu_ids, shapes)
    return refused_outcome(lambda: ColocatedIPCSync(pool, timeout_s=60).sync([model], info, 20_000,
                                                                  quantize=adds(missing, extra)), pool)


class ReadBackEngine:
    """The engine side of the hand-over reduced to what sglang does with a flattened payload: TP rank r
    deserializes payload r through the SafeUnpickler model (the stand-in's copy of 0.5.23's allow-list) and
    reconstructs the tensors (weight_sync/tensor_bucket.py); kept by name, per TP rank, for comparison. For dtypes
    the stand-in's model cannot serve (FP8 checkpoints)."""

    def __init__(self, tp_size):
        from types import SimpleNamespace

        self.config = SimpleNamespace(tp_size=tp_size)
        self.tensors = [dict() for _ in range(tp_size)]
        self.calls = []

    def device_keys(self):
        from megatron_s3ac.rollout.engines.sglang.ipc import engine_device_keys

        keys = engine_device_keys(self.config.tp_size)
        return [keys[r] for r in sorted(keys)]

    def check_weights(self, names, shapes):  # what the engine serves is not the point here: everything is
        self.calls.append("check")

    def begin_weight_update(self):
        self.calls.append("begin")

    def end_weight_update(self):
        self.calls.append("end")

    def finish_sync(self, names, require_complete=False):
        self.calls.append("finish")

    def load_serialized_bucket(self, payloads, names, shapes, dtypes=None, nbytes=None):
        import io

        from fake_sglang import SafeUnpicklerModel, _reconstruct, normalize_serialized_named_tensor_payload

        self.calls.append("load")
        for r, p in enumerate(payloads):
            data = SafeUnpicklerModel(io.BytesIO(normalize_serialized_named_tensor_payload(p))).load()
            for n, t in _reconstruct(data):
                self.tensors[r][n] = t.clone()
        return nbytes


def fp8_rank(hf_dir, ckpt_dir, pp, ep, bucket_bytes):
    """One colocated sync with the stage leaders' FP8 quantizer (rollout.weights_dtype=fp8) into a 2-TP-rank
    read-back engine on rank 0. Returns on rank 0 {TP rank: {name: bytes equal to quantize_stream(export)?}}."""
    import torch
    import torch.distributed as dist

    from megatron_s3ac.convert.fp8 import quantize_stream
    from megatron_s3ac.convert.verify import load_actor, make_layout
    from megatron_s3ac.rollout.engines.sglang.colocated import ColocatedIPCSync
    from stage_broadcast_ranks import _export

    info, model = load_actor(hf_dir, ckpt_dir, make_layout(1, pp, ep))
    engine = ReadBackEngine(2) if dist.get_rank() == 0 else None
    ColocatedIPCSync(engine, timeout_s=60).sync([model], info, bucket_bytes, quantize=quantize_stream)
    ref = dict(quantize_stream(sorted(_export(model, info, bucket_bytes).items())))
    if engine is None:
        return None
    raw = lambda t: t.contiguous().view(torch.uint8)
    return {"ref": {n: str(t.dtype) for n, t in ref.items()},
            "ranks": [{n: (n in got and got[n].dtype == ref[n].dtype and got[n].shape == ref[n].shape
                           and torch.equal(raw(got[n]), raw(ref[n]))) for n in ref} for got in engine.tensors],
            "extra": [sorted(set(got) - set(ref)) for got in engine.tensors], "calls": engine.calls}

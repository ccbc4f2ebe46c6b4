"""Rank bodies for tests/rollout/test_stage_broadcast.py (module-level: the forkserver imports them by name)."""
import torch


def _engines(hf_dir, n, served_shapes=None):
    from process_engine_pool import ProcessEnginePool

    return ProcessEnginePool(hf_dir, n, served_shapes)


def _export(model, info, bucket_bytes):
    """The trainer's export, every stage's HF tensors gathered onto every rank (the reference)."""
    import torch.distributed as dist

    from megatron_s3ac.convert.export import export_hf_weights

    mine = {n: t.clone() for b in export_hf_weights([model], info, bucket_bytes) for n, t in b}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    return {n: t for r in rows for n, t in r.items()}


def stage_broadcast_rank(hf_dir, ckpt_dir, tp, pp, ep, n_engines, bucket_bytes):
    """Two syncs of the perturbed actor into n_engines stand-in engines (held by rank 0) through the per-stage
    broadcast groups. Returns, per rank: the bytes this rank broadcast per sync; on rank 0 also, per sync,
    {name: max |engine - export|} for every engine, the names the engines serve but nobody sent, and engine 0's
    calls."""
    import torch.distributed as dist

    from megatron_s3ac.convert.verify import load_actor, make_layout
    from megatron_s3ac.rollout.engines.sglang.broadcast import StageBroadcastSync
    from weight_sync_ranks import perturb_

    info, model = load_actor(hf_dir, ckpt_dir, make_layout(tp, pp, ep))
    rank = dist.get_rank()
    pool = _engines(hf_dir, n_engines) if rank == 0 else None
    sync = StageBroadcastSync(pool, master_address="127.0.0.1", timeout_s=120)
    out = {"bytes": [], "diffs": [], "unsent": [], "calls": None}
    for _ in range(2):
        perturb_(model)
        st = sync.sync([model], info, bucket_bytes)
        out["bytes"].append(st.bytes)
        ref = _export(model, info, bucket_bytes)
        if rank == 0:
            per_engine = []
            for served in pool.wait([pool.submit(e, "engine.debug_checkpoint_state_dict") for e in range(n_engines)],
                                    "read back"):
                per_engine.append({n: float((served[n] - t).abs().max()) for n, t in ref.items()})
                out["unsent"].append(sorted(set(served) - set(ref)))
            out["diffs"].append(per_engine)
            out["ref_bytes"] = sum(t.numel() * t.element_size() for t in ref.values())
    if rank == 0:
        out["calls"] = pool.wait([pool.submit(0, "engine.calls.copy")], "calls")[0]
    sync.close()
    if pool is not None:
        pool.close()
    return out


def refused_rank(hf_dir, ckpt_dir, pp, missing, extra=None):
    """A sync the engines must refuse. ``extra`` None: the engines do not serve ``missing`` (a tensor of the last
    stage), which the controller's check of the whole export refuses before anything moves. ``extra`` a name: a
    stream transform (as the FP8 quantizer is one) adds an unserved tensor ``extra`` to ``missing``'s bucket, which
    only the per-bucket check sees: rank 0 must fail naming it and the stage's leader stop instead of broadcasting
    to nobody. Returns (error text, engine 0's calls, engine 0's answer to generate afterwards) per rank."""
    import torch.distributed as dist

    from megatron_s3ac.convert.verify import load_actor, make_layout
    from megatron_s3ac.rollout.engines.sglang.broadcast import StageBroadcastSync
    from megatron_s3ac.rollout.engines.sglang.engine import served_weight_shapes

    info, model = load_actor(hf_dir, ckpt_dir, make_layout(1, pp, 1))
    pool = None
    if dist.get_rank() == 0:
        shapes = served_weight_shapes(hf_dir)
        if extra is None:
            shapes.pop(missing)
        pool = _engines(hf_dir, 1, served_shapes=shapes)
    sync = StageBroadcastSync(pool, master_address="127.0.0.1", timeout_s=60)
    return refused_outcome(lambda: sync.sync([model], info, 20_000, quantize=adds(missing, extra)), pool)


def adds(missing, extra):
    """A bucket stream transform (as the FP8 quantizer is one) that adds ``extra`` to ``missing``'s bucket."""
    if extra is None:
        return None
    return lambda bucket: list(bucket) + [(extra, t) for n, t in bucket if n == missing]


def refused_outcome(sync, pool):
    """Run ``sync()``; return (its error text or None, engine 0's calls, engine 0's answer to generate) and close
    the pool (rank 0; None elsewhere)."""
    from megatron_s3ac.rollout.base import SamplingParams

    try:
        sync()
    except Exception as err:
        out = f"{type(err).__name__}: {err}"
    else:
        out = None
    calls, gen = None, None
    if pool is not None:
        calls = pool.wait([pool.submit(0, "engine.calls.copy")], "calls")[0]
        try:
            pool.wait([pool.submit(0, "generate", [[1, 2, 3]], SamplingParams(max_new_tokens=2))], "generate")
            gen = "served"
        except Exception as err:
            gen = f"{type(err).__name__}: {err}"
        pool.close()
    return out, calls, gen


def trainer_separate_rank(hf_dir, overrides, n_engines):
    """The Trainer with rollout.engine=sglang, rollout.placement=separate at PP=2: the engines (stand-ins in their own
    processes) are fed by each stage's leader. After the initial sync and each of 2 steps: per engine, the max
    |engine - trainer export| over all tensors and the served names nobody sent (rank 0); bytes each rank broadcast."""
    import torch.distributed as dist

    import megatron_s3ac.trainer.step.build as B
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer
    from process_engine_pool import TrainerTestPool

    from fake_sglang import FakeSGLangEngine
    from megatron_s3ac.rollout.factory import make_engine_factory
    from megatron_s3ac.config import engine_model_dir

    def build_engine(cfg, info, **_kw):  # the trainer's own engine factory, each engine in a process of its own
        factory = make_engine_factory("sglang", model_dir=engine_model_dir(cfg), settings=cfg.rollout.sglang,
                                      seed=cfg.train.seed, engine_cls=FakeSGLangEngine, torch_threads=1)
        return TrainerTestPool(hf_dir, n_engines, factory=factory), False

    B.build_engine = build_engine
    tr = Trainer(load_config(None, overrides))
    rank = dist.get_rank()

    def verify():
        chunks = list(tr.actor) if isinstance(tr.actor, (list, tuple)) else [tr.actor]
        ref = _export(chunks[0], tr.info, 1 << 20)
        if rank != 0:
            return None
        pool = tr.engine
        out = []
        for served in pool.wait([pool.submit(e, "engine.debug_checkpoint_state_dict") for e in range(n_engines)],
                                "read back"):
            out.append((len(ref), max(float((served[n].float() - t.float()).abs().max()) for n, t in ref.items()),
                        sorted(set(served) - set(ref))))
        return out

    res = {"checks": [verify()], "steps": []}
    for _ in range(2):
        res["steps"].append(tr.step())
        res["checks"].append(verify())
    res["bytes"] = tr.sync_weights().bytes  # one more sync: what this rank broadcast
    res["checks"].append(verify())
    tr.close_weight_sync()
    tr.close()
    return res

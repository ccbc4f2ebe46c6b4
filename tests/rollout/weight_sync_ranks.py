"""Rank bodies for tests/rollout/test_weight_sync.py (module-level: the forkserver imports them by name)."""
import torch


def perturb_(model) -> None:
    """p += 0.05 * sin(1000 p): elementwise in the value, so replicated copies (norms on every TP rank,
    tied embedding / output layer on two PP stages) stay equal and any sharding perturbs alike."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.sin(1000.0 * p))


def trainer_log_probs(model, info, tokens):
    """log p(tokens[:, 1:]) [b, s-1] from the megatron actor (on the last stage's TP rank 0 / DP 0; else None)."""
    from megatron.core import parallel_state as ps

    from megatron_s3ac.models.logprobs import vocab_parallel_log_probs
    from megatron_s3ac.models.pipeline import forward_backward

    def loss_fn(batch, output):  # output: logits [b, s, Vp / tp]
        lp = vocab_parallel_log_probs(output[:, :-1], batch["input_ids"][:, 1:], info.vocab_size)
        return output.sum() * 0, torch.tensor(1), {"lp": lp.detach()}

    with torch.no_grad():
        out = forward_backward([model], [{"input_ids": tokens}], loss_fn, forward_only=True)
    last = ps.get_pipeline_model_parallel_world_size() == 1 or ps.is_pipeline_last_stage()
    first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    return out[0]["lp"].clone() if last and first else None


def engine_log_probs(engine, tokens):
    with torch.no_grad():
        logits = engine.model(input_ids=tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]


def sync_rank(hf_dir, ckpt_dir, tp, pp, ep, engine_rank, bucket_bytes, tokens, handoff=True):
    """Load the converted checkpoint at the layout, perturb, sync into a CPU engine on ``engine_rank``.
    Returns {'trainer': lp or None, 'before'/'after': engine lp or None, 'stats': SyncStats}."""
    import torch.distributed as dist

    from megatron_s3ac.convert.verify import load_actor, make_layout
    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
    from megatron_s3ac.rollout.sync.weight_sync import sync_weights

    info, model = load_actor(hf_dir, ckpt_dir, make_layout(tp, pp, ep))
    perturb_(model)
    engine = None
    out = {"trainer": trainer_log_probs(model, info, tokens), "before": None, "after": None}
    if dist.get_rank() == engine_rank:
        engine = CPUEngine.from_pretrained(hf_dir, tokenizer=None)
        out["before"] = engine_log_probs(engine, tokens)
    out["stats"] = sync_weights([model], info, engine, bucket_bytes=bucket_bytes, handoff=handoff)
    if engine is not None:
        out["after"] = engine_log_probs(engine, tokens)
    return out


def sync_fp8_rank(hf_dir, ckpt_dir, tp, pp, ep, engine_rank, bucket_bytes):
    """Sync the perturbed actor twice into FP8-serving CPU engines: quantized on the stage leaders before the
    transfer (``quantize=``), and quantized on the engine rank after it (``Fp8WeightUpdates``). Returns
    {'before'/'after': {name: tensor} engine weights or None, 'stats_before'/'stats_after': SyncStats}."""
    import functools

    import torch.distributed as dist

    from megatron_s3ac.convert.fp8 import Fp8WeightUpdates, quantize_stream
    from megatron_s3ac.convert.verify import load_actor, make_layout
    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
    from megatron_s3ac.rollout.sync.weight_sync import sync_weights

    info, model = load_actor(hf_dir, ckpt_dir, make_layout(tp, pp, ep))
    perturb_(model)
    mine = dist.get_rank() == engine_rank
    pre = CPUEngine.from_pretrained(hf_dir, tokenizer=None) if mine else None
    post = CPUEngine.from_pretrained(hf_dir, tokenizer=None) if mine else None
    out = {"stats_before": sync_weights([model], info, pre, bucket_bytes=bucket_bytes, quantize=quantize_stream),
           "stats_after": sync_weights([model], info, Fp8WeightUpdates(post) if mine else None,
                                       bucket_bytes=bucket_bytes),
           "before": None, "after": None}
    if mine:
        out["before"] = {n: p.detach().clone() for n, p in pre.model.state_dict().items()}
        out["after"] = {n: p.detach().clone() for n, p in post.model.state_dict().items()}
    return out


class _NoBuffer:
    """An engine that only takes ``update_weights`` (like SGLang's session adapter): the export assembles each
    bucket in fresh tensors instead of the engine's memory."""

    def __init__(self, engine):
        self.engine = engine

    def update_weights(self, bucket):
        self.engine.update_weights(bucket)

    def flush_cache(self):
        self.engine.flush_cache()


def engine_tensor(engine, name, like):
    """The engine's copy of checkpoint tensor ``name`` (its parameter memory, or a fresh copy of a fused part)."""
    buf = engine.weight_buffer(name, like.shape, like.dtype)
    if buf is not None:
        return buf
    return engine.model.state_dict()[engine._get_weight_map().resolve(name)]


def sync_stress_rank(hf_dir, ckpt_dir, tp, pp, ep, rounds, shm):
    """Per round ``(bucket_bytes, other_bucket_bytes)`` of ``rounds``: change every weight (a different amount each
    round, in place), sync into a CPU engine on rank 0 with the export's shared-memory handoff ``shm`` (odd rounds
    without the engine's weight_buffer; ranks other than 0 pass ``other_bucket_bytes`` if not None, as the trainer's
    non-engine ranks did), then export twice with ``bucket_bytes`` on every rank: with the same handoff (the trainer
    test's check) and over gloo messages only (shm=False, its own plan: the reference). Returns, on rank 0, per round
    (tensors compared, names whose engine copy differs from the reference at all, names whose handoff export differs
    from it)."""
    import torch.distributed as dist

    from megatron_s3ac.convert.export import export_hf_weights
    from megatron_s3ac.convert.verify import load_actor, make_layout
    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
    from megatron_s3ac.rollout.sync.weight_sync import sync_weights

    info, model = load_actor(hf_dir, ckpt_dir, make_layout(tp, pp, ep))
    rank0 = dist.get_rank() == 0
    engine = CPUEngine.from_pretrained(hf_dir, tokenizer=None) if rank0 else None

    def export(use_shm, bucket_bytes):
        got = {}
        for bucket in export_hf_weights([model], info, bucket_bytes, shm=use_shm):
            got.update({n: t.clone() for n, t in bucket})
        return got

    out = []
    for i, (bucket_bytes, other) in enumerate(rounds):
        mine = bucket_bytes if rank0 or other is None else other
        with torch.no_grad():
            for p in model.parameters():  # elementwise in the value: replicas stay equal
                p.add_((1e-3 * (i + 1)) * torch.sin(1000.0 * p + i))
        target = engine if (engine is None or i % 2 == 0) else _NoBuffer(engine)
        sync_weights([model], info, target, bucket_bytes=mine, export_shm=shm)
        handed, ref = export(shm, bucket_bytes), export(False, bucket_bytes)
        if rank0:
            bad = sorted(n for n, t in ref.items() if not torch.equal(engine_tensor(engine, n, t), t))
            out.append((len(ref), bad, sorted(n for n, t in ref.items() if not torch.equal(handed[n], t))))
    return out if rank0 else None


def export_mismatch_rank(hf_dir, ckpt_dir):
    """Rank 1 asks for other buckets than rank 0: the export must refuse on every rank (returns the message)."""
    import torch.distributed as dist

    from megatron_s3ac.convert.export import export_hf_weights
    from megatron_s3ac.convert.verify import load_actor, make_layout

    info, model = load_actor(hf_dir, ckpt_dir, make_layout(2, 1, 1))
    try:
        for _ in export_hf_weights([model], info, 4_000 if dist.get_rank() == 0 else 1 << 20, shm=True):
            pass
    except ValueError as e:
        return str(e)
    return None

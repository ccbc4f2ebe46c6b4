"""Rank body for tests/qwen3_5/test_weight_sync.py (module-level: the forkserver imports it by name)."""
import torch

# the text-model rank helpers serve the vision-language sync unchanged
from tests.rollout.weight_sync_ranks import engine_log_probs, perturb_, trainer_log_probs

# engine kinds: how the rollout engine is built from the vision-language checkpoint / its config
KINDS = ("multimodal", "text", "config", "config_multimodal")


def build_engine(kind, hf_dir, hf_config):
    from transformers import AutoConfig

    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine

    if kind == "multimodal":
        return CPUEngine.from_pretrained(hf_dir, tokenizer=None, multimodal=True)
    if kind == "text":
        return CPUEngine.from_pretrained(hf_dir, tokenizer=None)
    cfg = AutoConfig.for_model(**hf_config)  # the trainer loop's engine without engine_hf_dir
    return CPUEngine.from_config(cfg, multimodal=kind == "config_multimodal")


def vl_sync(hf_dir, mcore_dir, tp, ep, engine_rank, kinds, tokens, bucket_bytes):
    """Load the converted VL checkpoint at (tp, ep), perturb, then sync into one engine per kind (held
    by ``engine_rank``). Returns {'trainer': lp or None, kind: {...} on the engine rank}."""
    import torch.distributed as dist

    from megatron_s3ac.convert.verify import load_actor, make_layout
    from megatron_s3ac.models.registry import load_hf_config
    from megatron_s3ac.rollout.sync.weight_sync import sync_weights

    hf_config = load_hf_config(hf_dir)
    info, model = load_actor(hf_config, mcore_dir, make_layout(tp=tp, ep=ep))
    perturb_(model)
    out = {"trainer": trainer_log_probs(model, info, tokens)}
    for kind in kinds:
        engine = build_engine(kind, hf_dir, hf_config) if dist.get_rank() == engine_rank else None
        res = {}
        if engine is not None:
            res["class"] = type(engine.model).__name__
            res["before"] = engine_log_probs(engine, tokens)
            res["visual"] = {n: p.detach().clone() for n, p in engine.model.named_parameters() if ".visual." in n}
        res["stats"] = sync_weights([model], info, engine, bucket_bytes=bucket_bytes)
        if engine is not None:
            res["after"] = engine_log_probs(engine, tokens)
            params = dict(engine.model.named_parameters())
            res["visual_untouched"] = all(torch.equal(params[n], t) for n, t in res.pop("visual").items())
            res["n_visual"] = sum(1 for n in params if ".visual." in n)
            out[kind] = res
    return out

"""Device check (issue 14): the SGLang rollout engine on one GPU against transformers, <= 5 min on one H200.

    python tools/device_checks/sglang_smoke.py prepare DIR   # any machine: tiny random bf16 Qwen3-MoE + tokenizer
    python tools/device_checks/sglang_smoke.py run DIR       # GPU + sglang==0.5.23: the checks below
    python tools/device_checks/sglang_smoke.py all DIR       # both
    python tools/device_checks/sglang_smoke.py prepare-fp8 DIR   # any machine (megatron-core): bf16 + FP8 models
    python tools/device_checks/sglang_smoke.py run-fp8 DIR       # GPU + sglang: the FP8 case (check 5)
    python tools/device_checks/sglang_smoke.py all-fp8 DIR       # both

Model (saved locally, nothing downloaded): Qwen3-MoE, bf16, vocab 64 (character tokenizer), hidden 256,
4 layers all sparse (no mlp_only_layers: sglang makes every Qwen3-MoE layer sparse), 8 experts top-2, 4 heads
x head_dim 64 (GQA 4/2). Checks, each printed as one JSON line {"check", "pass", ...figures}:

1. generate: greedy, 8 prompts x 16 tokens, log-probs + routed experts, against transformers teacher-forced on
   the same weights (bf16 on the GPU): argmax agreement (teacher argmax == sampled token), max |d log-prob|,
   router top-k set agreement over all (token, layer) rows. Pass: argmax >= 0.97, router >= 0.95, max dlp < 0.1.
2. update: other weights (seed 1) sent with SGLangEngine.update_weights (one weight-update session, flattened
   buckets), then generation compared with the teacher of the NEW weights (same criteria) and with the old
   tokens (must differ somewhere).
3. memory: torch.cuda.mem_get_info free bytes awake / after sleep() / after wake(["weights"]) + sync /
   after wake(["kv_cache", "cuda_graph"]); pass when sleep frees >= 50 % of what the engine held.
4. ray: an EnginePool of 1 engine (1 GPU, its own placement group) generates the same greedy tokens as check 1.

5. fp8 (separate commands; DIR_fp8, DIR_w1, DIR_w1_fp8 next to DIR): a tiny bf16 Qwen3-MoE whose matrices are
   all SGLang-servable block-FP8 shapes (MODEL_FP8: hidden 256, head_dim 128 so q/k/v/o have 512/256/256/256
   rows, moe_intermediate 128, every layer sparse), converted hf -> torch_dist -> ``mcore_to_hf(dtype="fp8")``
   (the ``s3ac-convert mcore-to-hf --dtype fp8`` path: e4m3 weights, float32 ``*_scale_inv`` [ceil(N/128),
   ceil(K/128)], quantization_config). SGLang serves DIR_fp8 (quantization read from config.json);
   ``fp8_generate`` compares its greedy log-probs and routes with transformers teacher-forced on the
   DEQUANTIZED weights (``FineGrainedFP8Config(dequantize=True)``, exact for these multiple-of-128 shapes)
   and also reports the gap to the bf16 model (the rollout/trainer mismatch FP8 creates). SGLang runs
   fp8 GEMMs with per-token-group fp8 activations, which the dequantized bf16 teacher does not, so the
   pass criteria are looser than check 1 (FP8_PASS; uncalibrated until the first device run: read the
   figures). ``fp8_update``: the seed-1 bf16 weights sent through ``convert.fp8.quantize_stream`` in one
   weight-update session (SGLangEngine.update_weights), compared with the teacher of DIR_fp8_w1 (the
   converter's FP8 checkpoint of the same weights; the streamed pairs must equal its tensors bit for bit).

Exit status 0 when every check passes. Figures go to stdout; a failing check prints its figures too.
"""
from __future__ import annotations

import json
import os
import sys
import time

PROMPTS = ["12+34=", "7+8=", "99+1=", "5+5=", "40+2=", "3+14=", "61+9=", "8+80="]
CHARS = "0123456789+=abcdefghijklmnopqrstuvwxyz .,"
MODEL = dict(vocab_size=64, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
             mlp_only_layers=[], decoder_sparse_step=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_experts=8, num_experts_per_tok=2, max_position_embeddings=512, eos_token_id=1, pad_token_id=0,
             bos_token_id=2, tie_word_embeddings=False, initializer_range=0.1)


# check 5: every quantized matrix a multiple of 128 rows and columns (SGLang's block-FP8 shape rules,
# docs/fp8.md); the router [8, 256], embeddings and LM head stay bf16 (fp8.DEFAULT_KEEP)
MODEL_FP8 = {**MODEL, "head_dim": 128}
FP8_PASS = dict(argmax=0.9, router=0.9, max_dlogprob=0.5)


def prepare(out_dir: str, seed: int = 0, **overrides) -> str:
    """Save the tiny bf16 Qwen3-MoE (random, seeded) and a character tokenizer to out_dir; returns out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from megatron_s3ac.models.tiny_models import char_tokenizer

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**{**MODEL, **overrides})
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    char_tokenizer(CHARS).save_pretrained(out_dir)
    return out_dir


def weights_of(model_dir: str) -> dict:
    """Checkpoint tensors of model_dir (checkpoint names, as a weight sync sends them)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(model_dir, f)))
    return out


def prepare_fp8(out_dir: str, seed: int = 0, **overrides) -> tuple[str, str]:
    """bf16 MODEL_FP8 model in out_dir and its FP8 checkpoint (the converter's mcore-to-hf --dtype fp8,
    via a torch_dist copy in out_dir + "_mcore") in out_dir + "_fp8"; returns (bf16 dir, fp8 dir)."""
    # from the submodules: the package attribute of the same name becomes the module once it is imported
    from megatron_s3ac.convert.hf_to_mcore import hf_to_mcore
    from megatron_s3ac.convert.mcore_to_hf import mcore_to_hf

    prepare(out_dir, seed=seed, **{**MODEL_FP8, **overrides})
    hf_to_mcore(out_dir, out_dir + "_mcore", workers=1, progress=False)
    mcore_to_hf(out_dir + "_mcore", out_dir + "_fp8", dtype="fp8", progress=False)
    return out_dir, out_dir + "_fp8"


def fp8_teacher_model(fp8_dir: str, device: str = "cuda"):
    """transformers on the dequantized FP8 weights (bf16 on device; transformers needs accelerate for it)."""
    import torch
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.bfloat16,
                                                quantization_config=FineGrainedFP8Config(dequantize=True)
                                                ).to(device).eval()


def stream_matches(stream, ckpt: dict) -> bool:
    """Whether (name, tensor) pairs are exactly the checkpoint's tensors (names, dtypes, shapes, bytes)."""
    import torch

    def raw(t):
        return t.contiguous().view(torch.uint8)

    stream = list(stream)
    return (len(stream) == len(ckpt) and {n for n, _ in stream} == set(ckpt)
            and all(t.dtype == ckpt[n].dtype and t.shape == ckpt[n].shape and torch.equal(raw(t), raw(ckpt[n]))
                    for n, t in stream))


def fp8_passes(fig: dict) -> bool:
    return (fig["argmax_agree"] >= FP8_PASS["argmax"] and fig["max_dlogprob"] < FP8_PASS["max_dlogprob"]
            and (fig["router_agree"] or 0) >= FP8_PASS["router"])


def teacher_forced(model, prompt: list[int], response: list[int]):
    """transformers on the same weights: (argmax [R], log-probs of response [R], router top-k [P+R-1, L, k])."""
    import torch

    dev = next(model.parameters()).device
    ids = torch.tensor([prompt + response], device=dev)
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    logits = out.logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
    k = model.config.num_experts_per_tok
    routes = torch.stack([r.view(ids.shape[1], -1).topk(k, -1).indices for r in out.router_logits], 1)[:-1]
    return logits.argmax(-1).cpu().numpy(), lp.cpu().numpy(), routes.cpu().numpy()


def compare(samples, teacher_outputs) -> dict:
    """Agreement figures between engine samples and teacher_forced outputs (same order)."""
    import numpy as np

    argmax = lp = routes = 0.0
    n_tok = n_rows = 0
    max_dlp = 0.0
    for s, (t_argmax, t_lp, t_routes) in zip(samples, teacher_outputs):
        argmax += float((np.asarray(s.response_ids) == t_argmax).sum())
        n_tok += len(s.response_ids)
        if len(s.logprobs):
            max_dlp = max(max_dlp, float(np.abs(np.asarray(s.logprobs) - t_lp).max()))
        if s.routed_experts is not None:
            a, b = np.sort(s.routed_experts, -1), np.sort(t_routes, -1)
            routes += float((a == b).all(-1).sum())
            n_rows += a.shape[0] * a.shape[1]
    return {"argmax_agree": argmax / max(n_tok, 1), "max_dlogprob": max_dlp,
            "router_agree": routes / max(n_rows, 1) if n_rows else None, "tokens": n_tok}


def passes(fig: dict) -> bool:
    return fig["argmax_agree"] >= 0.97 and fig["max_dlogprob"] < 0.1 and (fig["router_agree"] or 0) >= 0.95


def emit(check: str, ok: bool, **fig) -> bool:
    print(json.dumps({"check": check, "pass": bool(ok), **fig}), flush=True)
    return bool(ok)


def run(model_dir: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.factory import SGLangSettings, build_rollout_engine, make_engine_factory
    from megatron_s3ac.rollout.engines.sglang.engine import SGLangConfig, SGLangEngine

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    ok = True

    def teacher_of(path, outs):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
        res = [teacher_forced(model, p, g[0].response_ids) for p, g in zip(prompts, outs)]
        del model
        torch.cuda.empty_cache()
        return res

    free0 = torch.cuda.mem_get_info()[0]
    engine = SGLangEngine(SGLangConfig(model_path=model_dir, dtype="bfloat16", mem_fraction_static=0.3,
                                       enable_return_routed_experts=True, enable_deterministic_inference=True,
                                       enable_memory_saver=True), name="smoke engine")
    try:
        out = engine.generate(prompts, greedy, return_routed_experts=True)
        fig = compare([g[0] for g in out], teacher_of(model_dir, out))
        ok &= emit("generate", passes(fig), **fig)

        other_dir = prepare(model_dir + "_w1", seed=1)
        other = weights_of(other_dir)
        engine.update_weights(other.items(), flattened=True, require_complete=True)
        out2 = engine.generate(prompts, greedy, return_routed_experts=True)
        fig = compare([g[0] for g in out2], teacher_of(other_dir, out2))
        changed = any(a[0].response_ids != b[0].response_ids for a, b in zip(out, out2))
        ok &= emit("update", passes(fig) and changed, changed=changed, sync=engine.last_sync.get("buckets"), **fig)

        awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        asleep = torch.cuda.mem_get_info()[0]
        engine.wake(["weights"])
        engine.update_weights(other.items(), flattened=True, require_complete=True)
        weights_back = torch.cuda.mem_get_info()[0]
        engine.wake(["kv_cache", "cuda_graph"])
        woken = torch.cuda.mem_get_info()[0]
        held = free0 - awake
        freed = asleep - awake
        out3 = engine.generate(prompts, greedy)
        same = all(a[0].response_ids == b[0].response_ids for a, b in zip(out2, out3))
        gib = lambda b: round(b / 2**30, 3)
        ok &= emit("memory", freed >= 0.5 * held and same, engine_gib=gib(held), freed_by_sleep_gib=gib(freed),
                   free_after_weights_gib=gib(weights_back), free_after_wake_gib=gib(woken),
                   same_tokens_after_wake=same)
    finally:
        engine.shutdown()

    pool = build_rollout_engine(make_engine_factory("sglang", model_dir=model_dir, settings=SGLangSettings(
        num_engines=1, gpus_per_engine=1, tp_size=1, gpus_per_node=torch.cuda.device_count(),
        mem_fraction_static=0.3, dtype="bfloat16")))
    try:
        out4 = pool.generate(prompts, greedy)
        first = [g[0].response_ids for g in out]
        same = [g[0].response_ids for g in out4] == first
        ok &= emit("ray", same, engines=pool.num_engines, node=pool.info[0]["node"], seconds=round(time.time() - t0, 1))
    finally:
        pool.close()
    print(json.dumps({"all_pass": bool(ok), "seconds": round(time.time() - t0, 1)}))
    return 0 if ok else 1


def run_fp8(model_dir: str) -> int:
    """Check 5 on model_dir (bf16) / model_dir + "_fp8" / model_dir + "_fp8_w1" written by prepare-fp8."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_s3ac.convert.fp8 import quantize_stream
    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.engines.sglang.engine import SGLangConfig, SGLangEngine

    t0 = time.time()
    fp8_dir, w1_bf16, w1_fp8 = model_dir + "_fp8", model_dir + "_w1", model_dir + "_w1_fp8"
    tok = AutoTokenizer.from_pretrained(fp8_dir)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    ok = True

    def teacher_of(model, outs):
        res = [teacher_forced(model, p, g[0].response_ids) for p, g in zip(prompts, outs)]
        del model
        torch.cuda.empty_cache()
        return res

    engine = SGLangEngine(SGLangConfig(model_path=fp8_dir, dtype="bfloat16", mem_fraction_static=0.3,
                                       enable_return_routed_experts=True, enable_deterministic_inference=True),
                          name="fp8 smoke engine")
    try:
        out = engine.generate(prompts, greedy, return_routed_experts=True)
        fig = compare([g[0] for g in out], teacher_of(fp8_teacher_model(fp8_dir), out))
        bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
        gap = compare([g[0] for g in out], teacher_of(bf16, out))
        ok &= emit("fp8_generate", fp8_passes(fig), bf16_max_dlogprob=gap["max_dlogprob"],
                   bf16_router_agree=gap["router_agree"], **fig)

        stream = list(quantize_stream(weights_of(w1_bf16).items()))
        same_as_ckpt = stream_matches(stream, weights_of(w1_fp8))
        engine.update_weights(stream, flattened=True, require_complete=True)
        out2 = engine.generate(prompts, greedy, return_routed_experts=True)
        fig = compare([g[0] for g in out2], teacher_of(fp8_teacher_model(w1_fp8), out2))
        changed = any(a[0].response_ids != b[0].response_ids for a, b in zip(out, out2))
        ok &= emit("fp8_update", fp8_passes(fig) and changed and same_as_ckpt, changed=changed,
                   stream_equals_checkpoint=same_as_ckpt, sync=engine.last_sync.get("buckets"), **fig)
    finally:
        engine.shutdown()
    print(json.dumps({"all_pass": bool(ok), "seconds": round(time.time() - t0, 1)}))
    return 0 if ok else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("prepare", "run", "all", "prepare-fp8", "run-fp8", "all-fp8"):
        print(__doc__, file=sys.stderr)
        return 2
    cmd, path = argv
    if cmd in ("prepare-fp8", "all-fp8"):
        prepare_fp8(path)
        prepare_fp8(path + "_w1", seed=1)
        print(json.dumps({"prepared": [path, path + "_fp8", path + "_w1", path + "_w1_fp8"]}))
    if cmd == "run-fp8" or cmd == "all-fp8":
        return run_fp8(path)
    if cmd.endswith("-fp8"):
        return 0
    if cmd in ("prepare", "all"):
        prepare(path)
        print(json.dumps({"prepared": path}))
    if cmd in ("run", "all"):
        return run(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

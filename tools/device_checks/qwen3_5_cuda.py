"""Device check (issue 9): tiny Qwen3.5-MoE forward+backward on CUDA with the TE-free torch spec.

  prepare DIR   (CPU machine) write a tiny random Qwen3.5-MoE HF checkpoint (VL layout, fused experts),
                convert it to torch_dist, and store inputs, transformers' CPU fp32 logits, megatron's
                CPU fp32 logits and gradients of a fixed loss into DIR.
  run DIR       (GPU machine) load the converted checkpoint on CUDA (fp32, then bf16), forward+backward,
                print max |logit diff| / |grad diff| against the CPU run and whether fla was used.
                Needs torch + megatron-core + this repo; transformers and safetensors are not needed.

The Gated DeltaNet uses flash-linear-attention when it is importable on the GPU machine, else megatron's
torch kernel (``cpu_compat.patch_missing_fla``). Single process; gloo + the CPU shim on CPU, nccl on GPU.
Model: 8 layers = 2 x (3 GDN + 1 gated attention), hidden 128, 4 q / 2 kv heads of 32 (partial RoPE
0.25), GDN 2 key / 4 value heads of 32, 8 experts top-2 + gated shared expert, vocab 512;
batch 2 x 96 tokens (two 64-token GDN chunks).
"""
import json
import os
import sys

import torch

from megatron_s3ac.models.tiny_models import next_token_nll

TEXT = dict(vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_key_head_dim=32, linear_value_head_dim=32, moe_intermediate_size=64,
            shared_expert_intermediate_size=64)
B, S = 2, 96


def _setup(backend):
    from megatron_s3ac.models.gloo_ranks import init_single_process

    init_single_process(backend, port=29556)


def _model(cfg, dtype=torch.float32, device="cpu"):
    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.models.registry import model_info

    info = model_info(cfg)
    initialize_model_parallel(ParallelLayout(), seed=1)
    config = build_transformer_config(info, ParallelLayout(), dtype=dtype)
    return info, build_actor(info, config, use_te=False).to(device)


def prepare(d):
    from megatron.core import dist_checkpointing

    from megatron_s3ac.convert import hf_to_mcore
    from megatron_s3ac.convert.verify import hf_logits
    from megatron_s3ac.models.registry import load_hf_config
    from megatron_s3ac.models.tiny_qwen3_5 import save_tiny_qwen3_5

    os.makedirs(d, exist_ok=True)
    hf = save_tiny_qwen3_5(os.path.join(d, "hf"), "vl", "fused", seed=0, **TEXT)
    hf_to_mcore(hf, os.path.join(d, "ckpt"), progress=False)
    cfg = load_hf_config(hf)
    ids = torch.randint(0, TEXT["vocab_size"], (B, S), generator=torch.Generator().manual_seed(3))
    ref_hf = hf_logits(hf, ids)
    _setup("gloo")
    info, m = _model(cfg)
    m.load_state_dict(dist_checkpointing.load(m.sharded_state_dict(), os.path.join(d, "ckpt")))
    logits = m(ids, torch.arange(S).expand(B, -1), None)
    next_token_nll(info, logits, ids).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    diff_hf = (logits[..., :info.vocab_size] - ref_hf).abs().max().item()
    # the bf16 yardstick: how far transformers' own bf16 forward of this checkpoint lands from its fp32
    # one (MoE routing flips under bf16 dominate; docs/qwen3_5.md "bf16 drift")
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        hf16 = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16).eval()(input_ids=ids).logits.float()
    hf_bf16_drift = (hf16 - ref_hf).abs().max().item()
    torch.save({"cfg": json.dumps(cfg), "ids": ids, "logits": logits.detach(), "grads": grads, "hf_logits": ref_hf,
                "hf_bf16_drift": torch.tensor(hf_bf16_drift)}, os.path.join(d, "ref.pt"))
    print(f"prepared {d}: logits {tuple(logits.shape)}, CPU megatron vs transformers max |diff| {diff_hf:.3e}, "
          f"transformers bf16 vs fp32 {hf_bf16_drift:.3e}")


def run(d):
    import time

    from megatron.core import dist_checkpointing, parallel_state

    from megatron_s3ac.models.cpu_compat import have_fla, patch_missing_fla

    assert torch.cuda.is_available(), "needs CUDA"
    torch.cuda.set_device(0)
    _setup("nccl")
    ref = torch.load(os.path.join(d, "ref.pt"), weights_only=True)
    cfg = json.loads(ref["cfg"])
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "fla_installed": have_fla(),
           "fla_used": not patch_missing_fla()}
    for dtype in (torch.float32, torch.bfloat16):
        info, m = _model(cfg, dtype, "cuda")
        m.load_state_dict(dist_checkpointing.load(m.sharded_state_dict(), os.path.join(d, "ckpt")))
        ids = ref["ids"].cuda()
        pos = torch.arange(ids.shape[1], device="cuda").expand(ids.shape[0], -1)
        torch.cuda.synchronize()
        t = time.time()
        logits = m(ids, pos, None)
        loss = next_token_nll(info, logits, ids)
        loss.backward()
        torch.cuda.synchronize()
        lf = logits.float().cpu()
        diff = (lf - ref["logits"]).abs().max().item()
        diff_hf = (lf[..., :info.vocab_size] - ref["hf_logits"]).abs().max().item()
        gd = max((p.grad.float().cpu() - ref["grads"][n]).abs().max().item() for n, p in m.named_parameters())
        gmax = max(g.abs().max().item() for g in ref["grads"].values())
        gdn = [n for n, p in m.named_parameters() if ("A_log" in n or "conv1d" in n) and p.grad.abs().sum() > 0]
        out[str(dtype)] = dict(max_abs_logit_diff_vs_cpu=diff, max_abs_logit_diff_vs_transformers_cpu=diff_hf,
                               logit_scale=ref["logits"].abs().max().item(), max_abs_grad_diff=gd, grad_scale=gmax,
                               finite=bool(torch.isfinite(loss).item()), gdn_params_with_grad=len(gdn),
                               fwd_bwd_s=round(time.time() - t, 3))
        parallel_state.destroy_model_parallel()
    print(json.dumps(out, indent=1))
    f32, b16 = out["torch.float32"], out["torch.bfloat16"]
    # bf16: within 1.5x the drift of transformers' own bf16 forward on CPU (routing flips make an
    # absolute bound meaningless: transformers drifts 0.29 on a logit scale of 1.0 here)
    out["bf16_yardstick_transformers_cpu"] = float(ref["hf_bf16_drift"])
    ok = (f32["max_abs_logit_diff_vs_cpu"] < 1e-3 and f32["finite"] and b16["finite"] and f32["gdn_params_with_grad"] > 0
          and b16["max_abs_logit_diff_vs_cpu"] < 1.5 * float(ref["hf_bf16_drift"]) + 1e-2)
    print("DEVICE CHECK", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    {"prepare": prepare, "run": run}[sys.argv[1]](sys.argv[2])

"""Device check (issue 2): tiny Qwen3-MoE forward+backward on CUDA with the TE-free torch spec.

  prepare DIR   (CPU machine) build the model from a seed, save a torch_dist checkpoint, inputs,
                CPU fp32 logits and gradients of a fixed loss into DIR.
  run DIR       (GPU machine) load the same checkpoint on CUDA, run forward+backward in fp32 and a
                bf16 forward, and print max |logit diff| / grad diff against the CPU run.
Single process; on CPU the gloo backend and the CPU shim, on GPU nccl.
"""
import json
import os
import sys

import torch

from megatron_s3ac.models.tiny_models import next_token_nll


def _setup(backend):
    from megatron_s3ac.models.gloo_ranks import init_single_process

    init_single_process(backend, port=29555)


def _model(dtype=torch.float32, device="cpu"):
    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.models.tiny_models import tiny_config

    info = model_info(tiny_config("qwen3_moe", vocab_size=512, hidden_size=256, moe_intermediate_size=128,
                                  num_experts=8, num_attention_heads=8, num_key_value_heads=4,
                                  head_dim=32).to_dict())
    initialize_model_parallel(ParallelLayout(), seed=1)
    torch.manual_seed(0)
    cfg = build_transformer_config(info, ParallelLayout(), dtype=dtype)
    return info, build_actor(info, cfg, use_te=False).to(device)


def prepare(d):
    from megatron.core import dist_checkpointing

    _setup("gloo")
    info, m = _model()
    os.makedirs(d + "/ckpt", exist_ok=True)
    dist_checkpointing.save(m.sharded_state_dict(), d + "/ckpt")
    ids = torch.randint(0, info.vocab_size, (4, 64), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(64).expand(4, -1)
    logits = m(ids, pos, None)
    next_token_nll(info, logits, ids).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    torch.save({"ids": ids, "logits": logits.detach(), "grads": grads}, d + "/ref.pt")
    print("prepared", d, tuple(logits.shape))


def run(d):
    import time

    from megatron.core import dist_checkpointing

    assert torch.cuda.is_available(), "needs CUDA"
    torch.cuda.set_device(0)
    _setup("nccl")
    ref = torch.load(d + "/ref.pt", weights_only=True)
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for dtype in (torch.float32, torch.bfloat16):
        info, m = _model(dtype, "cuda")
        m.load_state_dict(dist_checkpointing.load(m.sharded_state_dict(), d + "/ckpt"))
        ids = ref["ids"].cuda()
        pos = torch.arange(ids.shape[1], device="cuda").expand(ids.shape[0], -1)
        torch.cuda.synchronize(); t = time.time()
        logits = m(ids, pos, None)
        loss = next_token_nll(info, logits, ids)
        loss.backward()
        torch.cuda.synchronize()
        diff = (logits.float().cpu() - ref["logits"]).abs().max().item()
        gd = max((p.grad.float().cpu() - ref["grads"][n]).abs().max().item() for n, p in m.named_parameters())
        gmax = max(g.abs().max().item() for g in ref["grads"].values())
        out[str(dtype)] = dict(max_abs_logit_diff=diff, logit_scale=ref["logits"].abs().max().item(),
                               max_abs_grad_diff=gd, grad_scale=gmax, finite=bool(torch.isfinite(loss).item()),
                               fwd_bwd_s=round(time.time() - t, 3))
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
    print(json.dumps(out, indent=1))
    ok = out["torch.float32"]["max_abs_logit_diff"] < 1e-3 and out["torch.bfloat16"]["max_abs_logit_diff"] < 0.1 * max(1.0, out["torch.bfloat16"]["logit_scale"])
    print("DEVICE CHECK", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    {"prepare": prepare, "run": run}[sys.argv[1]](sys.argv[2])

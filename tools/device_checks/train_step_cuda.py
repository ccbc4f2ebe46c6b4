"""Device check (issue 7): training steps of a ~0.5B dense model on one GPU, TE-free spec.

Builds a Qwen2.5-0.5B-shaped model (random weights; hidden 896, 24 layers, 14/2 heads, FFN 4864,
vocab 151936, tied embeddings) twice in one run:
  * the megatron actor of this project (torch spec: SDPA attention, SPNorm) + megatron's optimizer,
    stepped through megatron_s3ac.models.pipeline.forward_backward, bf16 params;
  * transformers' Qwen2ForCausalLM (sdpa attention) + torch AdamW, bf16.
Reports tokens/s and MFU (model FLOPs 6N + 12*L*h*s per token, vs the H200's 989 TFLOP/s bf16
dense peak) for each, after warm-up steps.

Usage on the GPU machine:  python tools/device_checks/train_step_cuda.py [--steps 6] [--mbs 4] [--seq 2048]
"""
import argparse
import json
import os
import time

import torch

PEAK_BF16 = 989e12
CFG = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
           num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
           rms_norm_eps=1e-6, tie_word_embeddings=True, model_type="qwen2",
           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def flops_per_token(n_params: int, seq: int) -> float:
    return 6 * n_params + 12 * CFG["num_hidden_layers"] * CFG["hidden_size"] * seq


def bench_megatron(args, ids):
    import torch.distributed as dist

    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.logprobs import vocab_parallel_log_probs
    from megatron_s3ac.models.optim import build_optimizer, wrap_ddp
    from megatron_s3ac.models.parallel import ParallelLayout, init_distributed, initialize_model_parallel
    from megatron_s3ac.models.pipeline import forward_backward
    from megatron_s3ac.models.registry import model_info

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed()
    info = model_info(CFG)
    initialize_model_parallel(ParallelLayout(), seed=0)
    config = build_transformer_config(info, ParallelLayout(), dtype=torch.bfloat16)
    actor = build_actor(info, config, use_te=False).cuda()
    n = sum(p.numel() for p in actor.parameters())
    ddp = wrap_ddp(actor, config, distributed_optimizer=True)
    opt = build_optimizer([ddp], lr=1e-5, bf16=True)

    def loss_fn(batch, out):
        lp = vocab_parallel_log_probs(out, batch["labels"], info.vocab_size)
        return -lp.sum(), torch.tensor(lp.numel(), device=lp.device), {}

    mbs = [{"input_ids": ids[i:i + args.mbs, :-1], "labels": ids[i:i + args.mbs, 1:]}
           for i in range(0, ids.shape[0], args.mbs)]
    times = []
    for step in range(args.steps):
        torch.cuda.synchronize(); t = time.time()
        ddp.zero_grad_buffer(); opt.zero_grad()
        forward_backward([ddp], mbs, loss_fn)
        ok, gn, _ = opt.step()
        torch.cuda.synchronize(); times.append(time.time() - t)
    dist.destroy_process_group()
    return n, times, torch.cuda.max_memory_allocated()


def bench_transformers(args, ids):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{k: v for k, v in CFG.items() if k != "model_type"})
    model = Qwen2ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    times = []
    for step in range(args.steps):
        torch.cuda.synchronize(); t = time.time()
        opt.zero_grad(set_to_none=True)
        for i in range(0, ids.shape[0], args.mbs):
            x = ids[i:i + args.mbs]
            out = model(input_ids=x[:, :-1], labels=x[:, 1:].contiguous(), use_cache=False)
            out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        torch.cuda.synchronize(); times.append(time.time() - t)
    return n, times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--gbs", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, CFG["vocab_size"], (args.gbs, args.seq + 1), device="cuda", generator=g)
    tokens = args.gbs * args.seq
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "tokens_per_step": tokens}
    n_m, t_m, mem_m = bench_megatron(args, ids)
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    n_t, t_t = bench_transformers(args, ids)
    mem_t = torch.cuda.max_memory_allocated()
    for name, n, times, mem in (("megatron_s3ac", n_m, t_m, mem_m), ("transformers", n_t, t_t, mem_t)):
        dt = sum(times[args.warmup:]) / len(times[args.warmup:])
        tps = tokens / dt
        res[name] = dict(params=n, step_s=round(dt, 4), tokens_per_s=round(tps), peak_mem_gb=round(mem / 2**30, 2),
                         mfu=round(tps * flops_per_token(n, args.seq) / PEAK_BF16, 4))
    res["speed_ratio_megatron_vs_transformers"] = round(res["megatron_s3ac"]["tokens_per_s"] / res["transformers"]["tokens_per_s"], 3)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

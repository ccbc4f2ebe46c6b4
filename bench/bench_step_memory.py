"""Peak host memory per rank of one actor + critic training step, by precision / offload / recompute.

Two gloo CPU ranks at the demo's layout (EP=2), the models built directly from megatron_s3ac.models:
the demo's Qwen3-MoE (2 layers, hidden 64, 4 experts top-2) and a 10x wider one (hidden 640, FFN
and expert FFN x10, 10 heads of 64). One step = actor forward + backward (token log-prob loss) +
optimizer step, then critic forward + backward (value MSE) + optimizer step, through megatron's
schedules, DDP and distributed optimizer. Settings:
  fp32                       model.dtype=fp32
  bf16                       model.dtype=bf16 (fp32 main params / grads / Adam states)
  bf16+opt_offload           + optim.cpu_offload (megatron's HybridDeviceOptimizer; refused on CPU)
  bf16+opt_offload+recompute + train.recompute=full (runs without the offload on CPU, see the note)
Each setting runs in fresh processes; per rank the resident memory is read from /proc/self/status:
``models`` = RSS after building both models and optimizers minus RSS before, ``step peak`` = VmHWM
during the step (reset via /proc/self/clear_refs) minus RSS before the step, i.e. what the step adds
(activations, gradients' fp32 copies, first-step Adam moments). Reported: the max over ranks.

Run: .venv/bin/python bench/bench_step_memory.py [--batch 32 --seq 64]
"""
import argparse

import torch

SIZES = {
    "demo": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "10x wider": dict(hidden_size=640, intermediate_size=1280, moe_intermediate_size=640, num_attention_heads=10,
                      num_key_value_heads=2, head_dim=64),
}
SETTINGS = {
    "fp32": dict(dtype=torch.float32, cpu_offload=False, recompute="none"),
    "bf16": dict(dtype=torch.bfloat16, cpu_offload=False, recompute="none"),
    "bf16+opt_offload": dict(dtype=torch.bfloat16, cpu_offload=True, recompute="none"),
    "bf16+opt_offload+recompute": dict(dtype=torch.bfloat16, cpu_offload=True, recompute="full"),
}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _config(size: str):
    from megatron_s3ac.models.tiny_models import tiny_config

    return tiny_config("qwen3_moe", vocab_size=32, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                       max_position_embeddings=512, **SIZES[size])


def _rank(size: str, setting: str, batch: int, seq: int):
    import gc

    from megatron_s3ac.models.actor_critic import build_actor, build_critic, build_transformer_config
    from megatron_s3ac.models.logprobs import vocab_parallel_log_probs
    from megatron_s3ac.models.optim import OptimizerUnavailable, build_optimizer, wrap_ddp
    from megatron_s3ac.models.parallel import ParallelContext, ParallelLayout
    from megatron_s3ac.models.pipeline import forward_backward
    from megatron_s3ac.models.registry import model_info

    st = SETTINGS[setting]
    info = model_info(_config(size).to_dict())
    layout = ParallelLayout(ep=2)
    ctx = ParallelContext(layout, seed=1)
    gc.collect()
    rss0 = _status("VmRSS")
    out = {"note": ""}
    with ctx.active():
        torch.manual_seed(0)
        cfgs, ddps, opts = [], [], []
        for role in ("actor", "critic"):
            cfg = build_transformer_config(info, layout, st["dtype"], recompute=st["recompute"])
            model = build_actor(info, cfg) if role == "actor" else build_critic(info, cfg)
            ddp = wrap_ddp(model, cfg)
            try:
                opt = build_optimizer([ddp], lr=1e-4, cpu_offload=st["cpu_offload"])
            except OptimizerUnavailable as e:
                if st["recompute"] == "none":
                    return {"refused": str(e)}
                out["note"] = "optimizer offload refused on CPU: measured without it"
                opt = build_optimizer([ddp], lr=1e-4)
            cfgs.append(cfg)
            ddps.append(ddp)
            opts.append(opt)
        out["params"] = sum(p.numel() for d in ddps for p in d.parameters())
        gc.collect()
        rss1 = _status("VmRSS")
        g = torch.Generator().manual_seed(torch.distributed.get_rank())
        ids = torch.randint(0, info.vocab_size, (batch, seq + 1), generator=g)
        mb = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "target": torch.rand(batch, seq, generator=g)}

        def actor_loss(b, o):
            lp = vocab_parallel_log_probs(o, b["labels"], info.vocab_size)
            return -lp.sum(), torch.tensor(lp.numel()), {}

        def critic_loss(b, o):
            err = (o.float() - b["target"]) ** 2
            return err.sum(), torch.tensor(err.numel()), {}

        _reset_peak()
        for ddp, opt, loss in zip(ddps, opts, (actor_loss, critic_loss)):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            forward_backward([ddp], [mb], loss)
            assert opt.step()[0]
        out["models"] = rss1 - rss0
        out["step_peak"] = _status("VmHWM") - rss1
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    a = ap.parse_args()

    from megatron_s3ac.models.gloo_ranks import run_distributed

    mb = 2**20
    print(f"one actor + critic step, 2 gloo ranks (EP=2), micro-batch {a.batch} x {a.seq} tokens per rank; "
          f"MiB per rank (max over ranks)")
    print(f"{'model':10s} {'setting':28s} {'params/rank':>11s} {'models':>8s} {'step peak':>9s}  note")
    for size in SIZES:
        for setting in SETTINGS:
            res = run_distributed(_rank, 2, size, setting, a.batch, a.seq, timeout=900)
            if "refused" in res[0]:
                print(f"{size:10s} {setting:28s} {'refused':>11s}  {res[0]['refused'][:110]}")
                continue
            print(f"{size:10s} {setting:28s} {max(r['params'] for r in res):11d} "
                  f"{max(r['models'] for r in res) / mb:8.1f} {max(r['step_peak'] for r in res) / mb:9.1f}  "
                  f"{res[0]['note']}")


if __name__ == "__main__":
    main()

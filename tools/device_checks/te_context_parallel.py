"""Device check (issue 28): context parallelism on 2 GPUs, Transformer Engine's CP attention and the torch path.

    torchrun --nproc-per-node 2 tools/device_checks/te_context_parallel.py [OUT_DIR]

Needs 2 CUDA GPUs; the TE case needs transformer_engine (skipped, and said, without it). Tiny Qwen3-MoE
(vocab 512, hidden 256, 4 layers, 8 experts top-2, GQA 8/4 heads of 32, qk-norm), bf16 (TE's CP attention
runs on its flash / fused backends only), batch 2 x 250 tokens (not a multiple of 2 x CP: padded to 256).

For each spec (``te``: TE layers, TE's ``cp_comm_type`` = ``p2p`` ring; ``torch``: this project's SDPA
attention with the K/V all-gather): a CP=1 run (world 2 = DP 2, both ranks the same batch) saves its weights
with dist_checkpointing and records logits and gradients of the summed next-token NLL; the CP=2 run loads
those weights and runs forward + backward through ``models.pipeline.forward_backward`` (the split, DDP over
DP x CP); logits are gathered over CP. Prints JSON (max |diff| / max |ref| for logits and the worst gradient)
and ``DEVICE CHECK PASS|FAIL`` (bf16 bounds: logits 2e-2, gradients 5e-2 relative to the tensor's max).
docs/device_checks/te_context_parallel.md.
"""
import json
import os
import sys
import tempfile

import torch

B, N = 2, 250


def _info():
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.testing.tiny_models import tiny_config

    return model_info(tiny_config("qwen3_moe", vocab_size=512, hidden_size=256, moe_intermediate_size=128,
                                  num_experts=8, num_attention_heads=8, num_key_value_heads=4,
                                  head_dim=32).to_dict())


def _loss(info, batch, out):
    from megatron_s3ac.models.context_parallel import gather_from_cp, split_for_cp
    from megatron_s3ac.models.logprobs import gather_vocab, vocab_parallel_log_probs

    labels, valid = split_for_cp(batch["labels"], 1), split_for_cp(batch["valid"], 1)
    lp = vocab_parallel_log_probs(out.float(), labels, info.vocab_size)
    full = gather_from_cp(gather_vocab(out.detach().float(), info.vocab_size))
    return -(lp * valid).sum(), valid.sum().to(torch.int), {"logits": full[:, :N]}


def _run(spec, cp, ckpt):
    from functools import partial

    from megatron.core import dist_checkpointing, parallel_state

    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.context_parallel import pad_len
    from megatron_s3ac.models.optim import wrap_ddp
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.models.pipeline import forward_backward, prepare_config

    info = _info()
    layout = ParallelLayout(cp=cp)
    initialize_model_parallel(layout, seed=1)
    torch.manual_seed(0)
    config = build_transformer_config(info, layout, torch.bfloat16)
    prepare_config(config)
    model = build_actor(info, config, use_te=spec == "te").cuda()
    if cp == 1:
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt))
    ddp = wrap_ddp(model, config, distributed_optimizer=False)
    ids = torch.randint(0, info.vocab_size, (B, N + 1), generator=torch.Generator().manual_seed(3))
    s = pad_len(N, 8)  # 256 at both CP sizes (2 x cp = 4 divides it)
    inp, labels, valid = (torch.zeros(B, s, dtype=torch.long), torch.zeros(B, s, dtype=torch.long),
                          torch.zeros(B, s))
    inp[:, :N], labels[:, :N], valid[:, :N] = ids[:, :-1], ids[:, 1:], 1.0
    mb = {"input_ids": inp.cuda(), "labels": labels.cuda(), "valid": valid.cuda()}
    ddp.zero_grad_buffer()
    out = forward_backward([ddp], [mb], partial(_loss, info))
    grads = {n: p.main_grad.float().cpu().clone() for n, p in model.named_parameters()}
    logits = out[0]["logits"].cpu()
    parallel_state.destroy_model_parallel()
    return logits, grads


def _rel(a, ref):
    return ((a - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def main():
    import torch.distributed as dist

    from megatron_s3ac.models import cpu_compat
    from megatron_s3ac.models.specs import have_transformer_engine

    assert torch.cuda.is_available() and torch.cuda.device_count() >= 2, "needs 2 CUDA GPUs"
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    cpu_compat.enable()
    dist.init_process_group("nccl")
    out_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="te_cp_")
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    specs = ["torch"] + (["te"] if have_transformer_engine() else [])
    if "te" not in specs:
        res["te"] = "skipped: transformer_engine not importable"
    ok = True
    for spec in specs:
        ckpt = os.path.join(out_dir, spec)
        ref_logits, ref_grads = _run(spec, 1, ckpt)
        logits, grads = _run(spec, 2, ckpt)
        # finalize_model_grads divides by the tokens summed over DP x CP: the per-token mean in both runs
        # (at CP=1 the two DP ranks hold the same batch), so the gradients compare one to one
        worst = max((_rel(grads[n], g), n) for n, g in ref_grads.items() if g.abs().max() > 0)
        res[spec] = {"logits_rel": _rel(logits, ref_logits), "worst_grad_rel": worst[0], "worst_grad": worst[1]}
        ok &= res[spec]["logits_rel"] <= 2e-2 and worst[0] <= 5e-2
    if dist.get_rank() == 0:
        print(json.dumps(res, indent=1))
        print("DEVICE CHECK", "PASS" if ok else "FAIL")
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""Device check (issue 28): context parallelism on 2 GPUs, Transformer Engine's CP attention and the torch paths.

How to run (a machine with >= 2 CUDA GPUs visible, from the repository root, in the project's venv:
``make venv`` / ``.venv/bin/python``; transformer_engine optional):

    CUDA_VISIBLE_DEVICES=0,1 .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tools/device_checks/te_context_parallel.py [OUT_DIR]

It cannot run on one GPU (CP=2 needs two ranks; NCCL does not put two ranks on one GPU). Exit 0 and the
last line ``DEVICE CHECK PASS`` when every spec passes, 1 and ``DEVICE CHECK FAIL`` otherwise; the JSON
before it has the figures. OUT_DIR (default a temp dir) receives the CP=1 weights per spec. Under a minute.

CPU dry run (no GPU, no TE; what this project's CPU machines can run, tests/models/test_context_parallel.py
::test_te_cp_device_check_dry_run): the same script on 2 gloo ranks in fp32, the torch specs only,

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tools/device_checks/te_context_parallel.py --dry-run [OUT_DIR]

What it checks. Tiny Qwen3-MoE (vocab 512, hidden 256, 4 layers, 8 experts top-2, GQA 8/4 heads of 32,
qk-norm), bf16 on GPU (TE's CP attention runs on its flash / fused backends only), batch 2 x 250 tokens (not
a multiple of 2 x CP: padded to 256). Specs: ``torch`` (this project's SDPA attention, K/V all-gather,
``cp_comm: allgather``), ``torch_ring`` (the same with ``cp_comm: ring``), ``te`` (TE layers: TE's own CP
attention, ``TransformerConfig.cp_comm_type`` = ``p2p``, a ring; only when transformer_engine imports,
otherwise reported as skipped). For each spec a CP=1 run (world 2 = DP 2, both ranks the same batch) saves
its weights with dist_checkpointing and records logits and gradients of the summed next-token NLL; the CP=2
run loads those weights and runs forward + backward through ``models.pipeline.forward_backward`` (the split,
DDP over DP x CP); logits are gathered over CP. Prints JSON (max |diff| / max |ref| for logits and the worst
gradient, per spec) and ``DEVICE CHECK PASS|FAIL``. Bounds: bf16 (GPU) logits 2e-2, gradients 5e-2 relative
to the tensor's max; fp32 (--dry-run) 1e-4 both. docs/device_checks/te_context_parallel.md.
"""
import json
import os
import sys
import tempfile

import torch

# this checkout's megatron_s3ac, not an installed copy (the script is run by path)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

B, N = 2, 250


def _info():
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.models.tiny_models import tiny_config

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


def _run(spec, cp, ckpt, device):
    from functools import partial

    from megatron.core import dist_checkpointing, parallel_state

    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.context_parallel import pad_len
    from megatron_s3ac.models.optim import wrap_ddp
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.models.pipeline import forward_backward, prepare_config

    info = _info()
    layout = ParallelLayout(cp=cp, cp_comm="ring" if spec == "torch_ring" else "allgather")
    initialize_model_parallel(layout, seed=1)
    torch.manual_seed(0)
    config = build_transformer_config(info, layout, torch.bfloat16 if device == "cuda" else torch.float32)
    prepare_config(config)
    model = build_actor(info, config, use_te=spec == "te").to(device)
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
    mb = {"input_ids": inp.to(device), "labels": labels.to(device), "valid": valid.to(device)}
    ddp.zero_grad_buffer()
    out = forward_backward([ddp], [mb], partial(_loss, info))
    grads = {n: p.main_grad.float().cpu().clone() for n, p in model.named_parameters()}
    logits = out[0]["logits"].cpu()
    parallel_state.destroy_model_parallel()
    return logits, grads


def _rel(a, ref):
    return ((a - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def main(argv=None):
    import torch.distributed as dist

    from megatron_s3ac.models import cpu_compat
    from megatron_s3ac.models.specs import have_transformer_engine

    args = list(sys.argv[1:] if argv is None else argv)
    dry = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    if dry:
        device, bounds = "cpu", (1e-4, 1e-4)
    else:
        if not (torch.cuda.is_available() and torch.cuda.device_count() >= 2):
            print("te_context_parallel: needs 2 CUDA GPUs (or --dry-run on CPU)", file=sys.stderr)
            sys.exit(2)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device, bounds = "cuda", (2e-2, 5e-2)
    cpu_compat.enable()
    dist.init_process_group("gloo" if dry else "nccl")
    # one directory for both ranks (dist_checkpointing writes and reads it collectively)
    box = [args[0] if args else (tempfile.mkdtemp(prefix="te_cp_") if dist.get_rank() == 0 else None)]
    dist.broadcast_object_list(box, src=0)
    out_dir = box[0]
    res = {"device": "cpu (dry run, fp32)" if dry else torch.cuda.get_device_name(0), "torch": torch.__version__}
    specs = ["torch", "torch_ring"]
    if dry:
        res["te"] = "skipped: dry run (CPU)"
    elif have_transformer_engine():
        specs.append("te")
    else:
        res["te"] = "skipped: transformer_engine not importable"
    ok = True
    for spec in specs:
        ckpt = os.path.join(out_dir, spec)
        os.makedirs(ckpt, exist_ok=True)
        dist.barrier()
        ref_logits, ref_grads = _run(spec, 1, ckpt, device)
        logits, grads = _run(spec, 2, ckpt, device)
        # finalize_model_grads divides by the tokens summed over DP x CP: the per-token mean in both runs
        # (at CP=1 the two DP ranks hold the same batch), so the gradients compare one to one
        worst = max((_rel(grads[n], g), n) for n, g in ref_grads.items() if g.abs().max() > 0)
        res[spec] = {"logits_rel": _rel(logits, ref_logits), "worst_grad_rel": worst[0], "worst_grad": worst[1]}
        ok &= res[spec]["logits_rel"] <= bounds[0] and worst[0] <= bounds[1]
    if dist.get_rank() == 0:
        print(json.dumps(res, indent=1))
        print("DEVICE CHECK", "PASS" if ok else "FAIL")
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""Device check (issue 14): the colocated weight sync (rollout.engines.sglang.colocated.ColocatedIPCSync) into a real SGLang engine on
the trainer's GPUs, each engine TP rank reading CUDA IPC handles from the trainer rank on its GPU. <= 5 min.

    torchrun --nproc-per-node N tools/device_checks/sglang_colocated.py DIR [--pp 1] [--ep 1]
        # N GPUs with sglang==0.5.23 in the same image; N = engine tp_size (one engine, colocated)
    torchrun --nproc-per-node 2 tools/device_checks/sglang_colocated.py DIR --stand-in
        # CPU dry run of the same script: gloo ranks, the tests' 0.5.23 stand-in instead of sglang (no GPU)

Rank 0 saves the tiny bf16 Qwen3-MoE of sglang_smoke.py (head_dim 64, every layer sparse) to DIR and converts it to
torch_dist; every rank loads the Megatron actor at the layout (``--pp`` x ``--ep`` = N); rank 0 starts one SGLang
engine with tp_size = N on GPUs 0..N-1 (``mem_fraction_static`` 0.25: the trainer's model shares the GPUs). Checks,
one JSON line each:

1. plan: every engine TP rank is matched with the trainer rank on its GPU (UUIDs): TP rank r <- trainer rank r.
2. sync: the actor's weights perturbed (seeded); engine.sleep(); wake(["weights"]) -> ColocatedIPCSync.sync ->
   wake(["kv_cache", "cuda_graph"]) (the trainer's order); greedy generation with log-probs and routes compared with
   transformers teacher-forced on the exported weights (sglang_smoke's criteria: argmax >= 0.97, router >= 0.95,
   max |d log-prob| < 0.1) and with the tokens before the sync (must differ somewhere).
3. again: a second perturbation + sync (the receive buffers and handles reused) and the same comparison.
Figures: sync seconds, bytes each rank broadcast, GPU memory free before/after. Exit 0 when every check passes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import sglang_smoke as S  # noqa: E402  (model, prompts, teacher and comparison helpers)


def _perturb(model, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))


def _exported(model, info, group) -> dict:
    """Every stage's HF tensors on rank 0 (CPU), the teacher's weights."""
    import torch.distributed as dist

    from megatron_s3ac.convert.export import export_hf_weights

    mine = {n: t.detach().cpu().clone() for b in export_hf_weights([model], info, 64 << 20, group=group) for n, t in b}
    rows = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, rows, dst=0)
    return {n: t for r in rows for n, t in r.items()} if rows else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--stand-in", action="store_true", help="CPU dry run against tests/rollout/fake_sglang.py")
    a = ap.parse_args(argv)

    from megatron_s3ac.console import silence_known_warnings

    silence_known_warnings()
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not a.stand_in
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        os.environ["S3AC_FORCE_CPU"] = "1"
        from megatron_s3ac.models import cpu_compat

        cpu_compat.enable()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from megatron_s3ac.convert.hf_to_mcore import hf_to_mcore
    from megatron_s3ac.convert.verify import load_actor, make_layout
    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.engines.sglang.colocated import ColocatedIPCSync
    from megatron_s3ac.rollout.engines.sglang.engine import SGLangConfig, SGLangEngine

    hf_dir, mc_dir = os.path.join(a.dir, "hf"), os.path.join(a.dir, "mcore")
    if rank == 0 and not os.path.isdir(mc_dir):
        S.prepare(hf_dir)
        hf_to_mcore(hf_dir, mc_dir, workers=1, progress=False)
    dist.barrier()
    dtype = torch.bfloat16 if cuda else torch.float32
    info, model = load_actor(hf_dir, mc_dir, make_layout(1, a.pp, a.ep), dtype=dtype)
    if cuda:
        model.cuda()
    engine = None
    ok = True
    t0 = time.time()
    free = lambda: round(torch.cuda.mem_get_info()[0] / 2**30, 3) if cuda else None
    if rank == 0:
        cls = None
        if not cuda:
            sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "rollout"))
            from fake_sglang import FakeSGLangEngine as cls
        engine = SGLangEngine(SGLangConfig(model_path=hf_dir, tp_size=world, dtype="bfloat16" if cuda else "float32",
                                           mem_fraction_static=0.25, enable_return_routed_experts=True,
                                           enable_deterministic_inference=True, enable_memory_saver=True),
                              engine_cls=cls, name="colocated smoke engine")
    sync = ColocatedIPCSync(engine, timeout_s=300)
    group = None  # the export group: Megatron's tensor-and-data group (the default)
    try:
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        sync.connect(group)
        plan = sync.roles["plan"]
        if rank == 0:
            ok &= S.emit("plan", plan == [list(range(world))], plan=plan)
        prompts = greedy = before = None
        if rank == 0:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(hf_dir)
            prompts = [tok(p)["input_ids"] for p in S.PROMPTS]
            greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
            before = engine.generate(prompts, greedy, return_routed_experts=True)
        for check, seed in (("sync", 1), ("again", 2)):
            _perturb(model, seed)
            free_before = free()
            if rank == 0:
                engine.sleep()
                engine.wake(["weights"])
            dist.barrier()
            t = time.time()
            st = sync.sync([model], info, 8 << 20, export_group=group)
            seconds = time.time() - t
            if rank == 0:
                engine.wake(["kv_cache", "cuda_graph"])
            sent = [None] * world
            dist.all_gather_object(sent, st.bytes)
            ref = _exported(model, info, group)
            if rank == 0:
                out = engine.generate(prompts, greedy, return_routed_experts=True)
                fig = S.compare([g[0] for g in out], _teacher(hf_dir, ref, prompts, out, cuda))
                changed = any(x[0].response_ids != y[0].response_ids for x, y in zip(before, out))
                ok &= S.emit(check, S.passes(fig) and changed, changed=changed, seconds=round(seconds, 3),
                             bytes_per_rank=sent, tensors=st.tensors, free_gib_before=free_before,
                             free_gib_after=free(), **fig)
                before = out
    finally:
        if engine is not None:
            engine.shutdown()
    if rank == 0:
        print(json.dumps({"all_pass": bool(ok), "seconds": round(time.time() - t0, 1)}), flush=True)
    flag = torch.tensor([1 if ok else 0], device="cuda" if cuda else "cpu")
    dist.broadcast(flag, src=0)
    dist.destroy_process_group()
    return 0 if int(flag.item()) else 1


def _teacher(hf_dir, weights, prompts, outs, cuda):
    """transformers teacher-forced on ``weights`` (the actor's export: checkpoint names) for each greedy sample."""
    import tempfile

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    with tempfile.TemporaryDirectory() as d:
        AutoConfig.from_pretrained(hf_dir).save_pretrained(d)
        save_file({n: t.to(dt).contiguous() for n, t in weights.items()}, os.path.join(d, "model.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(d, dtype=dt).to(dev).eval()
    return [S.teacher_forced(model, p, g[0].response_ids) for p, g in zip(prompts, outs)]


if __name__ == "__main__":
    sys.exit(main())

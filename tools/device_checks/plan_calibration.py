"""Device check (issue 16): calibrate s3ac-plan's activation and overhead constants on one GPU (<= 5 min).

    python tools/device_checks/plan_calibration.py [--tokens 4096 8192] [--experts 64]

Builds a real-width slice of Qwen3.5-397B-A17B (hidden 4096, 32 q / 2 kv heads of 256, GDN 16 key /
64 value heads of 128, MoE top-10 of 1024-wide experts + shared expert; ``--experts`` experts instead
of 512 so the slice fits with its gradients: per-token activations do not depend on the expert count
beyond the router's E-wide logits) as a 4-layer model = 3 Gated DeltaNet + 1 gated attention, each with
its MoE block, in bf16 on one GPU (TP = PP = EP = 1), exactly as the trainer builds it
(models.actor_critic.build_actor). For each token count it runs one forward + backward with the
trainer's log-prob loss and prints:

  * saved-for-backward bytes (``saved_tensors_hooks``) vs the planner's ``held`` estimate, per backend
    formula (``gpu`` = TE / flash / fla, ``cpu`` = this project's torch spec), and the ratio;
  * the CUDA peak (``max_memory_allocated``) above the static states, vs the planner's held + rebuild +
    working + logits;
  * CUDA context: the device memory the driver counts in use (NVML, which needs no CUDA context; else
    ``nvidia-smi``) just before this process creates its context and just after, minus what torch reserved;
    measured first thing, before any other CUDA call (each creates the context). Allocator fragmentation
    (reserved / allocated at the peak - 1);
  * the constants to adopt in megatron_s3ac/plan/constants.py (FRAGMENTATION, CUDA_CONTEXT_GIB, and a
    per-backend activation scale if the ratio is off by more than 10%).

Import-clean without a GPU (everything heavy is imported inside ``main``); exits 1 without CUDA.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

SLICE = dict(hidden_size=4096, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4, full_attention_interval=4, num_experts_per_tok=10, moe_intermediate_size=1024,
             shared_expert_intermediate_size=1024, vocab_size=248320, max_position_embeddings=262144,
             rms_norm_eps=1e-6, tie_word_embeddings=False)


def slice_config(experts: int) -> dict:
    tc = dict(SLICE, num_experts=experts, model_type="qwen3_5_moe_text",
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    return tc


def _nvml_index() -> tuple[str, str]:
    """("index" | "uuid", value) of CUDA device 0 for NVML, which numbers GPUs ignoring CUDA_VISIBLE_DEVICES."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    return ("index", first) if first.isdigit() else ("uuid", first)


def device_used_bytes() -> "int | None":
    """Bytes in use on CUDA device 0 as the driver counts them (every process's allocations and contexts), read
    without creating a CUDA context: NVML (pynvml), else ``nvidia-smi``; None when neither is available."""
    kind, dev = _nvml_index()
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = (pynvml.nvmlDeviceGetHandleByIndex(int(dev)) if kind == "index"
                 else pynvml.nvmlDeviceGetHandleByUUID(dev))
            return int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
        finally:
            pynvml.nvmlShutdown()
    except ImportError:
        pass
    except Exception as err:  # pynvml.NVMLError: no driver / no such device
        print(f"plan_calibration: NVML: {err}", file=sys.stderr)
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", dev],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        return int(float(out.split()[0]) * 1024**2)  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def measure_cuda_context(torch, before: "int | None") -> "float | None":
    """GiB of this process's CUDA context on device 0: ``before`` (device_used_bytes with no context yet) vs the
    same reading once ``set_device`` + ``mem_get_info`` created it, minus torch's reservation; None if unreadable."""
    torch.cuda.set_device(0)
    torch.cuda.mem_get_info()  # needs the context: it exists from here on
    after = device_used_bytes()
    if before is None or after is None:
        return None
    return (after - before - torch.cuda.memory_reserved()) / 1024**3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--experts", type=int, default=64)
    args = p.parse_args(argv)

    before = device_used_bytes()  # first: every CUDA call below creates the context
    import torch

    if not torch.cuda.is_available():
        print("plan_calibration: needs a CUDA GPU", file=sys.stderr)
        return 1
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    context = measure_cuda_context(torch, before)
    print("CUDA context: " + (f"{context:.2f} GiB (NVML before/after this process's context)" if context is not None
                              else "not measured (neither pynvml nor nvidia-smi can read the device)"), flush=True)
    dist.init_process_group("nccl", rank=0, world_size=1)
    from megatron_s3ac.models import cpu_compat
    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.logprobs import vocab_parallel_log_probs
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.plan import constants as C
    from megatron_s3ac.plan.measure import saved_storages
    from megatron_s3ac.plan.memory import Knobs, activation_bytes, layer_kinds, logits_bytes

    cpu_compat.enable()
    t0 = time.time()
    info = model_info(slice_config(args.experts))
    layout = ParallelLayout()
    initialize_model_parallel(layout)
    config = build_transformer_config(info, layout, torch.bfloat16)
    model = build_actor(info, config).cuda()
    try:
        import fla  # noqa: F401

        kernel = "fla"
    except ImportError:
        kernel = "torch (no fla)"
    static = torch.cuda.memory_allocated()
    print(f"slice: {info.num_layers} layers {layer_kinds(info)}, {args.experts} experts, GDN kernel {kernel}; "
          f"params {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B, static {static / C.GIB:.2f} GiB, "
          f"CUDA context {'~%.2f GiB' % context if context is not None else 'not measured'}", flush=True)
    ratios = {"gpu": [], "cpu": []}
    frag = []
    for s in args.tokens:
        torch.cuda.reset_peak_memory_stats()
        ids = torch.randint(0, info.vocab_size, (1, s), device="cuda")
        pos = torch.arange(s, device="cuda").unsqueeze(0)
        with saved_storages(model) as seen:
            logits = model(ids, pos, None)
            lp = vocab_parallel_log_probs(logits, ids, info.vocab_size)
        saved = sum(seen.values())
        lp.float().sum().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - static
        frag.append(torch.cuda.max_memory_reserved() / max(1, torch.cuda.max_memory_allocated()) - 1)
        for backend in ("gpu", "cpu"):
            k = Knobs(dtype="bf16", backend=backend)
            held, rebuild, working = activation_bytes(info, range(info.num_layers), layout, k, s, 1, layer_kinds(info))
            lg_held, lg_train, _ = logits_bytes(s, info.padded_vocab_size, k, s)
            est_saved = held + lg_held
            est_peak = held + rebuild + working + lg_train
            ratios[backend].append(saved / est_saved)
            print(f"  {s:6d} tokens  backend={backend}: saved {saved / C.GIB:7.2f} GiB vs planner {est_saved / C.GIB:7.2f}"
                  f" (x{saved / est_saved:.2f}); peak {peak / C.GIB:7.2f} GiB vs planner {est_peak / C.GIB:7.2f}"
                  f" (x{peak / est_peak:.2f})", flush=True)
        model.zero_grad(set_to_none=True)
        del logits, lp
    print("constants to adopt (megatron_s3ac/plan/constants.py):")
    print(f"  CUDA_CONTEXT_GIB = {max(context, 0.0):.2f}" if context is not None
          else "  CUDA_CONTEXT_GIB: not measured (install nvidia-ml-py or put nvidia-smi on PATH)")
    print(f"  FRAGMENTATION = {max(frag):.2f}")
    backend = "cpu" if kernel.startswith("torch") else "gpu"
    r = sum(ratios[backend]) / len(ratios[backend])
    print(f"  activation scale for backend={backend} (this GPU's kernels): x{r:.2f}"
          + ("  (within 10%: keep the counts)" if abs(r - 1) <= 0.1 else "  (off by > 10%: recount the layer terms)"))
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

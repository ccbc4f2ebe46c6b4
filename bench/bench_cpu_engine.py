"""Samples/s of the CPU engine on a tiny Qwen3-MoE, with its KV cache vs a no-cache baseline.

The baseline recomputes the whole (left-padded) batch every step, which is what generation costs
without a KV cache; both sample the same way. Run: python bench/bench_cpu_engine.py [--samples 128]
"""
import argparse
import time

import torch
from transformers import Qwen3MoeConfig

from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine, sample_tokens


def tiny_config(layers: int) -> Qwen3MoeConfig:
    # The CPU demo's size (shared/notes/cpu_demo_feasibility.md): vocab 15, hidden 64, 4 experts top-2.
    return Qwen3MoeConfig(vocab_size=15, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=4, num_experts_per_tok=2, eos_token_id=14, pad_token_id=13)


@torch.no_grad()
def generate_without_cache(engine: CPUEngine, prompts, params: SamplingParams):
    """Baseline: full forward over prompt + generated tokens at every step (no KV cache)."""
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    gen = torch.Generator().manual_seed(params.seed)
    for _ in range(params.max_new_tokens):
        logits = engine.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1].float()
        tok, _ = sample_tokens(logits, params, gen)
        ids = torch.cat([ids, tok[:, None]], dim=1)
    return ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    engine = CPUEngine.from_config(tiny_config(args.layers), seed=0)
    prompt = [i % 10 for i in range(args.prompt_len)]
    n_prompts = max(1, args.samples // 8)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    runs = {
        "kv_cache": lambda: engine.generate([prompt] * n_prompts, params, n_samples=8),
        "kv_cache+routes": lambda: engine.generate([prompt] * n_prompts, params, n_samples=8, return_routed_experts=True),
        "no_cache": lambda: generate_without_cache(engine, [prompt] * (n_prompts * 8), params),
    }
    print(f"torch threads={torch.get_num_threads()} samples={n_prompts * 8} prompt={args.prompt_len} "
          f"new_tokens={args.new_tokens} layers={args.layers}")
    for name, fn in runs.items():
        fn()  # warm-up
        best = min(_timed(fn) for _ in range(args.repeats))
        print(f"{name:16s} {n_prompts * 8 / best:8.1f} samples/s  {n_prompts * 8 * args.new_tokens / best:9.0f} tokens/s")


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()

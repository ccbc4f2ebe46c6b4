"""Peak host memory of token log-probs + entropy (forward + backward) with and without token chunking.

One TP rank's shard of the logits is simulated: bf16 logits [tokens, V / tp] (Qwen3.5's vocab of
248,320 split over ``--tp`` ranks; the maths per rank is the same at any TP, the TP all-reduces are
of [chunk] vectors). For each setting the process's peak RSS (``/proc/self/status`` VmHWM, reset
through ``/proc/self/clear_refs``) is measured above the baseline that already holds the logits, for
    log p(target) forward + backward (gradient into the logits) + entropy (no grad).
The gradient of the logits (bf16, the logits' size) is needed by any implementation and is part
of both numbers. Printed next to the formula: one fp32 chunk = chunk x V/tp x 4 bytes.

Run: .venv/bin/python bench/bench_logprobs_memory.py [--tokens 16384 --vocab 248320 --tp 16 --chunk 2048]
"""
import argparse
import gc

import torch


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _measure(a, chunk):
    from megatron_s3ac.models.logprobs import vocab_parallel_entropy, vocab_parallel_log_probs
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel

    initialize_model_parallel(ParallelLayout(), seed=0)
    v_local = a.vocab // a.tp
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, a.tokens, v_local, generator=g).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, v_local, (1, a.tokens), generator=g)
    gc.collect()
    _reset_peak()
    base = _status("VmRSS")
    lp = vocab_parallel_log_probs(logits, targets, v_local, chunk_tokens=chunk)
    lp.sum().backward()
    ent = vocab_parallel_entropy(logits.detach(), v_local, chunk_tokens=chunk)
    peak = _status("VmHWM") - base
    return dict(peak=peak, grad_bytes=logits.grad.numel() * logits.grad.element_size(),
                logits_bytes=logits.numel() * logits.element_size(), lp=lp.detach(), ent=ent)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--tp", type=int, default=16, help="simulate one rank of this TP size (V / tp columns)")
    ap.add_argument("--chunk", type=int, default=2048)
    a = ap.parse_args()

    from megatron_s3ac.models.gloo_ranks import run_distributed

    # each setting in a fresh process, so one's peak cannot hide the other's
    chunked = run_distributed(_measure, 1, a, a.chunk)[0]
    full = run_distributed(_measure, 1, a, None)[0]
    v_local = a.vocab // a.tp
    gb = 1e9
    print(f"logits: {a.tokens} tokens x {v_local} columns (vocab {a.vocab} / tp {a.tp}), bf16 "
          f"{chunked['logits_bytes'] / gb:.3f} GB; their bf16 gradient {chunked['grad_bytes'] / gb:.3f} GB")
    print(f"unchunked: peak above baseline {full['peak'] / gb:.3f} GB "
          f"(one fp32 copy of all logits = {a.tokens * v_local * 4 / gb:.3f} GB)")
    print(f"chunk {a.chunk}: peak above baseline {chunked['peak'] / gb:.3f} GB "
          f"(one fp32 chunk = {a.chunk * v_local * 4 / gb:.3f} GB)")
    extra_full = full["peak"] - full["grad_bytes"]
    extra_chunk = chunked["peak"] - chunked["grad_bytes"]
    print(f"beyond the gradient: unchunked {extra_full / gb:.3f} GB, chunked {extra_chunk / gb:.3f} GB "
          f"= {extra_chunk / (a.chunk * v_local * 4):.2f} fp32 chunks")
    print(f"max |lp diff| {(full['lp'] - chunked['lp']).abs().max().item():.2e}, "
          f"max |entropy diff| {(full['ent'] - chunked['ent']).abs().max().item():.2e}")
    print(f"formula at TP=1 (vocab {a.vocab}, {a.tokens} tokens): unchunked fp32 copy "
          f"{a.tokens * a.vocab * 4 / gb:.2f} GB, one chunk of {a.chunk} tokens {a.chunk * a.vocab * 4 / gb:.2f} GB")


if __name__ == "__main__":
    main()

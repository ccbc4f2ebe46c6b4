"""Benchmark: R3 routed-experts storage and alignment, on CPU.

1. Bytes per token of one sample's routes (all num_hidden_layers, as the engine returns them):
   ours (compact dtype from the expert count: uint8 <= 256, int16 <= 32768) vs SGLang's wire format
   (base64 of int32), measured by encoding a real array, plus the raw int32 host buffer SGLang keeps.
2. Cost of alignment per 1M trainer tokens: ``align_microbatch`` (packing, filler rows, SP split,
   local-layer selection, id validation) over packed micro-batches of 16K tokens, then the per-layer
   int64 conversion ``MicroBatchRoutes.layer`` (what ``routing_replay`` hands to the routers; on a
   GPU that conversion runs on the device after a compact host->device copy).
Shapes: Qwen3-30B-A3B (48 layers, top-8, 128 experts) and the 397B shape (60 layers, top-10, 512).
Layouts: PP=1/TP=1 (all layers, no split) and PP=2/TP=2+SP (half the layers, half the positions).
Not a test: run it by hand (the machine is shared; times are medians of a few repeats).

    .venv/bin/python bench/bench_r3.py            # ~1 min on 2 cores
    .venv/bin/python bench/bench_r3.py --quick
"""
from __future__ import annotations

import argparse
import base64
import statistics
import time

import numpy as np
import torch

from megatron_s3ac.r3.align import align_microbatch, packed_placements
from megatron_s3ac.r3.storage import compact_routes, pack_routes, routes_bytes_per_token, sglang_bytes_per_token

SHAPES = {"Qwen3-30B-A3B": (48, 8, 128), "397B-A17B shape": (60, 10, 512)}
LAYOUTS = {"pp1 tp1": (1, 1), "pp2 tp2+sp": (2, 2)}


def sample_routes(rng, T, L, K, E):
    """[T-1, L, K] distinct ids per row (argsort of random keys; like a router's top-k)."""
    keys = rng.random((T - 1, L, E), dtype=np.float32)
    return compact_routes(np.argpartition(keys, K, axis=-1)[..., :K], E)


def bytes_table(rng):
    print("## bytes per token (one sample, all layers)")
    print(f"{'model':18s} {'ours dtype':>10s} {'ours B/tok':>10s} {'sglang b64':>11s} {'sglang int32':>12s} {'ratio':>6s}")
    for name, (L, K, E) in SHAPES.items():
        T = 4097
        r = sample_routes(rng, T, L, K, E)
        ours = (len(pack_routes(r)) - 16) / (T - 1)
        b64 = len(base64.b64encode(r.astype("<i4").tobytes())) / (T - 1)  # what SGLang sends
        assert ours == routes_bytes_per_token(L, K, E) and abs(b64 - sglang_bytes_per_token(L, K)) < 1
        print(f"{name:18s} {str(r.dtype):>10s} {ours:10.0f} {b64:11.0f} {L * K * 4:12d} {b64 / ours:6.2f}")
        print(f"{'':18s} a 32K-token sample: ours {ours * 32768 / 2**20:.1f} MiB, SGLang b64 {b64 * 32768 / 2**20:.1f} MiB")


def align_cost(rng, repeats, total_tokens):
    print(f"\n## alignment cost (packed micro-batches of 16384 tokens, {total_tokens} tokens measured, "
          "scaled to 1M)")
    print(f"{'model':18s} {'layout':12s} {'align ms/1M':>12s} {'no-validate':>12s} {'to int64 ms/1M':>15s}")
    s = 16384
    for name, (L, K, E) in SHAPES.items():
        lengths = []
        while sum(lengths) < total_tokens:
            lengths.append(int(rng.integers(512, 4097)))
        pool = [sample_routes(rng, T, L, K, E) for T in sorted(set(lengths))[:8]]  # reuse a few arrays
        samples = [pool[i % len(pool)] for i in range(len(lengths))]
        lengths = [r.shape[0] + 1 for r in samples]
        mbs, cur = [], []  # greedy packing into micro-batches of at most s tokens
        for i, n in enumerate(lengths):
            if sum(lengths[j] for j in cur) + n > s:
                mbs.append(cur)
                cur = []
            cur.append(i)
        mbs.append(cur)
        tokens = sum(lengths)
        for lname, (pp, tp) in LAYOUTS.items():
            layers = list(range(L // pp))  # stage 0's layers (all MoE for these models)

            def align_all(validate):
                return [align_microbatch([samples[i] for i in mb], packed_placements([lengths[i] for i in mb]),
                                         (1, s), layers, E, sp_rank=0, sp_size=tp, validate=validate)
                        for mb in mbs]

            def timed(fn):
                t0 = time.perf_counter()
                fn()
                return time.perf_counter() - t0

            aligned = align_all(False)
            scale = 1e6 / tokens * 1e3  # seconds for `tokens` -> ms per 1M tokens
            t_val = statistics.median(timed(lambda: align_all(True)) for _ in range(repeats)) * scale
            t_noval = statistics.median(timed(lambda: align_all(False)) for _ in range(repeats)) * scale
            t_conv = statistics.median(timed(lambda: [out.layer(x) for out in aligned for x in layers])
                                       for _ in range(repeats)) * scale
            print(f"{name:18s} {lname:12s} {t_val:12.0f} {t_noval:12.0f} {t_conv:15.0f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the alignment is single-threaded numpy; avoid OpenMP contention on shared cores
    rng = np.random.default_rng(0)
    bytes_table(rng)
    align_cost(rng, repeats=1 if args.quick else 3, total_tokens=65536 if args.quick else 262144)


if __name__ == "__main__":
    main()

"""update_weights throughput (bytes/s): RemoteEngine (CPU engine in a Ray actor) vs the same engine in-process.

Both engines hold the same ~300 MB fp32 Qwen3-architecture model; the same HF-named state dict of
another seed is pushed into each (after one warm-up update, which builds the CPU engine's name map).
Local: ``CPUEngine.update_weights`` copies each tensor into its parameter. Remote: bucketing, one copy
into Ray's shared-memory object store, zero-copy read in the actor, the same parameter copy there.
Prints bytes/s of each and the ratio, measured in one run. Run:

    python bench/bench_remote_engine.py [--bucket-mb 256] [--repeats 3] [--layers 4] [--hidden 768]
"""
import argparse
import functools
import statistics
import time

import torch
from transformers import Qwen3Config
from transformers.core_model_loading import revert_weight_conversion

from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
from megatron_s3ac.rollout.engines.cpu.remote import RemoteEngine


def model_config(a) -> Qwen3Config:
    cfg = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 8 // 3,
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64, num_key_value_heads=4,
                      head_dim=64, tie_word_embeddings=False, max_position_embeddings=512)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    return cfg


def timed(fn, repeats):
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--max-inflight", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, in this process and in the actor")
    a = ap.parse_args()
    import ray

    torch.set_num_threads(a.threads)
    cfg = model_config(a)
    factory = functools.partial(CPUEngine.from_config, cfg, seed=0)
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        local = factory()
        remote = RemoteEngine(factory, bucket_bytes=a.bucket_mb << 20, max_inflight=a.max_inflight,
                              torch_threads=a.threads)
        src = CPUEngine.from_config(cfg, seed=1).model
        sd = revert_weight_conversion(src, dict(src.state_dict()))
        del src
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        local.update_weights(sd.items())  # warm-up: builds the name map on both sides
        remote.update_weights(sd.items())
        t_local = timed(lambda: local.update_weights(sd.items()), a.repeats)
        t_remote = timed(lambda: remote.update_weights(sd.items()), a.repeats)
        st = remote.last_update
        greedy = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
        same = remote.generate([[1, 2, 3]], greedy)[0][0].response_ids == local.generate([[1, 2, 3]], greedy)[0][0].response_ids
        remote.close()
    finally:
        ray.shutdown()

    best_l, best_r = min(t_local), min(t_remote)
    med_l, med_r = statistics.median(t_local), statistics.median(t_remote)
    print(f"model: Qwen3 arch, {len(sd)} tensors, {nbytes / 1e6:.1f} MB fp32; bucket {a.bucket_mb} MB -> "
          f"{st.buckets} buckets (largest {max(st.bucket_sizes) / 1e6:.1f} MB), max_inflight {a.max_inflight}, "
          f"{a.threads} torch thread(s) per process; same greedy tokens after update: {same}")
    print(f"{'':8s} {'best s':>8s} {'median s':>9s} {'best GB/s':>10s} {'median GB/s':>12s}")
    for name, best, med in (("local", best_l, med_l), ("remote", best_r, med_r)):
        print(f"{name:8s} {best:8.3f} {med:9.3f} {nbytes / best / 1e9:10.2f} {nbytes / med / 1e9:12.2f}")
    print(f"remote / local bytes/s: {best_l / best_r:.2f} (best), {med_l / med_r:.2f} (median)")


if __name__ == "__main__":
    main()

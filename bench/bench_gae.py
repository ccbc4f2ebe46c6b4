"""Benchmark: vectorised compute_gae vs the per-token reverse loop (verl / TRL form), on CPU.

Reports, for [16, 16384] and [4, 65536]: loop time, vectorised time (median), speedup, max |diff|;
then vectorised time vs T (linear growth), then numerical stability at T = 65536 for
lambda in [0.9, 1] against a float64 loop. Not a test: run it by hand.

    .venv/bin/python bench/bench_gae.py            # full run (~1 min on 2 cores)
    .venv/bin/python bench/bench_gae.py --quick    # fewer repeats, no hole-mask / stability sweep
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_s3ac.algorithms import compute_gae, length_adaptive_lambda, terminal_rewards


def gae_loop(rewards, values, mask, gamma, lam):
    """verl's compute_gae_advantage_return (mask-skipping form), one Python step per token."""
    B, T = values.shape
    lam = lam if isinstance(lam, torch.Tensor) else torch.full((B,), float(lam), dtype=torch.float64)
    lam = lam.to(device=values.device, dtype=values.dtype)
    nextvalues = torch.zeros(B, dtype=values.dtype, device=values.device)
    lastgaelam = torch.zeros(B, dtype=values.dtype, device=values.device)
    out = []
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        out.append(lastgaelam)
    adv = torch.stack(out[::-1], dim=1) * mask
    return adv, (adv + values) * mask


DEVICE = torch.device("cpu")


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def make_batch(B, T, seed=0, holes=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    lengths[0] = T  # at least one full-length row
    mask = (torch.arange(T) < lengths[:, None]).float()
    if holes:  # e.g. masked tool-observation spans inside the response
        mask = mask * (torch.rand(B, T, generator=g) > 0.1).float()
    values = torch.rand(B, T, generator=g) * 2 - 1
    scores = torch.where(torch.rand(B, generator=g) < 0.5, 1.0, -1.0)
    rewards = terminal_rewards(scores, mask)
    return rewards.to(DEVICE), values.to(DEVICE), mask.to(DEVICE)


def timeit(fn, repeats):
    fn()  # warm-up
    sync()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts)


def compare(B, T, repeats, holes=False):
    r, v, m = make_batch(B, T, holes=holes)
    lam = length_adaptive_lambda(m.sum(1), alpha=1.5).to(DEVICE)  # S3AC actor lambda, per sequence
    sync()
    t0 = time.perf_counter()
    adv_loop32, _ = gae_loop(r, v, m, 1.0, lam.float())  # verl runs this in float32
    sync()
    t_loop = time.perf_counter() - t0
    adv_loop64, ret_loop64 = gae_loop(r.double(), v.double(), m.double(), 1.0, lam)  # reference
    med, best = timeit(lambda: compute_gae(r, v, m, 1.0, lam), repeats)
    adv, ret = compute_gae(r, v, m, 1.0, lam)
    d64 = max((adv.double() - adv_loop64).abs().max().item(), (ret.double() - ret_loop64).abs().max().item())
    d32 = (adv.double() - adv_loop32.double()).abs().max().item()
    tag = "holes " if holes else "rpad  "
    print(
        f"[{B:>2}, {T:>5}] {tag} loop {t_loop * 1e3:9.1f} ms | vectorised median {med * 1e3:7.2f} ms "
        f"(min {best * 1e3:6.2f}) | speedup {t_loop / med:7.0f}x (vs min {t_loop / best:6.0f}x) | "
        f"max|diff| vs f64 loop {d64:.1e}, vs f32 loop {d32:.1e}"
    )
    return t_loop / med, d64


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = 5 if args.quick else 20
    print(
        f"torch {torch.__version__}, device {DEVICE}, threads {torch.get_num_threads()}, "
        "lambda = 1 - 1/(1.5 T), gamma = 1"
    )
    print("== vectorised vs per-token loop ==")
    for B, T in ((16, 16384), (4, 65536)):
        compare(B, T, reps)
    if not args.quick:
        compare(16, 16384, reps, holes=True)

    print("== vectorised time vs T (B = 4, right padded) ==")
    for T in (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072):
        r, v, m = make_batch(4, T, seed=1)
        med, _ = timeit(lambda: compute_gae(r, v, m, 1.0, 0.995), reps)
        print(f"T = {T:>6}: {med * 1e3:7.2f} ms  ({med / (4 * T) * 1e9:6.1f} ns/token)")

    if not args.quick:
        print("== stability at T = 65536 (B = 2, float32 in, vs float64 loop) ==")
        r, v, m = make_batch(2, 65536, seed=2)
        for lam in (0.9, 0.95, 0.99, 0.995, 0.999, 0.9999, 1.0):
            adv, ret = compute_gae(r, v, m, 1.0, lam)
            ref, _ = gae_loop(r.double(), v.double(), m.double(), 1.0, lam)
            finite = bool(torch.isfinite(adv).all() and torch.isfinite(ret).all())
            print(f"lambda {lam:<7}: max|diff| {(adv.double() - ref).abs().max().item():.1e}  finite={finite}")


if __name__ == "__main__":
    main()

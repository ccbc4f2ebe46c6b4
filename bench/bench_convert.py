"""Benchmark ``s3ac-convert`` against ``cp -r`` on a Qwen3-MoE-shaped checkpoint (not a test).

For each size: write a random bf16 checkpoint in the hub layout shard by shard (real Qwen3-30B-A3B
tensor shapes: hidden 2048, 32 q / 4 kv heads of 128, experts of 768, vocab 151936; fewer experts
and layers so it fits the disk), then time, in the same run:
  cp -r HF        | hf-to-mcore (CLI subprocess) | cp -r MCORE | mcore-to-hf (CLI subprocess)
and print GB/s, the ratio to cp of the same input, and the converter's peak RSS (``wait4`` rusage of
that child). ``sync`` runs between steps so write-back of one step does not land in the next; each
step runs ``--repeat`` times and the best time counts (the machine may be shared).

    .venv/bin/python bench/bench_convert.py --dir /tmp/s3ac_bench --layers 5 14 --experts 32 --repeat 2
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import torch

from megatron_s3ac.convert.safetensors_io import INDEX, ShardWriter

SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
             moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936, num_experts_per_tok=8)


def hf_config(layers: int, experts: int) -> dict:
    return dict(SHAPE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=layers,
                num_experts=experts, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6}, hidden_act="silu", dtype="bfloat16")


def hub_tensors(cfg: dict):
    """(name, shape) in the hub order of a Qwen3-MoE checkpoint."""
    h, d, nh, ng = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    f, v, e = cfg["moe_intermediate_size"], cfg["vocab_size"], cfg["num_experts"]
    yield "model.embed_tokens.weight", (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        for n, rows in (("q", nh * d), ("k", ng * d), ("v", ng * d)):
            yield p + f"self_attn.{n}_proj.weight", (rows, h)
        yield p + "self_attn.q_norm.weight", (d,)
        yield p + "self_attn.k_norm.weight", (d,)
        yield p + "self_attn.o_proj.weight", (h, nh * d)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate.weight", (e, h)
        for x in range(e):
            yield p + f"mlp.experts.{x}.gate_proj.weight", (f, h)
            yield p + f"mlp.experts.{x}.up_proj.weight", (f, h)
            yield p + f"mlp.experts.{x}.down_proj.weight", (h, f)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def write_random_hf(out: str, cfg: dict, shard_bytes: int = 1 << 30) -> int:
    """Random bf16 weights, one shard at a time, from a 64 MiB random pool (tensors start at
    different pool offsets, so they differ). Returns the total tensor bytes."""
    os.makedirs(out)
    pool = torch.randn(32 << 20, dtype=torch.bfloat16)
    tensors = [(n, s, torch.bfloat16) for n, s in hub_tensors(cfg)]
    shards, cur, size = [], [], 0
    for t in tensors:
        n = 2 * int(torch.Size(t[1]).numel())
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += n
    shards.append(cur)
    weight_map, total, at = {}, 0, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        w = ShardWriter(os.path.join(out, fname), shard)
        for name, shape, _ in shard:
            numel = int(torch.Size(shape).numel())
            done = 0
            while done < numel:  # pool-sized pieces: never more than 64 MiB extra in memory
                k = min(numel - done, pool.numel() - at)
                total += w.write(pool[at:at + k])
                done += k
                at = (at + k + 7919) % (pool.numel() - 1)
            weight_map[name] = fname
        w.close()
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, open(os.path.join(out, INDEX), "w"))
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
    return total


def timed(cmd: list[str]) -> tuple[float, int, float]:
    """(seconds, peak RSS in bytes of that child, seconds the converter itself reports (its summary
    line; excludes interpreter start-up and imports) or the wall time) of a subprocess."""
    subprocess.run(["sync"], check=True)
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.time() - t0
    out, err = p.stdout.read(), p.stderr.read()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{err[-2000:]}")
    m = re.search(r"GB in ([0-9.]+) s", out)
    if out.strip():
        print("   ", out.strip().splitlines()[-1])
    return dt, ru.ru_maxrss * 1024, float(m.group(1)) if m else dt


def bench_size(root: str, layers: int, experts: int, workers: int, repeat: int) -> dict:
    """Best of ``repeat`` for each of the four steps (this machine is shared: best-of filters noise
    from other jobs for cp and converter alike)."""
    base = os.path.join(root, f"L{layers}")
    hf, mc, back, cp1, cp2 = (os.path.join(base, x) for x in ("hf", "mcore", "hf_back", "cp_hf", "cp_mcore"))
    os.makedirs(base)
    total = write_random_hf(hf, hf_config(layers, experts))
    cli = [sys.executable, "-m", "checkpoints_convert"]
    r = {"layers": layers, "experts": experts, "GB": total / 1e9}
    runs = {k: [] for k in ("cp_hf", "h2m", "cp_mc", "m2h")}
    for _ in range(repeat):
        for d in (mc, back):
            shutil.rmtree(d, ignore_errors=True)
        runs["cp_hf"].append(timed(["cp", "-r", hf, cp1]))
        shutil.rmtree(cp1)
        runs["h2m"].append(timed(cli + ["hf-to-mcore", "--hf", hf, "--out", mc, "--workers", str(workers),
                                        "--no-progress"]))
        runs["cp_mc"].append(timed(["cp", "-r", mc, cp2]))
        shutil.rmtree(cp2)
        runs["m2h"].append(timed(cli + ["mcore-to-hf", "--mcore", mc, "--out", back, "--no-progress"]))
    for k, v in runs.items():
        r[k + "_s"] = min(t for t, _, _ in v)
        r[k + "_rss"] = max(m for _, m, _ in v)
        r[k + "_core_s"] = min(c for _, _, c in v)
    shutil.rmtree(base)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/s3ac_bench")
    ap.add_argument("--layers", type=int, nargs="+", default=[5, 14])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="runs per step; the best time is reported")
    args = ap.parse_args()
    if os.path.exists(args.dir):
        sys.exit(f"{args.dir} exists; remove it or pass another --dir")
    os.makedirs(args.dir)
    try:
        free = shutil.disk_usage(args.dir).free
        rows = []
        for L in args.layers:
            need = 4.5 * (0.62 + L * (0.04 + args.experts * 3 * 768 * 2048 * 2 / 1e9)) * 1e9
            if need > free * 0.8:
                sys.exit(f"not enough disk for {L} layers: need ~{need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
            print(f"== {L} layers x {args.experts} experts")
            rows.append(bench_size(args.dir, L, args.experts, args.workers, args.repeat))
        print(f"\n{'size':>8} {'cp HF':>9} {'hf->mcore':>10} {'ratio':>6} {'RSS':>8} | {'cp MCORE':>9} "
              f"{'mcore->hf':>10} {'ratio':>6} {'RSS':>8}")
        for r in rows:
            g = r["GB"]
            print(f"{g:7.2f}G {g / r['cp_hf_s']:7.2f}/s {g / r['h2m_s']:8.2f}/s {r['cp_hf_s'] / r['h2m_s']:6.2f} "
                  f"{r['h2m_rss'] / 2**20:6.0f}MB | {g / r['cp_mc_s']:7.2f}/s {g / r['m2h_s']:8.2f}/s "
                  f"{r['cp_mc_s'] / r['m2h_s']:6.2f} {r['m2h_rss'] / 2**20:6.0f}MB")
        print("(GB/s; ratio = converter throughput / cp -r throughput of the same input; RSS = converter peak)")
        print("\nwithout the converter's interpreter start-up and imports (its own summary line):")
        for r in rows:
            g = r["GB"]
            print(f"{g:7.2f}G hf->mcore {g / r['h2m_core_s']:5.2f}/s = {r['cp_hf_s'] / r['h2m_core_s']:.2f}x cp | "
                  f"mcore->hf {g / r['m2h_core_s']:5.2f}/s = {r['cp_mc_s'] / r['m2h_core_s']:.2f}x cp")
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()

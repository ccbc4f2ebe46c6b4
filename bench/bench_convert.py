"""Benchmark ``s3ac-convert`` against ``cp -r`` on a Qwen3-MoE-shaped checkpoint (not a test).

For each size: write a random bf16 checkpoint in the hub layout shard by shard (real Qwen3-30B-A3B
tensor shapes: hidden 2048, 32 q / 4 kv heads of 128, experts of 768, vocab 151936; fewer experts
and layers so it fits the disk), then time, in the same run:
  cp -r HF        | hf-to-mcore (CLI subprocess) | cp -r MCORE | mcore-to-hf (CLI subprocess)
and print GB/s, the ratio to cp of the same input, and the converter's peak RSS (``wait4`` rusage of
that child). ``sync`` runs (untimed) before every step so write-back of one step does not land in the
next; each step runs ``--repeat`` times and the best time counts (the machine may be shared).

Like with like: ``cp -r`` and the converter both read their input from the page cache (it was just
written) and both return without fsync (the kernel writes back later); both are timed from outside as
a fresh process (``ext``: what a user sees, interpreter start-up and imports included). The
converter's own figure (``int``: its summary line, from reading the input headers to the last byte
written) is printed beside it. Per repeat, each converter run follows a cp run of the same input;
the table also shows the median of those paired ratios, and the 1-minute load average at each step.

    .venv/bin/python bench/bench_convert.py --dir /tmp/s3ac_bench --layers 5 14 --experts 32 --repeat 2
    .venv/bin/python bench/bench_convert.py --arch qwen3_5_vl --dir /tmp/s3ac_bench_vl --layers 4 12 --experts 32

``--arch qwen3_5_vl``: the complete Qwen3.5-35B-A3B VL checkpoint's shapes (its 27-block vision tower and MTP layer,
which the converter carries as is in row blocks, beside the language model), to show the same streaming and memory
bound for the carried tensors; the round trip is checked bit for bit.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

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


QWEN3_5_35B = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "hf_configs", "qwen3_5_35b_a3b")


def qwen3_5_vl_config(layers: int, experts: int) -> dict:
    """Qwen3.5-35B-A3B's complete VL config (examples/hf_configs: the 27-block vision tower, hidden 2048, vocab
    248320, one MTP layer) with ``layers`` language layers (every 4th full attention) and ``experts`` experts."""
    with open(os.path.join(QWEN3_5_35B, "config.json")) as f:
        cfg = json.load(f)
    cfg["text_config"].update(num_hidden_layers=layers, num_experts=experts)
    cfg["text_config"].pop("layer_types", None)  # derived from full_attention_interval
    cfg["dtype"] = "bfloat16"
    return cfg


def qwen3_5_vl_tensors(cfg: dict):
    """(name, shape) of a complete Qwen3_5MoeForConditionalGeneration hub checkpoint: transformers' model built on
    the meta device (the language model with fused experts, ``model.visual.*``) + the MTP layer the hub stores
    (``mtp.fc`` [H, 2H], three norms, a full-attention MoE decoder layer; tests' save_tiny_qwen3_5_vl_full)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(**cfg))
    sd = model.state_dict()
    yield from ((n, tuple(t.shape)) for n, t in sd.items())
    h = cfg["text_config"]["hidden_size"]
    yield "mtp.fc.weight", (h, 2 * h)
    for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        yield f"mtp.{n}.weight", (h,)
    full = cfg["text_config"]["full_attention_interval"] - 1
    src = f"model.language_model.layers.{full}."
    yield from (("mtp.layers.0." + n[len(src):], tuple(t.shape)) for n, t in sd.items() if n.startswith(src))


ARCHS = {"qwen3_moe": (hf_config, hub_tensors), "qwen3_5_vl": (qwen3_5_vl_config, qwen3_5_vl_tensors)}


def write_random_hf(out: str, cfg: dict, shard_bytes: int = 1 << 30, tensors_of=hub_tensors) -> int:
    """Random bf16 weights, one shard at a time, from a 64 MiB random pool (tensors start at
    different pool offsets, so they differ). Returns the total tensor bytes."""
    os.makedirs(out)
    pool = torch.randn(32 << 20, dtype=torch.bfloat16)
    tensors = [(n, s, torch.bfloat16) for n, s in tensors_of(cfg)]
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


def carried_bytes(cfg: dict, tensors_of) -> int:
    """Bytes of the tensors the converter carries as is (Qwen3.5: ``model.visual.*``, ``mtp.*``), bf16."""
    return sum(2 * int(torch.Size(s).numel()) for n, s in tensors_of(cfg) if n.startswith(("model.visual.", "mtp.")))


# Runs the command as its child and reports its wall time and rusage. The converter must not be forked
# from this process: a forked child's peak RSS (ru_maxrss) starts at the parent's RSS at fork time and
# survives exec, so every child of this (torch-importing) script would report >= its ~300 MB.
_LAUNCHER = """import json, os, sys, time
t0 = time.time()
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
_, status, ru = os.wait4(pid, 0)
print("@@RUSAGE " + json.dumps([time.time() - t0, ru.ru_maxrss, os.waitstatus_to_exitcode(status)]), flush=True)
"""


def timed(cmd: list[str]) -> tuple[float, int, float, float]:
    """(wall seconds, peak RSS in bytes, seconds the converter itself reports (its summary line;
    excludes interpreter start-up and imports) or the wall time, 1-min load average before the step)
    of ``cmd`` run as a fresh process (through a small launcher, see ``_LAUNCHER``)."""
    subprocess.run(["sync"], check=True)
    load = os.getloadavg()[0]
    p = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, *cmd], capture_output=True, text=True)
    m = re.search(r"^@@RUSAGE (.*)$", p.stdout, re.M)
    if p.returncode or not m:
        raise RuntimeError(f"launcher failed ({p.returncode}):\n{p.stderr[-2000:]}")
    dt, maxrss_kb, rc = json.loads(m.group(1))
    if rc:
        raise RuntimeError(f"{' '.join(cmd)} failed ({rc}):\n{p.stderr[-2000:]}")
    m = re.search(r"GB in ([0-9.]+) s", p.stdout)
    core = float(m.group(1)) if m else dt
    label = "cp -r" if cmd[0] == "cp" else cmd[3]
    print(f"    {label:12s} {dt:6.2f} s ext, {core:6.2f} s int, {maxrss_kb / 1024:6.0f} MB RSS, load {load:.2f}")
    return dt, maxrss_kb * 1024, core, load


def bench_size(root: str, layers: int, experts: int, workers: int, repeat: int, arch: str = "qwen3_moe") -> dict:
    """Best of ``repeat`` for each of the four steps (this machine is shared: best-of filters noise
    from other jobs for cp and converter alike)."""
    base = os.path.join(root, f"L{layers}")
    hf, mc, back, cp1, cp2 = (os.path.join(base, x) for x in ("hf", "mcore", "hf_back", "cp_hf", "cp_mcore"))
    os.makedirs(base)
    config_of, tensors_of = ARCHS[arch]
    cfg = config_of(layers, experts)
    total = write_random_hf(hf, cfg, tensors_of=tensors_of)
    cli = [sys.executable, "-m", "checkpoints_convert"]
    r = {"layers": layers, "experts": experts, "GB": total / 1e9, "carried_GB": carried_bytes(cfg, tensors_of) / 1e9}
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
        r[k + "_s"] = min(t for t, _, _, _ in v)
        r[k + "_rss"] = max(m for _, m, _, _ in v)
        r[k + "_core_s"] = min(c for _, _, c, _ in v)
        r[k + "_load"] = [round(x[3], 2) for x in v]
    for cp, conv in (("cp_hf", "h2m"), ("cp_mc", "m2h")):  # ratio of each converter run to the cp before it
        r[conv + "_paired"] = statistics.median(a[0] / b[0] for a, b in zip(runs[cp], runs[conv]))
    r["round_trip_equal"] = same_tensor_bytes(hf, back)
    shutil.rmtree(base)
    return r


def same_tensor_bytes(a: str, b: str) -> bool:
    """Every tensor of HF dir ``a`` is in ``b`` with the same dtype, shape and bytes (read one at a time)."""
    from safetensors import safe_open

    def where(d):
        with open(os.path.join(d, INDEX)) as f:
            return json.load(f)["weight_map"]

    wa, wb = where(a), where(b)
    if set(wa) != set(wb):
        return False
    for name, fa in wa.items():
        with safe_open(os.path.join(a, fa), "pt") as x, safe_open(os.path.join(b, wb[name]), "pt") as y:
            if not torch.equal(x.get_tensor(name), y.get_tensor(name)):
                return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/s3ac_bench")
    ap.add_argument("--layers", type=int, nargs="+", default=[5, 14])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="runs per step; the best time is reported")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="qwen3_moe",
                    help="qwen3_moe: Qwen3-30B-A3B shapes; qwen3_5_vl: Qwen3.5-35B-A3B's complete VL checkpoint "
                         "(27-block vision tower and MTP layer, carried as is) with --layers language layers")
    args = ap.parse_args()
    if os.path.exists(args.dir):
        sys.exit(f"{args.dir} exists; remove it or pass another --dir")
    os.makedirs(args.dir)
    try:
        free = shutil.disk_usage(args.dir).free
        rows = []
        for L in args.layers:
            config_of, tensors_of = ARCHS[args.arch]  # input, mcore, hf back and two cp copies, at most
            need = 4.5 * sum(2 * int(torch.Size(s).numel()) for _, s in tensors_of(config_of(L, args.experts)))
            if need > free * 0.8:
                sys.exit(f"not enough disk for {L} layers: need ~{need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
            print(f"== {args.arch}: {L} layers x {args.experts} experts")
            rows.append(bench_size(args.dir, L, args.experts, args.workers, args.repeat, args.arch))
        print(f"\nworkers={args.workers}, best of {args.repeat}; GB/s; ratio = converter throughput / cp -r "
              f"throughput of the same input; ext = wall time of the process as a user sees it, int = the "
              f"converter's own timing (no start-up); paired = median over repeats of cp time / converter "
              f"time; RSS = converter peak")
        print(f"{'size':>8} {'cp HF':>7} | {'hf->mcore ext':>13} {'ratio':>5} {'int':>6} {'ratio':>5} "
              f"{'paired':>6} {'RSS':>7} | {'cp MC':>7} | {'mcore->hf ext':>13} {'ratio':>5} {'int':>6} "
              f"{'ratio':>5} {'paired':>6} {'RSS':>7}")
        for r in rows:
            g = r["GB"]
            print(f"{g:7.2f}G {g / r['cp_hf_s']:7.2f} | {g / r['h2m_s']:13.2f} {r['cp_hf_s'] / r['h2m_s']:5.2f} "
                  f"{g / r['h2m_core_s']:6.2f} {r['cp_hf_s'] / r['h2m_core_s']:5.2f} {r['h2m_paired']:6.2f} "
                  f"{r['h2m_rss'] / 2**20:5.0f}MB | {g / r['cp_mc_s']:7.2f} | {g / r['m2h_s']:13.2f} "
                  f"{r['cp_mc_s'] / r['m2h_s']:5.2f} {g / r['m2h_core_s']:6.2f} {r['cp_mc_s'] / r['m2h_core_s']:5.2f} "
                  f"{r['m2h_paired']:6.2f} {r['m2h_rss'] / 2**20:5.0f}MB")
        for r in rows:
            print(f"{r['GB']:7.2f}G: carried (vision tower, MTP) {r['carried_GB']:.2f} GB; round trip "
                  f"{'bit-exact' if r['round_trip_equal'] else 'DIFFERS'}")
        print("load (1 min) at each step:", "; ".join(
            f"{r['GB']:.2f}G " + " ".join(f"{k}={r[k + '_load']}" for k in ("cp_hf", "h2m", "cp_mc", "m2h"))
            for r in rows))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()

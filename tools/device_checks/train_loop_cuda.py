"""Device check (issue 15): RL steps of a ~0.5B Qwen3-MoE on ONE GPU with the GPU-scale switches.

Two modes (``--mode trainer|models|both``, default trainer):

trainer: the project's own ``Trainer.step()`` (S3AC with critic, R3 on, DAPO filter off, the
arithmetic task on the character vocabulary) on the ~0.5B model below (``model.hf_config`` = a
config.json written to a temp dir, random weights from the trainer's seed), ``rollout.engine=hf`` (the
transformers engine on the same GPU, weights synced from the actor), first with ``model.dtype=bf16``,
``train.recompute=full``, ``optim.{actor,critic}.cpu_offload=true`` (CUDA only), ``train.offload_idle=true``,
``algo.logprob_chunk_tokens``, then in fp32 without them. Reported per run: step_s per step, peak_gpu_gb,
the device and dtypes of the step's batch shard (``trainer_device()``: every tensor of the step must be
there; NCCL itself refuses host tensors), and the first step's metrics; "first_step_rel_diff" per
numeric first-step metric (bf16 vs fp32). Criterion: batch on cuda:0, old_logp / adv / returns /
old_values float32, finite losses, actor/grad_norm and critic/value_loss within 5% of fp32 (same prompts;
the samples differ where bf16 sampling does).

CPU smoke of the trainer mode (``--tiny --steps 1 --mode both``, 2026-11-30): the step's shard on cpu,
old_logp / adv / returns / old_values float32; bf16+recompute+offload_idle vs fp32 first step:
actor/grad_norm 1.62299 vs 1.62271 (rel 1.7e-4), critic/value_loss_tok 0.37912 vs 0.37896 (rel 4.1e-4),
engine vs trainer log-prob mean |diff| 3.4e-4 (bf16) / 7.1e-8 (fp32).

models: the earlier models-level loop (below), kept as a reference for the trainer mode.

What the models mode runs (one process, one GPU, no SGLang): the demo's Qwen3-MoE architecture scaled to ~0.55B
(hidden 1024, 8 layers, 16 experts top-4, expert FFN 512, 16/4 heads of 64, Qwen vocab 151,936),
random weights from one seed, as
  * actor + critic on megatron-core: ``model.dtype`` bf16, ``train.recompute=full``, optimizer CPU
    offload (megatron's HybridDeviceOptimizer, ``optim.cpu_offload``), R3 routing replay on;
  * the HF engine (``rollout.engine: hf``: transformers' model in ``CPUEngine`` on the same GPU, bf16);
  * idle-model offload (``train.offload_idle``: ``models.offload.HostOffload``): both models on the
    host during generation, the critic during the actor update and the actor during the critic's.
Each RL step: weight sync actor -> engine, generate (k samples per prompt, routes captured), old
log-probs (forward only, routes replayed), one actor update (PPO-clip on group-normalised rewards;
reward = fraction of even token ids in the response: synthetic, deterministic), one critic update
(value MSE to the reward). The same steps are then run in fp32 without recompute / offload
(``--compare-fp32``, default on) from the same seed, and the first step's metrics are compared.

Prints one JSON object:
  gpu, torch; per run ("bf16_recompute_offload", "fp32"): step_s per step, peak_gpu_gb
  (torch.cuda.max_memory_allocated over the run), offload_s / offload_gb (HostOffload, summed),
  sync_s (weight sync), and first_step metrics: reward_mean, engine_vs_trainer_lp_max / _mean
  (|engine log-prob - trainer old log-prob| over response tokens: how well the bf16 engine and the
  bf16 trainer agree), actor_loss, actor_grad_norm, critic_loss, clip_frac, r3_routed_frac;
  "first_step_rel_diff": |bf16 - fp32| / |fp32| per first-step metric.
Criterion: finishes in < 5 min on one H200; losses finite; bf16 engine_vs_trainer_lp_mean < 0.05;
first_step_rel_diff of actor_grad_norm and critic_loss < 0.05 (same samples: rewards and routes come
from each run's own engine, so compare reward_mean for equality only as a hint). actor_loss of step 1
is ~0 by construction (ratio 1, group-normalised advantages sum to 0): use the grad norm.
CPU smoke run (the --tiny command below, 2 steps): bf16+recompute+offload_idle vs fp32 first step:
actor_grad_norm 1.25021 vs 1.24997 (rel 1.9e-4), critic_loss 0.41346 vs 0.41339 (rel 1.7e-4),
engine vs trainer log-prob mean |diff| 4.5e-4 (bf16) / 2.1e-7 (fp32), identical rewards and routes.

Usage on the GPU machine:  python tools/device_checks/train_loop_cuda.py [--steps 3] [--prompts 16 --k 4]
    [--mode both]
CPU smoke test of the same code path (tiny model, no optimizer offload: megatron refuses it on CPU):
    python tools/device_checks/train_loop_cuda.py --tiny --steps 1 [--mode both]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

BIG = dict(vocab_size=151936, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
           num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=16,
           num_experts_per_tok=4)
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2)


def hf_config(tiny: bool):
    from megatron_s3ac.models.tiny_models import tiny_config

    return tiny_config("qwen3_moe", max_position_embeddings=4096, **(TINY if tiny else BIG))


def _setup_dist():
    from megatron_s3ac.models.parallel import init_distributed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    init_distributed()


def build(info, dtype, recompute, offload, device):
    from megatron_s3ac.models.actor_critic import build_actor, build_critic, build_transformer_config
    from megatron_s3ac.models.optim import build_optimizer, wrap_ddp
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.r3.config import R3Config

    lay = ParallelLayout()
    initialize_model_parallel(lay, seed=1)
    torch.manual_seed(0)
    acfg = build_transformer_config(info, lay, dtype, recompute=recompute, **R3Config().transformer_config_overrides(info))
    actor = build_actor(info, acfg).to(device)
    ccfg = build_transformer_config(info, lay, dtype, recompute=recompute)
    critic = build_critic(info, ccfg).to(device)
    with torch.no_grad():  # critic backbone := actor backbone, as the trainer does
        sd = {k: v for k, v in actor.state_dict().items() if not k.startswith("output_layer")}
        critic.module.load_state_dict(sd, strict=False)
    out = {}
    for name, model, cfg in (("actor", actor, acfg), ("critic", critic, ccfg)):
        ddp = wrap_ddp(model, cfg)
        opt = build_optimizer([ddp], lr=1e-6 if name == "actor" else 1e-5, cpu_offload=offload, offload_fraction=1.0)
        out[name] = (model, ddp, opt)
    return out


def microbatches(samples, info, device, mbs):
    """Padded micro-batches (sample i in row i) with response masks, rewards and aligned routes."""
    from megatron_s3ac.r3.align import align_microbatch, padded_placements

    out = []
    for i in range(0, len(samples), mbs):
        group = samples[i:i + mbs]
        toks = [list(s.prompt_ids) + list(s.response_ids) for s in group]
        s_len = max(len(t) for t in toks)
        ids = torch.zeros(len(group), s_len, dtype=torch.long)
        mask = torch.zeros(len(group), s_len)
        old_engine = torch.zeros(len(group), s_len)
        for r, (t, smp) in enumerate(zip(toks, group)):
            ids[r, :len(t)] = torch.tensor(t)
            p, n = len(smp.prompt_ids), len(smp.response_ids)
            mask[r, p - 1:p - 1 + n] = 1  # position j predicts token j + 1
            old_engine[r, p - 1:p - 1 + n] = torch.as_tensor(smp.logprobs)
        routes = align_microbatch([s.routed_experts for s in group], padded_placements([len(t) for t in toks]),
                                  tuple(ids.shape), list(range(info.num_layers)), info.num_experts)
        out.append(dict(input_ids=ids.to(device), labels=torch.roll(ids, -1, 1).to(device), mask=mask.to(device),
                        engine_lp=old_engine.to(device), routes=routes))
    return out


def rl_step(models, engine, info, args, step, device, offload_idle):
    from megatron_s3ac.models.logprobs import vocab_parallel_log_probs
    from megatron_s3ac.models.offload import HostOffload
    from megatron_s3ac.models.pipeline import forward_backward
    from megatron_s3ac.r3.replay import routing_replay
    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.sync.weight_sync import sync_weights

    actor, addp, aopt = models["actor"]
    critic, cddp, copt = models["critic"]
    off = {n: HostOffload([d], o) for n, (_, d, o) in models.items()}
    m = {"offload_s": 0.0, "offload_gb": 0.0}

    def move(name, out):
        if not offload_idle:
            return
        st = off[name].offload() if out else off[name].onload()
        m["offload_s"] += st.seconds
        m["offload_gb"] += st.total_bytes / 2**30

    t0 = time.perf_counter()
    st = sync_weights([actor], info, engine)
    m["sync_s"] = st.seconds
    move("actor", True), move("critic", True)
    g = torch.Generator().manual_seed(step)
    prompts = torch.randint(0, info.vocab_size, (args.prompts, args.prompt_len), generator=g).tolist()
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=step, ignore_eos=True)
    samples = [s for grp in engine.generate(prompts, sp, n_samples=args.k, return_routed_experts=True) for s in grp]
    rewards = torch.tensor([float(sum(t % 2 == 0 for t in s.response_ids)) / len(s.response_ids) for s in samples])
    grp = rewards.view(args.prompts, args.k)
    adv = ((grp - grp.mean(1, keepdim=True)) / (grp.std(1, keepdim=True) + 1e-6)).view(-1)
    mbs = microbatches(samples, info, device, args.mbs)
    for i, mb in enumerate(mbs):
        n = mb["input_ids"].shape[0]
        mb["adv"] = adv[i * args.mbs:i * args.mbs + n].to(device)
        mb["reward"] = rewards[i * args.mbs:i * args.mbs + n].to(device)
    routes = [mb["routes"] for mb in mbs]
    move("actor", False)

    def lp_of(out, mb):
        return vocab_parallel_log_probs(out, mb["labels"], info.vocab_size, chunk_tokens=args.chunk_tokens)

    def old_fn(mb, out):
        mb["old_lp"] = lp_of(out, mb).detach()
        return out.float().sum() * 0, torch.tensor(1, device=device), {}

    with torch.no_grad(), routing_replay([addp], routes):
        forward_backward([addp], mbs, old_fn, forward_only=True)
    diffs = torch.cat([((mb["old_lp"] - mb["engine_lp"]).abs())[mb["mask"] > 0] for mb in mbs])
    m["engine_vs_trainer_lp_max"], m["engine_vs_trainer_lp_mean"] = diffs.max().item(), diffs.mean().item()
    m["r3_routed_frac"] = float(torch.cat([r.routed for r in routes]).float().mean())

    def actor_loss(mb, out):
        lp = lp_of(out, mb)
        ratio = torch.exp(lp - mb["old_lp"])
        a = mb["adv"][:, None]
        pg = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)
        clip = ((ratio - 1).abs() > 0.2).float()
        k = mb["mask"]
        return (pg * k).sum(), k.sum().long(), {"loss": (pg * k).sum().detach(), "clip": (clip * k).sum(), "n": k.sum()}

    addp.zero_grad_buffer()
    aopt.zero_grad()
    with routing_replay([addp], routes):
        res = forward_backward([addp], mbs, actor_loss)
    ok, gn, _ = aopt.step()
    n = sum(r["n"] for r in res)
    m["actor_loss"] = float(sum(r["loss"] for r in res) / n)
    m["clip_frac"] = float(sum(r["clip"] for r in res) / n)
    m["actor_grad_norm"] = float(gn)
    move("actor", True), move("critic", False)

    def critic_loss(mb, out):
        k = mb["mask"]
        err = (out.float() - mb["reward"][:, None]) ** 2 * k
        return err.sum(), k.sum().long(), {"loss": err.sum().detach(), "n": k.sum()}

    cddp.zero_grad_buffer()
    copt.zero_grad()
    res = forward_backward([cddp], mbs, critic_loss)
    copt.step()
    m["critic_loss"] = float(sum(r["loss"] for r in res) / sum(r["n"] for r in res))
    move("actor", False)  # both resident for the next sync
    m["reward_mean"] = rewards.mean().item()
    if device.type == "cuda":
        torch.cuda.synchronize()
    m["step_s"] = time.perf_counter() - t0
    return m


def run(args, dtype, recompute, offload, offload_idle):
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = hf_config(args.tiny)
    info = model_info(cfg.to_dict())
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    models = build(info, dtype, recompute, offload, device)
    engine = CPUEngine.from_config(cfg, dtype=dtype, device=device, seed=0)
    steps = [rl_step(models, engine, info, args, s, device, offload_idle) for s in range(args.steps)]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    del models, engine
    return dict(step_s=[round(s["step_s"], 3) for s in steps], peak_gpu_gb=peak,
                sync_s=[round(s["sync_s"], 3) for s in steps],
                offload_s=round(sum(s["offload_s"] for s in steps), 3),
                offload_gb=round(sum(s["offload_gb"] for s in steps), 3),
                first_step={k: v for k, v in steps[0].items() if k not in ("step_s", "sync_s", "offload_s", "offload_gb")})


# ---- trainer mode: the project's own Trainer.step() ----------------------------------------------------
def trainer_overrides(args, bf16: bool, cuda: bool, out_dir: str) -> list[str]:
    import tempfile

    if args.tiny:
        model = ["model.tiny=arithmetic_moe"]
    else:
        d = tempfile.mkdtemp(prefix="train_loop_cuda_cfg_")
        hf_config(False).save_pretrained(d)
        model = [f"model.hf_config={d}"]
    new_tokens = min(args.new_tokens, 8) if args.tiny else args.new_tokens  # the tiny model has 64 positions
    ov = model + ["data.task=arithmetic", "rollout.engine=hf", f"rollout.prompts_per_step={args.prompts}",
                  f"rollout.k={args.k}", f"rollout.max_new_tokens={new_tokens}", "algo.name=s3ac",
                  "algo.dynamic_sampling=false", "daps.enabled=false", "train.r3=on", "train.eval_every=0",
                  "train.progress=false", "train.tensorboard=false", f"algo.micro_batch_size={args.mbs}",
                  f"train.out_dir={out_dir}"]
    if bf16:
        ov += ["model.dtype=bf16", "train.recompute=full", "train.offload_idle=true",
               f"algo.logprob_chunk_tokens={args.chunk_tokens}"]
        if cuda:  # megatron's HybridDeviceOptimizer offloads CUDA params only (refused on CPU)
            ov += ["optim.actor.cpu_offload=true", "optim.critic.cpu_offload=true"]
    return ov


def run_trainer(args, bf16: bool) -> dict:
    import tempfile

    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.device import trainer_device
    from megatron_s3ac.trainer.step.trainer import Trainer

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    tr = Trainer(load_config(None, trainer_overrides(args, bf16, cuda, tempfile.mkdtemp(prefix="train_loop_cuda_"))))
    seen, real_adv = [], tr.advantages

    def spy(batch):  # the step's batch shard after its advantages: device and dtypes
        m = real_adv(batch)
        seen.append({k: [str(getattr(batch, k).device), str(getattr(batch, k).dtype)]
                     for k in ("tokens", "old_logp", "adv", "returns", "old_values") if getattr(batch, k) is not None})
        return m
    tr.advantages = spy
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        m = tr.step()
        if cuda:
            torch.cuda.synchronize()
        m["step_s"] = time.perf_counter() - t0
        steps.append(m)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    tr.close()
    first = {k: v for k, v in steps[0].items() if isinstance(v, (int, float)) and not k.startswith("time/")}
    return dict(device=str(trainer_device()), step_s=[round(s["step_s"], 3) for s in steps], peak_gpu_gb=peak,
                batch=seen[0] if seen else None, first_step=first,
                finite=all(torch.isfinite(torch.tensor(float(s.get(k, 0.0)))) for s in steps
                           for k in ("actor/grad_norm", "critic/grad_norm")))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, no optimizer offload")
    ap.add_argument("--no-compare-fp32", dest="compare_fp32", action="store_false")
    ap.add_argument("--mode", choices=("trainer", "models", "both"), default="trainer")
    args = ap.parse_args()
    _setup_dist()
    cuda = torch.cuda.is_available()
    res = {"gpu": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__}
    if args.mode in ("trainer", "both"):
        t = res["trainer"] = {"bf16_recompute_offload": run_trainer(args, bf16=True)}
        if args.compare_fp32:
            t["fp32"] = run_trainer(args, bf16=False)
            a, b = t["bf16_recompute_offload"]["first_step"], t["fp32"]["first_step"]
            t["first_step_rel_diff"] = {k: abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in b.keys() & a.keys()}
    if args.mode in ("models", "both"):
        res["bf16_recompute_offload"] = run(args, torch.bfloat16, "full", offload=cuda, offload_idle=True)
        if args.compare_fp32:
            res["fp32"] = run(args, torch.float32, "none", offload=False, offload_idle=False)
            a, b = res["bf16_recompute_offload"]["first_step"], res["fp32"]["first_step"]
            res["first_step_rel_diff"] = {k: abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in b}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

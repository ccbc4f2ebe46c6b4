"""``s3ac-plan``: will this RL job fit, and on which layout?

    s3ac-plan HF_CONFIG --gpus 128 [workload / knob / layout flags] [--json | --yaml]
    s3ac-plan --config TRAINER.yaml [flags]

Prints a table per candidate layout (DP / expert-DP, parameters per rank, peak GiB per GPU for each
phase with the worst pipeline stage, host GiB per node, engine capacity, verdict). Bad input: a message
naming the cause on stderr, exit 2, nothing on stdout.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

from megatron_s3ac.plan import constants as C

GIB = C.GIB


class PlanInputError(ValueError):
    """Bad planner input (a file, a flag, a config key); the message names it."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="s3ac-plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("hf_config", nargs="?", help="HF config.json or checkpoint directory")
    p.add_argument("--config", help="trainer YAML (model, layouts, rollout, algo, cluster)")
    g = p.add_argument_group("cluster")
    g.add_argument("--gpus", type=int, help="GPUs in the job (training + separate engines)")
    g.add_argument("--gpus-per-node", type=int)
    g.add_argument("--gpu-mem-gib", type=float)
    g.add_argument("--host-mem-gib", type=float, help="host memory per node")
    g = p.add_argument_group("workload")
    g.add_argument("--prompt-len", type=int)
    g.add_argument("--response-len", type=int)
    g.add_argument("--prompts-per-step", type=int)
    g.add_argument("--k", type=int, help="responses per prompt")
    g.add_argument("--actor-minibatches", type=int)
    g.add_argument("--critic-minibatches", type=int)
    g.add_argument("--micro-batch-size", type=int, help="rows per micro-batch (0 = whole mini-batch)")
    g.add_argument("--max-tokens-per-micro-batch", type=int, help="token budget per packed micro-batch")
    g.add_argument("--image-tokens", type=int,
                   help="image placeholder tokens per prompt on top of --prompt-len (vision-language models)")
    g.add_argument("--critic-block-tokens", type=int,
                   help="the critic's privileged block per sequence (default: the config's "
                        "model.critic_privileged_max_tokens when model.critic_privileged is set, else 0)")
    g = p.add_argument_group("trainer knobs")
    g.add_argument("--dtype", choices=sorted(C.DTYPE_BYTES))
    g.add_argument("--recompute", choices=("none", "selective", "full"))
    g.add_argument("--optimizer-offload", type=float, metavar="FRACTION")
    g.add_argument("--precision-aware-optimizer", action="store_true", default=None)
    g.add_argument("--offload-idle", action="store_true", default=None)
    g.add_argument("--critic", dest="critic", action="store_true", default=None)
    g.add_argument("--no-critic", dest="critic", action="store_false")
    g.add_argument("--logprob-chunk", type=int, help="tokens per log-prob chunk (0 = unchunked)")
    g.add_argument("--vision-trainable", action="store_true", default=None,
                   help="the vision tower trains (grads + optimizer states); default: frozen")
    g.add_argument("--backend", choices=("gpu", "cpu"),
                   help="activation kernels: gpu = TE / flash-attention / fla; cpu = this project's torch spec "
                        "(torch norms, SDPA with expanded KV, torch chunked delta rule without fla)")
    g.add_argument("--placement", choices=("colocated", "separate", "none"), help="rollout engine placement")
    g.add_argument("--engine-gpus", type=int, help="separate: GPUs for engines")
    g.add_argument("--engine-tp", type=int)
    g.add_argument("--engine-ep", type=int)
    g.add_argument("--engine-attn-dp", type=int)
    g.add_argument("--engine-mem-fraction", type=float)
    g.add_argument("--sync-bucket-mb", type=int,
                   help="weight-sync bucket in MiB (default: the config's rollout.<engine>.bucket_mb, else 512)")
    g.add_argument("--sync-fp8", action="store_true", default=None,
                   help="block-FP8 weights on the wire (default: the config's rollout.weights_dtype == fp8)")
    g.add_argument("--sync-overlap", action="store_true", default=None,
                   help="the engine keeps a staging copy of its weights (default: the config's rollout.sync.overlap)")
    g = p.add_argument_group("layout (omit to enumerate)")
    for name in ("tp", "cp", "pp", "ep", "etp", "first-stage-layers", "last-stage-layers"):
        g.add_argument(f"--{name}", type=int)
    for name in ("tp", "cp", "pp", "ep", "etp"):
        g.add_argument(f"--critic-{name}", type=int)
    g.add_argument("--search", action="store_true", help="with --config: enumerate instead of the config's layout")
    g.add_argument("--smallest", action="store_true",
                   help="find the smallest GPU count (1, 2, 4, 8, 16, ... 1024) on which a layout fits")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true")
    g.add_argument("--yaml", action="store_true", help="print the trainer config snippet of the chosen layout")
    g.add_argument("--top", type=int, default=8, help="candidates shown")
    g.add_argument("--weight-sync", action="store_true",
                   help="separate engines: print the weight-sync table per pipeline stage (plan/weight_sync.py) and "
                        "what each change to the transfer would give")
    return p


# ---- inputs ---------------------------------------------------------------------------------------
def _read_trainer_yaml(path: str) -> dict:
    """The trainer YAML through the trainer's own loader and schema (unknown keys, types and choices are
    refused), without its path checks: a config names model files on the cluster, not here."""
    from omegaconf import OmegaConf

    from megatron_s3ac.config import ConfigError, load_config

    if not os.path.exists(path):
        raise PlanInputError(f"--config {path}: no such file")
    try:
        cfg = load_config(path, check=False)
    except ConfigError as e:
        raise PlanInputError(f"--config {path}: {e}") from None
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


def _info_from(hf_src, cfg: dict | None):
    from megatron_s3ac.models.registry import UnsupportedModelError, model_info

    try:
        if hf_src is not None:
            return model_info(hf_src)
        model = (cfg or {}).get("model") or {}
        if model.get("tiny") == "arithmetic_moe":
            from megatron_s3ac.tasks.arithmetic import tiny_arithmetic_hf_config

            return model_info(tiny_arithmetic_hf_config().to_dict())
        if model.get("hf_config"):
            return model_info(model["hf_config"])
    except FileNotFoundError as e:
        raise PlanInputError(str(e)) from None
    except (UnsupportedModelError, KeyError) as e:
        raise PlanInputError(f"cannot read the model config: {e}") from None
    raise PlanInputError("give an HF config (positional) or --config with model.hf_config / model.tiny")


def _layout(d: dict | None, prefix: str = ""):
    from megatron_s3ac.models.parallel import ParallelLayout

    if not d:
        return None
    kw = {k: d[k] for k in ("tp", "cp", "pp", "ep", "etp", "first_stage_layers", "last_stage_layers")
          if d.get(k) is not None}
    bad = [k for k, v in kw.items() if not isinstance(v, int) or isinstance(v, bool)]
    if bad:
        raise PlanInputError(f"{prefix}{bad[0]}={kw[bad[0]]!r} must be an integer")
    return ParallelLayout(**kw)


def resolve(args) -> tuple:
    """(info, cluster, workload, knobs, fixed layout or None, critic layout or None) from flags + YAML."""
    from megatron_s3ac.plan.memory import Cluster, Knobs, Workload, critic_block_tokens

    if args.hf_config is None and args.config is None:
        raise PlanInputError("give an HF config (positional) or --config TRAINER.yaml")
    cfg = _read_trainer_yaml(args.config) if args.config else None
    info = _info_from(args.hf_config, cfg)
    cl = dict((cfg or {}).get("cluster") or {})
    ro = dict((cfg or {}).get("rollout") or {})
    algo = dict((cfg or {}).get("algo") or {})
    data = dict((cfg or {}).get("data") or {})

    def pick(flag, *vals, default=None):
        for v in (flag, *vals):
            if v is not None:
                return v
        return default

    gpus = pick(args.gpus, cl.get("gpus"), default=8 if args.smallest else None)
    if gpus is None:
        raise PlanInputError("the cluster size is unknown: pass --gpus (or a cluster: section in --config)")
    cluster = Cluster(gpus=int(gpus), gpus_per_node=int(pick(args.gpus_per_node, cl.get("gpus_per_node"), default=8)),
                      gpu_mem_gib=float(pick(args.gpu_mem_gib, cl.get("gpu_mem_gib"), default=141.0)),
                      host_mem_gib=float(pick(args.host_mem_gib, cl.get("host_mem_gib"), default=2048.0)))
    for key in ("gpus", "gpus_per_node", "gpu_mem_gib", "host_mem_gib"):
        v = getattr(cluster, key)
        if not (v > 0 and math.isfinite(v)):  # nan / inf would pass a plain > 0 and plan nonsense
            raise PlanInputError(f"cluster sizes must be positive: --{key.replace('_', '-')} {v:g} "
                                 f"(or cluster.{key})")
    w = Workload(
        prompt_len=int(pick(args.prompt_len, data.get("max_prompt_tokens"), default=2048)),
        response_len=int(pick(args.response_len, ro.get("max_new_tokens"), default=16384)),
        prompts_per_step=int(pick(args.prompts_per_step, ro.get("prompts_per_step"), default=32)),
        k=int(pick(args.k, ro.get("k"), default=8)),
        actor_minibatches=int(pick(args.actor_minibatches, algo.get("actor_minibatches"), default=8)),
        critic_minibatches=int(pick(args.critic_minibatches, algo.get("critic_minibatches"), default=8)),
        actor_epochs=int(algo.get("actor_epochs", 1)), critic_epochs=int(algo.get("critic_epochs", 2)),
        micro_batch_size=int(pick(args.micro_batch_size, algo.get("micro_batch_size"), default=1)),
        max_tokens_per_micro_batch=int(pick(args.max_tokens_per_micro_batch, algo.get("max_tokens_per_micro_batch"),
                                            default=0)),
        image_tokens=int(pick(args.image_tokens, default=0)),
        critic_extra_tokens=int(pick(args.critic_block_tokens, default=critic_block_tokens(cfg))))
    for key in ("prompt_len", "response_len", "prompts_per_step", "k", "actor_minibatches", "critic_minibatches"):
        if getattr(w, key) < 1:
            raise PlanInputError(f"{key.replace('_', '-')}={getattr(w, key)} must be >= 1")
    if w.image_tokens < 0:
        raise PlanInputError(f"image-tokens={w.image_tokens} must be >= 0")
    if w.critic_extra_tokens < 0:
        raise PlanInputError(f"critic-block-tokens={w.critic_extra_tokens} must be >= 0")
    if w.image_tokens and not info.hf.get("vision_config"):
        raise PlanInputError(f"--image-tokens {w.image_tokens}: {info.model_type} is a text-only model (no "
                             f"vision_config)")
    if w.micro_batch_size < 0 or w.max_tokens_per_micro_batch < 0:
        raise PlanInputError("micro-batch size and token budget must be >= 0")
    knobs = Knobs(
        dtype=pick(args.dtype, default="bf16"), recompute=pick(args.recompute, default="none"),
        optimizer_offload=float(pick(args.optimizer_offload, default=0.0)),
        precision_aware=bool(pick(args.precision_aware_optimizer, default=False)),
        vision_trainable=bool(pick(args.vision_trainable, default=False)),
        offload_idle=bool(pick(args.offload_idle, default=False)), critic=bool(pick(args.critic, default=True)),
        placement=pick(args.placement, ro.get("placement"), default="colocated"),
        engine_gpus=int(pick(args.engine_gpus, default=0)), engine_tp=int(pick(args.engine_tp, default=0)),
        engine_ep=int(pick(args.engine_ep, default=0)), engine_attn_dp=int(pick(args.engine_attn_dp, default=1)),
        engine_mem_fraction=float(pick(args.engine_mem_fraction, default=0.0)),
        sync_bucket_mb=int(pick(args.sync_bucket_mb, (ro.get(str(ro.get("engine") or "")) or {}).get("bucket_mb"),
                                default=512)),
        sync_fp8=bool(pick(args.sync_fp8, default=str(ro.get("weights_dtype") or "bf16") == "fp8")),
        sync_overlap=bool(pick(args.sync_overlap, default=bool((ro.get("sync") or {}).get("overlap", False)))),
        logprob_chunk=int(pick(args.logprob_chunk, default=0)), backend=pick(args.backend, default="gpu"))
    errs = knobs.validate()
    if errs:
        raise PlanInputError("; ".join(errs))
    if knobs.placement == "separate" and (knobs.engine_gpus or cluster.gpus // 2) >= cluster.gpus:
        raise PlanInputError(f"--engine-gpus {knobs.engine_gpus} leaves no GPU for training out of {cluster.gpus}")
    flag_layout = {k: getattr(args, k) for k in ("tp", "cp", "pp", "ep", "etp", "first_stage_layers",
                                                 "last_stage_layers")}
    fixed = None
    if _cp_only(args) is not None:
        pass  # --cp alone: search the other dimensions at that CP size (run)
    elif any(v is not None for v in flag_layout.values()):
        fixed = _layout({k: v for k, v in flag_layout.items() if v is not None}
                        | {"tp": 1 if flag_layout["tp"] is None else flag_layout["tp"]})  # --tp 0 is refused, not 1
    elif cfg is not None and not args.search:
        fixed = _layout(cfg.get("actor_layout") or {"tp": 1}, "actor_layout.")
    critic = None
    flag_critic = {k: getattr(args, f"critic_{k}") for k in ("tp", "cp", "pp", "ep", "etp")}
    if any(v is not None for v in flag_critic.values()):
        critic = _layout({k: v for k, v in flag_critic.items() if v is not None})
    elif cfg is not None and cfg.get("critic_layout") and not args.search:
        critic = _layout(cfg["critic_layout"], "critic_layout.")
    return info, cluster, w, knobs, fixed, critic


# ---- outputs --------------------------------------------------------------------------------------
def _gib(x: float) -> float:
    return round(x / GIB, 2)


def _lay(lay) -> dict:
    d = {k: getattr(lay, k) for k in ("tp", "cp", "pp", "ep", "etp")}
    for k in ("first_stage_layers", "last_stage_layers"):
        if getattr(lay, k) is not None:
            d[k] = getattr(lay, k)
    return d


def to_dict(e, info=None) -> dict:
    """The estimate as JSON; with the model's ``info`` and separate engines also its time per step and weight sync."""
    lay = e.layout
    world = e.train_gpus
    worst_params = max(e.stages, key=lambda s: s.params.total)
    out = {
        "fits": e.fits, "layout": _lay(lay), "critic_layout": _lay(e.critic_layout) if e.knobs.critic else None,
        "dp": world // (lay.tp * lay.cp * lay.pp), "expert_dp": world // (lay.ep * lay.etp * lay.pp),
        "train_gpus": world, "peak_gib": _gib(e.peak), "headroom_gib": _gib(e.headroom),
        "phases": {k: _gib(v) for k, (v, _) in e.phases.items()},
        "worst_stage": {k: s for k, (_, s) in e.phases.items()},
        "host_gib_per_node": _gib(e.host_per_node),
        "params_per_rank": worst_params.params.total,
        "params_per_rank_by_stage": [{"stage": s.stage, "layers": [s.layers.start, s.layers.stop],
                                      "dense": s.params.dense, "expert": s.params.expert,
                                      "total": s.params.total} for s in e.stages],
        "stages": [{"stage": s.stage, "actor_states_gib": _gib(s.actor.gpu),
                    "critic_states_gib": _gib(s.critic.gpu) if s.critic else 0.0,
                    "actor_activations_gib": _gib(s.act_actor), "critic_activations_gib": _gib(s.act_critic),
                    "logits_gib": _gib(s.logits_train), "phases": {k: _gib(v) for k, v in s.phases.items()},
                    # model states kept on the GPU in each phase (plan.memory.residency; docs/trainer.md)
                    "resident_gib": {ph: {m: {k: _gib(b) for k, b in kinds.items()} for m, kinds in r.items()}
                                     for ph, r in s.resident.items()}}
                   for s in e.stages],
        "micro_batches": e.n_micro, "tokens_per_micro_batch": e.tokens_per_micro,
        "throughput_proxy_tokens_per_s_per_gpu": round(e.throughput, 1),
        "problems": e.problems, "verdict": verdict(e),
    }
    if e.engine is not None:
        g = e.engine
        out["engine"] = {"placement": e.knobs.placement, "tp": g.tp, "ep": g.ep, "attn_dp": g.attn_dp,
                         "engines": g.engines, "weights_gib_per_gpu": _gib(g.weights),
                         "staging_gib_per_gpu": _gib(g.staging),
                         "kv_kib_per_token_per_gpu": round(g.kv_per_token / 1024, 2),
                         "state_mib_per_seq_per_gpu": round(g.state_per_seq / 2**20, 2),
                         "mem_fraction": round(g.mem_fraction, 3), "capacity_seqs_at_max_len": g.capacity,
                         "needed_seqs_per_engine": g.needed}
        from megatron_s3ac.plan.async_time import step_times
        from megatron_s3ac.plan.weight_sync import for_estimate

        st = step_times(e, info) if info is not None else None
        if st is not None:  # separate engines: time per step, sync vs one-step async (train.max_staleness: 1)
            out["step_time"] = st
            out["weight_sync"] = for_estimate(info, e).terms()
    return out


def verdict(e) -> str:
    if e.fits:
        phase, (v, s) = max(e.phases.items(), key=lambda kv: kv[1][0])
        return f"fits: {_gib(e.headroom)} GiB headroom (worst: {phase} on stage {s}, {_gib(v)} GiB)"
    return "does not fit: " + "; ".join(e.problems)


def suggestions(info, cluster, w, knobs, fixed, critic, cps=None) -> list[str]:
    """The first knob changes (cumulative) that make some layout fit, or the cluster size that does."""
    from megatron_s3ac.plan.search import search

    steps = [("--recompute full", dict(recompute="full")),
             ("--optimizer-offload 1.0", dict(optimizer_offload=1.0)),
             ("--offload-idle", dict(offload_idle=True)),
             ("--precision-aware-optimizer", dict(precision_aware=knobs.dtype == "bf16"))]
    k = knobs
    applied = []
    for flag, change in steps:
        if all(getattr(k, f) == v for f, v in change.items()):
            continue
        k = dataclasses.replace(k, **change)
        applied.append(flag)
        res = search(info, cluster, w, k, fixed, critic, cps=cps)
        if res and res[0].fits:
            return [f"fits with {' '.join(applied)}: {_lay(res[0].layout)}"]
    for mult in (2, 4, 8):
        cl = dataclasses.replace(cluster, gpus=cluster.gpus * mult)
        res = search(info, cl, w, k, None, None, cps=cps)
        if res and res[0].fits:
            return [f"fits on {cl.gpus} GPUs with {' '.join(applied) or 'these knobs'}: {_lay(res[0].layout)}"]
    return ["no layout fits even with recompute, offload and 8x the GPUs"]


def yaml_snippet(e) -> str:
    lay = _lay(e.layout)
    lines = ["actor_layout: {" + ", ".join(f"{k}: {v}" for k, v in lay.items()
                                           if k in ("tp", "cp", "pp", "ep", "etp")) + "}"]
    if e.knobs.critic and e.critic_layout != e.layout:
        cl = _lay(e.critic_layout)
        lines.append("critic_layout: {" + ", ".join(f"{k}: {v}" for k, v in cl.items()
                                                    if k in ("tp", "cp", "pp", "ep", "etp")) + "}")
    extra = {k: v for k, v in lay.items() if k.endswith("stage_layers")}
    if extra:
        lines.append(f"# uneven pipeline (not in the trainer schema yet): {extra}")
    c = e.cluster
    lines.append(f"cluster: {{gpus: {c.gpus}, gpus_per_node: {c.gpus_per_node}, gpu_mem_gib: {c.gpu_mem_gib:g}, "
                 f"host_mem_gib: {c.host_mem_gib:g}}}")
    k = e.knobs
    lines.append(f"# planner: dtype={k.dtype} recompute={k.recompute} optimizer_offload={k.optimizer_offload:g} "
                 f"precision_aware={k.precision_aware} offload_idle={k.offload_idle} placement={k.placement}"
                 + (f" engine_tp={e.engine.tp} mem_fraction={e.engine.mem_fraction:.2f}" if e.engine else ""))
    lines.append(f"# {verdict(e)}")
    return "\n".join(lines) + "\n"


def table(results, info, top: int) -> str:
    hdr = ("layout", "DP", "EDP", "params/rank", "rollout", "fwd", "actor", "critic", "sync", "worst", "host/node",
           "engine", "tok/s/GPU", "verdict")
    rows = []
    for e in results[:top]:
        lay = e.layout
        world = e.train_gpus
        name = f"tp{lay.tp} pp{lay.pp} ep{lay.ep} etp{lay.etp}" + (f" cp{lay.cp}" if lay.cp > 1 else "")
        if lay.first_stage_layers or lay.last_stage_layers:
            name += f" [{lay.first_stage_layers},{lay.last_stage_layers}]"
        worst_phase, (_, ws) = max(e.phases.items(), key=lambda kv: kv[1][0])
        ph = [f"{e.phases[p][0] / GIB:.1f}" for p in ("rollout", "forward", "actor_update", "critic_update",
                                                      "weight_sync")]
        eng = f"tp{e.engine.tp} x{e.engine.capacity}" if e.engine else "-"
        rows.append((name, str(world // (lay.tp * lay.cp * lay.pp)), str(world // (lay.ep * lay.etp * lay.pp)),
                     f"{max(s.params.total for s in e.stages) / 1e9:.3f}B", *ph, f"{worst_phase}@{ws}",
                     f"{e.host_per_node / GIB:.0f}", eng, f"{e.throughput:.0f}",
                     "fits" if e.fits else "NO"))
    widths = [max(len(r[i]) for r in (hdr, *rows)) for i in range(len(hdr))]
    fmt = "  ".join("{:<%d}" % w_ for w_ in widths)
    out = [fmt.format(*hdr), fmt.format(*("-" * w_ for w_ in widths))] + [fmt.format(*r) for r in rows]
    return "\n".join(out)


def _weight_sync_text(e, info) -> str:
    """``--weight-sync``: the per-stage table of the sync as built and the total of each change to it."""
    from megatron_s3ac.plan.weight_sync import LADDER, for_estimate, table

    ws = for_estimate(info, e)
    if ws is None:
        return "weight sync: modelled for separate engines only (--placement separate)"
    lines = [f"weight sync, actor {_lay(e.layout)} on {e.train_gpus} GPUs -> {e.engine.engines} engines of TP "
             f"{e.engine.tp} (plan/weight_sync.py; docs/planner.md \"Weight-sync time\"):", table(ws),
             "what each change to the transfer gives (cumulative):"]
    for v in LADDER:
        lines.append(f"  {v.name:<52} {for_estimate(info, e, variant=v).total_s:6.2f} s")
    return "\n".join(lines)


def _cp_only(args) -> int | None:
    """``--cp N`` given without any other actor layout flag: the CP size the search is restricted to."""
    others = ("tp", "pp", "ep", "etp", "first_stage_layers", "last_stage_layers")
    if getattr(args, "cp", None) is not None and all(getattr(args, k) is None for k in others):
        return args.cp
    return None


def run(argv=None) -> int:
    from megatron_s3ac.plan.search import layout_errors, search

    args = build_parser().parse_args(argv)
    if args.top < 1:
        raise PlanInputError(f"--top {args.top} must be >= 1")
    info, cluster, w, knobs, fixed, critic = resolve(args)
    cp = _cp_only(args)
    if cp is not None and cp < 1:
        raise PlanInputError(f"--cp {cp} must be >= 1")
    cps = None if cp is None else (cp,)
    world = cluster.gpus - ((knobs.engine_gpus or cluster.gpus // 2) if knobs.placement == "separate" else 0)
    for name, lay in (("layout", fixed), ("critic layout", critic)):
        if lay is not None:
            errs = layout_errors(info, lay, world)
            if errs:
                raise PlanInputError(f"{name} {_lay(lay)} is illegal on {world} GPUs: " + "; ".join(errs))
    if args.smallest:
        from megatron_s3ac.plan.search import smallest_cluster

        if fixed is not None or critic is not None:
            raise PlanInputError("--smallest enumerates layouts: drop --tp/--pp/--ep/--etp/--critic-* "
                                 "(--cp alone restricts the search)")
        results = smallest_cluster(info, cluster, w, knobs, cps=cps)
        if results is None:
            raise PlanInputError(f"no layout fits on up to 1024 GPUs of {cluster.gpu_mem_gib:g} GiB")
        cluster = results[0].cluster
    else:
        results = search(info, cluster, w, knobs, fixed, critic, cps=cps)
    if not results:
        raise PlanInputError(f"no legal layout for {info.model_type} on {world} GPUs")
    best = results[0]
    notes = []
    if w.seq_len > info.max_position_embeddings:
        notes.append(f"note: {w.seq_len} tokens exceed the model's max_position_embeddings "
                     f"{info.max_position_embeddings}")
    if best.engine is not None and best.engine.capacity < best.engine.needed:
        notes.append(f"note: each engine holds {best.engine.capacity} sequences at max length at once; the rollout "
                     f"batch needs {best.engine.needed} per engine (it runs in waves)")
    sugg = [] if best.fits else suggestions(info, cluster, w, knobs, fixed, critic, cps=cps)
    if args.json:
        d = to_dict(best, info)
        if args.weight_sync and "weight_sync" in d:
            from megatron_s3ac.plan.weight_sync import LADDER, for_estimate

            d["weight_sync_variants"] = {v.name: round(for_estimate(info, best, variant=v).total_s, 3)
                                         for v in LADDER}
        d["model_type"] = info.model_type
        d["suggestions"] = sugg
        d["notes"] = notes
        d["candidates"] = [{"layout": _lay(e.layout), "fits": e.fits, "peak_gib": _gib(e.peak),
                            "throughput_proxy": round(e.throughput, 1)} for e in results[:args.top]]
        print(json.dumps(d, indent=2))
    elif args.yaml:
        print(yaml_snippet(best), end="")
    else:
        img = f"+{w.image_tokens} image" if w.image_tokens else ""
        print(f"{info.model_type}: {w.prompts_per_step}x{w.k} sequences of {w.prompt_len}{img}+{w.response_len} tokens, "
              f"{cluster.gpus} GPUs ({cluster.gpus_per_node}/node, {cluster.gpu_mem_gib:g} GiB), dtype={knobs.dtype}, "
              f"recompute={knobs.recompute}, optimizer_offload={knobs.optimizer_offload:g}, "
              f"offload_idle={knobs.offload_idle}, critic={knobs.critic}, engine={knobs.placement}")
        print("peak GiB per GPU by phase (worst pipeline stage); host GiB per node; engine tp x sequences at max length")
        print(table(results, info, args.top))
        print(f"best: {verdict(best)}")
        from megatron_s3ac.plan.async_time import step_times

        st = step_times(best, info)
        if st is not None:
            print(f"time per step (proxy, plan/async_time.py): sync {st['sync_step_s']:g} s = generation "
                  f"{st['generation_s']:g} + training {st['training_s']:g} + weight sync {st['weight_sync_s']:g}; "
                  f"one-step async (train.max_staleness: 1) {st['async_step_s']:g} s ({st['async_speedup']:g}x); "
                  f"with the sync overlapped {st['async_overlapped_step_s']:g} s")
        if args.weight_sync:
            print(_weight_sync_text(best, info))
        for line in notes + sugg:
            print(line)
    return 0


def main(argv=None) -> None:
    from megatron_s3ac.console import silence_known_warnings

    silence_known_warnings()
    try:
        rc = run(argv)
    except PlanInputError as e:
        print(f"s3ac-plan: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(rc)


if __name__ == "__main__":
    main()

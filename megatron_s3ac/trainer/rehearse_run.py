"""The rehearsal's ``run`` phase: the user's job, shrunk, through its phases on CPU ranks (trainer/rehearse.py).

Shrunk: the same architecture (model_type, MoE or dense, Qwen3.5's GDN / attention pattern, its vision tower) with
few layers and small widths, sized so every parallel degree of the config's layouts still divides what it splits
(heads by TP, layers by PP, experts by EP); random weights in the hub layout with a character tokenizer. The world
is the smallest that keeps every degree (``lcm(tp*pp*cp, etp*ep*pp)`` over the actor and critic layouts), with
data parallelism 2 where that still fits ``max_ranks``. The config is the user's otherwise, except what cannot run
here or would take hours: the engine is the CPU engine at the same placement (the real engine's launch was the
``engines`` phase), a handful of prompts in the character vocabulary, responses of 4 tokens, a reward that varies
with the response's length (so groups are not all filtered out), minibatches of the step, one evaluation set.

What runs: ``s3ac-train pipeline`` (coverage data from the shrunk policy -> value pretraining when the algorithm
has a critic -> RL with a held-out evaluation and a checkpoint at every step), then a second job resuming the RL
stage from its checkpoint for one more step, both under the collective audit (megatron_s3ac.audit.
collectives: every group's ranks must issue the same collectives in the same order) and with
``train.dist_timeout_s`` short, so a rank waiting inside a collective for rank 0's engine shows as a timeout.
Every rank's Trainer is under the residency audit too (audit.residency): the bytes each model keeps in each phase,
the most over a pipeline stage's ranks, against the planner's per-phase residency for the same shrunk config and
layout (``planned_residency``, ``residency_check``; docs/rehearse.md "Residency against the planner").
"""
from __future__ import annotations

import json
import math
import os

from megatron_s3ac.rollout.rewards import register_reward
from megatron_s3ac.models.gloo_ranks import DistributedTestError
from megatron_s3ac.audit.pg_timeout import run_with_pg_timeout

# the resume job's waits: the default group times out after PG_TIMEOUT_S (NCCL's watchdog, shortened) while rank 0's
# engine takes SLOW_S longer to start and to answer each generation; the other ranks must wait on the gloo wait
# group (train.dist_timeout_s), never inside a default-group collective
PG_TIMEOUT_S, SLOW_S = 15.0, 16.0
# the residency audit's tolerance over the planner's bytes (docs/rehearse.md "Residency"): measured on the example
# configs, params and grads equal the planner's and the optimizer is below its padded share; 2% covers a buffer's
# padding the planner rounds differently, while a model left resident where it should be offloaded is a defect at
# any size
RESIDENCY_TOLERANCE = 0.02

REWARD = "rehearsal_length_parity"
register_reward(REWARD, isolate=False)(lambda response, reference: float(len(response) % 2))
CHARS = "0123456789+="


def min_world(layouts, max_ranks: int) -> int:
    """The smallest world keeping every layout's degrees, doubled where that still fits ``max_ranks`` (so the
    dense data-parallel group has 2 ranks at least once: its collectives are rehearsed too)."""
    need = 1
    for r in layouts:
        etp = r.etp if r.etp is not None else (r.tp if r.ep == 1 else 1)
        need = math.lcm(need, r.tp * r.pp * r.cp, etp * r.ep * r.pp)
    dense_dp = min(need // (r.tp * r.pp * r.cp) for r in layouts)
    return 2 * need if dense_dp < 2 and 2 * need <= max_ranks else need


# the order in which degrees give way when the world does not fit --max-ranks: expert parallelism first (it sets
# the 397B's 128 ranks), then the ones whose every rank runs distinct code the longest
_REDUCE_ORDER = ("ep", "etp", "cp", "tp", "pp")


def reduced_layouts(layouts, max_ranks: int) -> tuple[list, list[str]]:
    """Layouts whose smallest world fits ``max_ranks``: the largest degree above 2 (ties: ``_REDUCE_ORDER``) halved
    until it fits (an odd one becomes 2), no degree below 2 that was 2 or more, so every kind of parallelism the
    config uses still runs. Returns (layouts, one note per reduced degree); ([], notes) when even degree 2
    everywhere does not fit."""
    import dataclasses

    out, was = list(layouts), [dict(vars(l)) for l in layouts]
    while min_world(out, max_ranks) > max_ranks:
        cands = [(getattr(l, f) or 1, -_REDUCE_ORDER.index(f), i, f)
                 for i, l in enumerate(out) for f in _REDUCE_ORDER if (getattr(l, f) or 1) > 2]
        if not cands:
            return [], [f"even at degree 2 the smallest world is {min_world(out, max_ranks)} ranks"]
        d, _, i, f = max(cands)
        out[i] = dataclasses.replace(out[i], **{f: max(2, d // 2)})
    notes = [f"{('actor_layout', 'critic_layout')[i]}.{f} {w[f]} -> {getattr(l, f)}"
             for i, (l, w) in enumerate(zip(out, was)) for f in _REDUCE_ORDER if (getattr(l, f) or 1) != (w[f] or 1)]
    return out, notes


def shrunk_overrides(model_type: str, layouts) -> dict:
    """Config.json fields of the shrunk model: heads / kv heads divisible by TP, layers by PP (and Qwen3.5's
    3 GDN + 1 attention pattern), experts by EP x ETP."""
    tp = max(l.tp for l in layouts)
    pp = max(l.pp for l in layouts)
    ep = max(l.ep * (l.etp or 1) for l in layouts)
    kv = max(2, tp)
    out = dict(num_attention_heads=2 * kv, num_key_value_heads=kv, num_hidden_layers=2 * pp)
    if model_type == "qwen2":
        out["hidden_size"] = 16 * out["num_attention_heads"]
    if model_type in ("qwen3_moe", "qwen3_5_moe"):
        out.update(num_experts=max(8, 2 * ep), num_experts_per_tok=2)
    if model_type == "qwen3_5_moe":
        out.update(num_hidden_layers=math.lcm(4, pp), linear_num_key_heads=kv, linear_num_value_heads=2 * kv)
    return out


def save_shrunk(hf_config: str, layouts, out: str) -> str:
    """The shrunk checkpoint of the architecture of ``hf_config`` (a config.json or its directory) in ``out``."""
    from transformers.utils import logging as hf_logging

    from megatron_s3ac.models.tiny_models import char_tokenizer, save_tiny_hf

    hf_logging.disable_progress_bar()  # a quiet console: the shards are tiny
    path = os.path.join(hf_config, "config.json") if os.path.isdir(hf_config) else hf_config
    with open(path) as f:
        model_type = json.load(f)["model_type"]
    tok = char_tokenizer(CHARS)
    kw = {**shrunk_overrides(model_type, layouts), "vocab_size": len(tok)}  # every sampled id decodes
    if model_type == "qwen3_5_moe":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from megatron_s3ac.models.tiny_qwen3_5 import IMAGE_PROCESSOR, save_tiny_qwen3_5

        save_tiny_qwen3_5(out, "vl", **kw)  # the vision-language checkpoint, as Intern-S2's
        Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR).save_pretrained(out)
    else:
        save_tiny_hf(model_type, out, **kw)
    tok.save_pretrained(out)
    return out


def prompts_file(path: str, n: int) -> str:
    """``n`` prompts in the character vocabulary with their (reference) answers, jsonl."""
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 7 + 1, i % 5 + 2
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return path


def run_settings(cfg, model_dir: str, tmp: str, dp: int) -> dict:
    """{dotted key: value} the shrunk run changes in the user's config (the module docstring says why each)."""
    from megatron_s3ac.config import Placement

    separate = Placement(cfg.rollout.placement) == Placement.separate
    return {
        "model.hf_config": model_dir, "model.engine_hf_dir": model_dir, "model.actor_init": None,
        "model.critic_init": None, "model.dtype": "fp32", "model.tiny": None,
        "rollout.engine": "cpu", "rollout.reward": REWARD, "rollout.k": max(2, min(int(cfg.rollout.k), 4)),
        "rollout.prompts_per_step": 2 * dp, "rollout.max_new_tokens": 4,
        "rollout.partial_rollout": bool(cfg.rollout.partial_rollout) and separate,
        "data.path": prompts_file(os.path.join(tmp, "prompts.jsonl"), 16), "data.max_prompt_tokens": 16,
        "data.apply_chat_template": False,
        "algo.actor_minibatches": 1, "algo.critic_minibatches": 1, "algo.micro_batch_size": 1,
        "algo.max_tokens_per_micro_batch": 0,
        "eval.benchmarks": {"rehearsal": prompts_file(os.path.join(tmp, "rehearsal_eval.jsonl"), 4)}, "eval.k": 1,
        "eval.k_for": {}, "eval.reward": REWARD, "eval.max_new_tokens": 4,
        "eval.judge.name": "math_verify", "eval.judge.sets": [],
        "pipeline.policies": [model_dir], "pipeline.coverage_prompts": 4, "pipeline.coverage_k": 2,
        "value_pretrain.epochs": 1, "value_pretrain.coverage_path": None,
        "train.steps": 2, "train.save_every": 1, "train.eval_every": 1, "train.keep_last": 2, "train.threads": 1,
        "train.progress": False, "train.tensorboard": False, "train.wandb_project": None,
        "train.out_dir": os.path.join(tmp, "run"), "train.dist_timeout_s": 120.0,
        "cluster.gpus": None,
    }


def write_run_config(cfg, settings: dict, path: str) -> str:
    """The user's config with ``settings`` replacing its values (dicts and lists replaced whole) as YAML."""
    from omegaconf import OmegaConf

    conf = OmegaConf.structured(cfg)
    for key, value in settings.items():
        OmegaConf.update(conf, key, value, merge=False)
    OmegaConf.save(conf, path)
    return path


def _rank(config_path: str, overrides: list, command: str, slow_s: float = 0.0) -> dict:
    """Rank body (models.gloo_ranks.run_distributed): the job's ``command`` under the collective audit; the rank's
    output goes to ``<command>.rank<r>.log`` beside the config (the rehearsal's console stays its report)."""
    import sys

    import torch.distributed as dist

    from megatron_s3ac.console import silence_known_warnings

    log = os.path.join(os.path.dirname(config_path), f"{command}.rank{dist.get_rank()}.log")
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    silence_known_warnings()  # as s3ac-train does first: the known library warnings, each justified there
    from megatron_s3ac.audit.collectives import audited
    from megatron_s3ac.audit.residency import audit_every, merge_peaks, peaks
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer

    def run():
        cfg = load_config(config_path, overrides)
        planned = {}

        def plan(audit):  # at the Trainer's build: its layout, parallel state and model are the job's
            from megatron.core import parallel_state as ps

            planned["stage"] = ps.get_pipeline_model_parallel_rank()
            try:
                planned["planned"] = planned_residency(audit.tr, dist.get_world_size(), planned["stage"])
            except Exception as e:  # noqa: BLE001 - the planner failing on a config the trainer runs is a finding
                planned["planned"], planned["error"] = {}, f"{type(e).__name__}: {e}"

        with audit_every(Trainer, plan) as audits:  # every rank's Trainer: the pipeline's, the resumed job's
            if command == "pipeline":
                from megatron_s3ac.trainer.stages.pipeline import run_pipeline

                run_pipeline(cfg)
            else:
                from megatron_s3ac.trainer.run.train_loop import train_loop

                tr = Trainer(cfg)
                try:
                    train_loop(tr)
                finally:
                    tr.close()
        metrics = os.path.join(cfg.train.out_dir, "metrics.jsonl")
        rows = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
        return {"steps": [r.get("step") for r in rows],
                "residency": dict(planned, measured=merge_peaks(*(peaks(a.log) for a in audits)))}

    if not slow_s:
        return audited(run)
    from megatron_s3ac.audit.pg_timeout import slow_rank0_engine
    from megatron_s3ac.trainer.step import build

    with slow_rank0_engine(build, slow_s, slow_s):
        return audited(run)


def planned_residency(tr, world: int, stage: int) -> dict:
    """The planner's {phase: {model: {kind: bytes}}} on one GPU of pipeline ``stage`` (plan.memory.residency) for
    the trainer ``tr``'s own config, model info and layouts on ``world`` trainer ranks; the critic as the trainer
    built it (none for a critic-free algorithm), the engine's GPUs beside the trainer's for separate placement."""
    from megatron_s3ac.config import layout_of
    from megatron_s3ac.plan.memory import Cluster, Workload, estimate
    from megatron_s3ac.plan.preflight import trainer_knobs

    cfg = tr.cfg
    actor = layout_of(cfg.actor_layout)
    critic = layout_of(cfg.critic_layout) if cfg.critic_layout else actor
    knobs = trainer_knobs(cfg)
    knobs.critic = getattr(tr, "critic_ddp", None) is not None
    gpus = world
    if knobs.placement == "separate":  # the planner's trainer GPUs are the cluster's less the engines'
        knobs.engine_gpus, gpus = world, 2 * world
    w = Workload(prompt_len=int(cfg.data.max_prompt_tokens), response_len=int(cfg.rollout.max_new_tokens),
                 prompts_per_step=int(cfg.rollout.prompts_per_step), k=int(cfg.rollout.k))
    est = estimate(tr.info, actor, Cluster(gpus=gpus), w, knobs, critic)
    return est.stages[min(stage, len(est.stages) - 1)].resident


# the report's order of the audited phases
RESIDENCY_ORDER = ("rollout", "values", "old_logprobs", "actor_update", "critic_update", "engine_wake", "weight_sync")


def residency_check(results: list, tolerance: float = RESIDENCY_TOLERANCE) -> tuple[list, list]:
    """(rows, defects) of every rank's measured residency peaks against its pipeline stage's plan
    (audit.residency.compare), the ranks of one stage merged (their most); ``results``: the ranks' job results."""
    from megatron_s3ac.audit.residency import compare, merge_peaks

    by_stage: dict = {}
    for r in results:
        res = r["residency"]
        if "stage" not in res:
            continue  # no Trainer was built on this rank
        by_stage.setdefault(res["stage"], []).append(res)
    rows, defects = [], []
    for stage, ranks in sorted(by_stage.items()):
        where = f"pipeline stage {stage}" if len(by_stage) > 1 else ""
        errors = [x["error"] for x in ranks if x.get("error")]
        if errors:
            defects.append(f"{where or 'the planner'}: plan.memory.estimate failed on the shrunk config: {errors[0]}")
            continue
        got = merge_peaks(*(x["measured"] for x in ranks))
        got = {ph: got[ph] for ph in RESIDENCY_ORDER if ph in got}
        r, d = compare(got, ranks[0]["planned"], tolerance, where)
        rows += r
        defects += d
    return rows, defects


def residency_lines(rows: list) -> list[str]:
    """The report's residency block: per audited phase and model, measured / planned bytes of each kind either side
    holds and their ratio ("none" where both are 0: the model offloaded, as planned, or absent)."""
    out, keys = [], []
    for row in rows:
        key = (row.get("where", ""), row["phase"], row["model"])
        if key not in keys:
            keys.append(key)
    for key in keys:
        kinds = [x for x in rows if (x.get("where", ""), x["phase"], x["model"]) == key
                 and (x["measured"] or x["planned"])]
        parts = [f"{x['kind']} {x['measured']:,} / {x['planned']:,} B "
                 f"({'x' if x['ratio'] is None else format(x['ratio'], '.3f')})" for x in kinds]
        at = f"{key[0]} " if key[0] else ""
        out.append(f"residency {at}{key[1]:<13} {key[2]:<6} " + (", ".join(parts) or "none (planned none)"))
    return out


def _where(tb: str) -> str:
    """The innermost frame of this package in a traceback text ("file:line in fn"), else the innermost one."""
    import re

    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', tb)
    ours = [f for f in frames if "megatron_s3ac" in f[0]] or frames
    if not ours:
        return "?"
    path, line, fn = ours[-1]
    return f"{path.split('site-packages/')[-1].split('megatron_s3ac/', 1)[-1]}:{line} in {fn}"


def _tail(path: str, n: int = 8) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [x.rstrip() for x in f.readlines()[-n:]]
    except OSError:
        return []


def run_phase(cfg, tmp: str, max_ranks: int, p) -> None:
    """Add to phase ``p`` what the shrunk job did and its defects."""
    from megatron_s3ac.audit.collectives import CollectiveDivergence, check_consistent
    from megatron_s3ac.config import layout_of

    layouts = [layout_of(cfg.actor_layout)] + ([layout_of(cfg.critic_layout)] if cfg.critic_layout else [])
    world, reduced = min_world(layouts, max_ranks), {}
    if world > max_ranks:
        fit, notes = reduced_layouts(layouts, max_ranks)
        if not fit:
            p.ran.append(f"not run: the smallest world keeping the layouts' degrees is {world} ranks (> {max_ranks}, "
                         f"--max-ranks) and {notes[0]}; the other phases stand")
            return
        p.ran.append(f"degrees reduced to fit --max-ranks {max_ranks} (the config's layouts need {world} ranks): "
                     f"{', '.join(notes)}; every kind of parallelism still runs, at smaller groups: what the full "
                     f"sizes add (those groups' collectives at their sizes, the per-rank shares of the experts / "
                     f"sequence / heads) is not seen here; the groups phase runs those groups at their real sizes "
                     f"(docs/rehearse.md)")
        reduced = {f"{name}.{f}": getattr(l, f) for name, l in zip(("actor_layout", "critic_layout"), fit)
                   for f in _REDUCE_ORDER if getattr(l, f) is not None}
        layouts, world = fit, min_world(fit, max_ranks)
    a = layouts[0]
    dp = world // (a.tp * a.pp * a.cp)
    os.makedirs(tmp, exist_ok=True)
    model_dir = save_shrunk(cfg.model.hf_config, layouts, os.path.join(tmp, "shrunk"))
    config_path = write_run_config(cfg, {**run_settings(cfg, model_dir, tmp, dp), **reduced},
                                   os.path.join(tmp, "run.yaml"))
    from megatron_s3ac.config import Placement

    with open(os.path.join(model_dir, "config.json")) as f:
        kind = json.load(f)["model_type"]
    p.ran.append(f"a shrunk {kind} on {world} CPU ranks (data parallel {dp}), the CPU engine at rollout.placement: "
                 f"{Placement(cfg.rollout.placement).value}")
    jobs = (("pipeline: coverage -> value pretraining -> RL, eval + checkpoint each step", "pipeline", [], 1800.0, 0.0),
            (f"resume: the RL stage one more step from its checkpoint (default group timeout {PG_TIMEOUT_S:g} s, "
             f"rank 0's engine {SLOW_S:g} s slower to start and per generation)", "train", ["train.steps=3"],
             PG_TIMEOUT_S, SLOW_S))
    measured = []  # every job's rank results, for the residency block

    def report_residency():
        rows, _ = residency_check(measured)
        p.residency = rows
        p.ran.append(f"residency per phase (measured / planned bytes on one rank, the most over the ranks of a "
                     f"stage and the jobs; planner: plan.memory.residency of the shrunk config; tolerance "
                     f"{RESIDENCY_TOLERANCE:.0%}):")
        p.ran += residency_lines(rows) or ["residency: no audited phase ran"]

    for what, command, extra, pg_timeout, slow in jobs:
        try:
            res = run_with_pg_timeout(_rank, world, pg_timeout, config_path, extra, command, slow, timeout=900.0)
        except DistributedTestError as e:
            p.defects.append(f"{what}: {str(e).strip().splitlines()[-1]}")
            return
        errors = [(r, x["error"]) for r, x in enumerate(res) if x["error"]]
        if errors:
            r, err = errors[0]
            p.defects.append(f"{what}: rank {r}: {err.strip().splitlines()[-1]} (at {_where(err)})")
            p.tracebacks.append(err)
            p.ran += [f"rank {r}'s log: {line}" for line in _tail(os.path.join(tmp, f"{command}.rank{r}.log"))]
            return
        try:
            n = check_consistent([x["records"] for x in res])
        except CollectiveDivergence as e:
            p.defects.append(f"{what}: {e}")
            return
        p.ran.append(f"{what}: steps {res[0]['result']['steps']}, {n} collectives, every group's ranks in step")
        measured += [x["result"] for x in res]
        _, defects = residency_check([x["result"] for x in res])
        if defects:
            p.defects += [f"{what}: residency: {d}" for d in defects]
            report_residency()
            return
    report_residency()

"""Reproduce the S3AC paper's claims in miniature, with several seeds per arm and honest statistics.

    python tools/reproduce_claims.py --seeds 1 2 3 --out runs/claims            # the full report (<= 1 h)
    python tools/reproduce_claims.py --quick --out runs/claims_quick              # CI-sized smoke (<= 10 min)
    python tools/reproduce_claims.py --task arithmetic --out ...                  # the demo's a+b= task
    python tools/reproduce_claims.py --task multistep --max-operands 5 --out ...  # a variant task

The default task is the digit chain ``cumsum`` at length 12 (tasks/chain.py: 12-token answers, one
wrong token dooms the answer); on it every run records its per-token advantages (train.credit_every=1) and
the report adds the Figure-2-style credit plot of S3AC vs GRPO-X (plots/credit.png, megatron_s3ac/eval/credit.py).

Every arm x seed is one ``s3ac-train pipeline`` job (``torchrun -m megatron_s3ac.trainer.cli pipeline
CONFIG overrides``: warm-up -> coverage -> value pretraining -> RL). Arms of one seed share stages
through the pipeline's stage directories: each stage lives in ``OUT/stages/seed<S>/<stage>-<fingerprint>``
(``megatron_s3ac.trainer.stages.pipeline.stage_fingerprint``), so arms that only change RL settings reuse one
warm-up / coverage / value pretraining, an arm that changes a value-pretraining setting gets its own
value pretraining on the shared coverage data, and nothing is shared that differs in a key the stage
depends on. Arms whose metric is a value-pretraining figure stop there (``pipeline.stop_after``); arms
whose metric is "the first N RL steps" run N steps. Jobs run ``--jobs`` at a time, a job starting only
when no running job is still producing a stage it needs. A job whose run directory holds
``pipeline.json`` is complete and reused (the driver resumes). Metrics are read from the run's
``metrics.jsonl`` and the stages' ``DONE.json`` / ``value_pretrain.jsonl``; statistics, the verdict rule
and the claims.json schema are in megatron_s3ac/eval/claims.py. An arm whose settings the trainer
rejects is not run: its claim is "inconclusive" and the rule says why. Writes OUT/claims.json,
OUT/report.md, OUT/plots/*.png and OUT/jobs.json (every job's command, status and wall time).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_s3ac.eval.claims import RULE_PREFIX, THRESHOLD_RULE, arm_summary, combine, compare, threshold, write_claims  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO, "examples", "cpu_demo.yaml")
STAGES = ("warmup", "coverage", "value_pretrain")
# the paper's value head (Intern-S2-Preview-35B) has 2,048 parameters: H = 2048 (§4.3)
PAPER_HIDDEN = 2048


# ----------------------------------------------------------------------------------------------
# Sizes (measured on the 2-core machine: docs/reproduction.md "Sizing")
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Size:
    prompts_per_step: int  # K = 8 arms; K = 1 arms draw prompts_per_step * k prompts (same trajectories)
    k: int
    minibatches: int  # actor and critic mini-batches per rollout step
    steps: int  # RL steps of the arms whose metric is the whole run
    first: int  # the "first RL steps" window, and the length of arms that only need it
    eval_every: int
    eval_prompts: int
    eval_k: int
    extra: tuple[str, ...] = ()  # warm-up / coverage sizing

    def overrides(self) -> list[str]:
        return [f"rollout.prompts_per_step={self.prompts_per_step}", f"rollout.k={self.k}",
                f"algo.actor_minibatches={self.minibatches}", f"algo.critic_minibatches={self.minibatches}",
                f"train.eval_every={self.eval_every}", f"data.eval_prompts={self.eval_prompts}",
                f"eval.k={self.eval_k}", "eval.greedy=false", *self.extra]


FULL = Size(prompts_per_step=32, k=8, minibatches=4, steps=40, first=10, eval_every=8, eval_prompts=400, eval_k=4)
QUICK = Size(prompts_per_step=32, k=8, minibatches=4, steps=8, first=4, eval_every=4, eval_prompts=200, eval_k=2,
             extra=("demo.warmup_eval_every=50", "demo.coverage_prompts=256"))
# the chain task's answers are 3-4x longer: every rollout and update costs more (docs/reproduction.md "Sizing")
CHAIN_FULL = Size(prompts_per_step=32, k=8, minibatches=4, steps=30, first=8, eval_every=6, eval_prompts=300, eval_k=2)
CHAIN_QUICK = Size(prompts_per_step=32, k=8, minibatches=4, steps=8, first=4, eval_every=4, eval_prompts=200, eval_k=2,
                   extra=("demo.coverage_prompts=256",))
SIZES = {"chain": (CHAIN_FULL, CHAIN_QUICK), "arithmetic": (FULL, QUICK), "multistep": (FULL, QUICK)}
CREDIT_TASKS = ("chain", "multistep")  # answers long enough for a credit-by-position plot


# ----------------------------------------------------------------------------------------------
# Reading a run
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RunDirs:
    """Where one arm x seed wrote: ``out`` (train.out_dir: metrics.jsonl, pipeline.json) and the
    directory of every pipeline stage it ran (shared with the other arms of its seed)."""

    out: str
    stages: tuple[tuple[str, str], ...] = ()

    def stage(self, name: str) -> Optional[str]:
        return dict(self.stages).get(name)

    def file(self, name: str) -> Optional[str]:
        """metrics.jsonl lives in ``out``; value_pretrain.jsonl in the value-pretraining stage."""
        if name == "value_pretrain.jsonl":
            d = self.stage("value_pretrain")
            return None if d is None else os.path.join(d, name)
        return os.path.join(self.out, name)


def read_jsonl(path: Optional[str]) -> list[dict]:
    if path is None or not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut by a kill: ignored
    return rows


def _num(x) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x)) else None


def series(run: RunDirs, key: str, file: str = "metrics.jsonl") -> list[float]:
    """The finite values of `key` in step order from one of the run's jsonl files."""
    rows = sorted((r for r in read_jsonl(run.file(file)) if key in r), key=lambda r: r.get("step", 0))
    return [v for v in (_num(r[key]) for r in rows) if v is not None]


def _mean(v: list[float]) -> Optional[float]:
    return sum(v) / len(v) if v else None


def first_mean(key: str, n: int, file: str = "metrics.jsonl") -> Callable[[RunDirs], Optional[float]]:
    return lambda run: _mean(series(run, key, file)[:n])


def last_mean(key: str, n: int, file: str = "metrics.jsonl") -> Callable[[RunDirs], Optional[float]]:
    return lambda run: _mean(series(run, key, file)[-n:])


def mean_over_run(key: str) -> Callable[[RunDirs], Optional[float]]:
    return lambda run: _mean(series(run, key))


def last_value(key: str) -> Callable[[RunDirs], Optional[float]]:
    def f(run):
        v = series(run, key)
        return v[-1] if v else None
    return f


def drop_from_peak(key: str) -> Callable[[RunDirs], Optional[float]]:
    """max over the run minus the last value (0: the run ends at its best)."""
    def f(run):
        v = series(run, key)
        return max(v) - v[-1] if v else None
    return f


def stage_result(stage: str, key: str) -> Callable[[RunDirs], Optional[float]]:
    """A number from a stage's DONE.json ``result`` (e.g. value pretraining's vpt/clip_frac)."""
    def f(run):
        d = run.stage(stage)
        p = None if d is None else os.path.join(d, "DONE.json")
        if p is None or not os.path.exists(p):
            return None
        return _num((json.load(open(p)).get("result") or {}).get(key))
    return f


# ----------------------------------------------------------------------------------------------
# Arms and claims
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Arm:
    overrides: tuple[str, ...] = ()
    length: str = "main"  # main: Size.steps RL steps; first: Size.first RL steps; vpt: stop after value pretraining


def arms(size: Size, hidden: int, coverage_prompts: int) -> dict[str, Arm]:
    """Arm name -> overrides on top of the base config (the same for every seed)."""
    k1 = ("rollout.k=1", f"rollout.prompts_per_step={size.prompts_per_step * size.k}")  # same trajectories per step
    # the paper's 0.01 is 0.01 * (H+1) = 20.5x its 1/(H+1) at H = 2048; here H is small, so 0.01 is *below*
    # 1/(H+1) and a second arm keeps the paper's ratio
    ratio_std = 0.01 * (PAPER_HIDDEN + 1) / (hidden + 1)
    return {
        "s3ac": Arm(),
        "no_value_pretraining": Arm(("value_pretrain.enabled=false",), "first"),
        # only the RL start policy's samples, as many rows as the coverage data (3 checkpoints x prompts)
        "on_policy_value_pretraining": Arm(("demo.coverage_checkpoints=1",
                                            f"demo.coverage_prompts={3 * coverage_prompts}"), "first"),
        "head_init_0.01": Arm(("model.value_head_init_std=0.01",), "vpt"),
        "head_init_paper_ratio": Arm((f"model.value_head_init_std={ratio_std:.4g}",), "vpt"),
        "value_pretrain_clip_1": Arm(("value_pretrain.clip_grad=1.0",), "vpt"),
        "grpo_x": Arm(("algo.name=grpo_x",)),
        # BPCO's privileged critic (issue 37): the critic reads the reference answer; the bounded value head with
        # and without it
        # and without it; these two keep the paper's value pretraining (attention + router frozen), which the
        # privileged critic no longer gets by default (value_pretrain.freeze_attention_and_router: null)
        "s3ac_privileged": Arm(("model.critic_privileged=answer", "value_pretrain.freeze_attention_and_router=true")),
        "s3ac_bounded": Arm(("model.critic_head=bounded",)),
        "s3ac_privileged_bounded": Arm(("model.critic_privileged=answer", "model.critic_head=bounded",
                                        "value_pretrain.freeze_attention_and_router=true")),
        # the privileged critic's recipe (docs/reproduction.md "The privileged critic"): comparing a response token
        # with the answer's is attention's work, so value pretraining trains attention too, 4x longer
        "s3ac_vpt_attn": Arm(("value_pretrain.freeze_attention_and_router=false", "value_pretrain.epochs=8")),
        "s3ac_privileged_vpt_attn": Arm(("model.critic_privileged=answer", "value_pretrain.freeze_attention_and_router=false",
                                         "value_pretrain.epochs=8")),
        "uniform_sampling": Arm(("daps.enabled=false",)),
        "dapo_refill": Arm(("algo.dynamic_sampling_refill=true",)),
        "fixed_lambda_0.95": Arm(("algo.actor_lambda=0.95",)),
        "k1_s3ac": Arm(k1),
        "k1_reinforce_pp": Arm(k1 + ("algo.name=reinforce_pp",)),
        "k1_flash_reinforce": Arm(k1 + ("algo.name=flash_reinforce",)),
    }


@dataclasses.dataclass
class Claim:
    name: str
    metric: str  # what is measured, in words
    fn: Callable[[RunDirs], Optional[float]]
    arms: dict[str, str]  # arm -> label in the report
    higher_is_better: bool
    comparisons: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (claimed better, worse)
    above: Optional[tuple[str, float]] = None  # one-arm claim: (arm, threshold the metric exceeds)
    curve: Optional[tuple[str, str]] = None  # (file, key) plotted over steps
    paper: str = ""


def claims(n_first: int, hidden: int = 64) -> list[Claim]:
    ev, vl, score = "critic/explained_variance", "critic/value_loss_tok", "eval/average"
    vpt_arms = {"s3ac": "coverage data", "no_value_pretraining": "none", "on_policy_value_pretraining": "on-policy data"}
    vpt_cmp = [("s3ac", "no_value_pretraining"), ("s3ac", "on_policy_value_pretraining")]
    final = "held-out sampled pass rate (avg@k) at the last RL step"
    return [
        Claim("value_pretraining_explained_variance", f"critic explained variance, mean over the first {n_first} RL steps",
              first_mean(ev, n_first), vpt_arms, True, vpt_cmp, curve=("metrics.jsonl", ev),
              paper="Fig. 5: coverage critic has higher EV early in RL"),
        Claim("value_pretraining_value_loss", f"critic value loss per token, mean over the first {n_first} RL steps",
              first_mean(vl, n_first), vpt_arms, False, vpt_cmp, curve=("metrics.jsonl", vl),
              paper="Fig. 5: coverage critic has lower value loss early in RL"),
        Claim("value_head_init", "value-pretraining loss, mean over the first 20 critic steps",
              stage_result("value_pretrain", "vpt/loss_first"),
              {"s3ac": f"std 1/(H+1) = {1 / (hidden + 1):.3g}", "head_init_0.01": "std 0.01"}, False,
              [("s3ac", "head_init_0.01")], curve=("value_pretrain.jsonl", "vpt/value_loss"),
              paper="Table 4: 1/(H+1) lowers early value loss (0.72 -> 0.45 at H = 2048)"),
        Claim("value_head_init_paper_ratio", "value-pretraining loss, mean over the first 20 critic steps",
              stage_result("value_pretrain", "vpt/loss_first"),
              {"s3ac": f"std 1/(H+1) = {1 / (hidden + 1):.3g}",
               "head_init_paper_ratio": f"std 20.5/(H+1) = {0.01 * (PAPER_HIDDEN + 1) / (hidden + 1):.3g}"}, False,
              [("s3ac", "head_init_paper_ratio")], curve=("value_pretrain.jsonl", "vpt/value_loss"),
              paper="Table 4 at the paper's ratio: its 0.01 is 20.5/(H+1)"),
        Claim("critic_grad_clip", "fraction of value-pretraining steps whose grad norm exceeds the clip",
              stage_result("value_pretrain", "vpt/clip_frac"), {"s3ac": "clip 10", "value_pretrain_clip_1": "clip 1"},
              False, [("s3ac", "value_pretrain_clip_1")], curve=("value_pretrain.jsonl", "vpt/grad_norm"),
              paper="Table 4: clip 10 vs 1 cuts clipped steps (99.7% -> 12.5%)"),
        Claim("value_head_gradient_share", "value head's share of the squared critic gradient norm, first 10 "
              "value-pretraining steps", first_mean("vpt/head_sq_share", 10, "value_pretrain.jsonl"),
              {"s3ac": "recipe"}, True, above=("s3ac", 0.5), curve=("value_pretrain.jsonl", "vpt/head_sq_share"),
              paper="§4.3: the head holds > 99% of the squared gradient norm in the first 10 updates"),
        Claim("s3ac_vs_grpo_x", final, last_value(score), {"s3ac": "S3AC", "grpo_x": "GRPO-X"}, True,
              [("s3ac", "grpo_x")], curve=("metrics.jsonl", score), paper="Tables 2-3: S3AC > GRPO-X at K > 1"),
        Claim("privileged_explained_variance", "critic explained variance, mean over the RL run",
              mean_over_run(ev), {"s3ac_privileged": "critic sees the answer", "s3ac": "plain critic"}, True,
              [("s3ac_privileged", "s3ac")], curve=("metrics.jsonl", ev),
              paper="BPCO notes sec. 4 / eq. 13: BPCO+Ans raises EV in every experiment"),
        Claim("s3ac_privileged_vs_grpo_x", final, last_value(score),
              {"s3ac_privileged": "S3AC + answer", "grpo_x": "GRPO-X"}, True, [("s3ac_privileged", "grpo_x")],
              curve=("metrics.jsonl", score), paper="BPCO notes sec. 4: BPCO+Ans raises the training reward"),
        Claim("privileged_recipe_explained_variance", "critic explained variance, mean over the RL run",
              mean_over_run(ev), {"s3ac_privileged_vpt_attn": "answer, value pretraining trains attention, 8 epochs",
                                  "s3ac_privileged": "answer, the recipe's value pretraining"}, True,
              [("s3ac_privileged_vpt_attn", "s3ac_privileged")], curve=("metrics.jsonl", ev),
              paper="issue 37: what the privileged critic needs to reach EV >= 0.3"),
        Claim("privileged_explained_variance_vpt_attn", "critic explained variance, mean over the RL run",
              mean_over_run(ev), {"s3ac_privileged_vpt_attn": "critic sees the answer", "s3ac_vpt_attn": "plain critic"},
              True, [("s3ac_privileged_vpt_attn", "s3ac_vpt_attn")], curve=("metrics.jsonl", ev),
              paper="BPCO notes sec. 4, with value pretraining training attention 8 epochs (both arms)"),
        Claim("s3ac_privileged_vpt_attn_vs_grpo_x", final, last_value(score),
              {"s3ac_privileged_vpt_attn": "S3AC + answer (attention-trained value pretraining)", "grpo_x": "GRPO-X"},
              True, [("s3ac_privileged_vpt_attn", "grpo_x")], curve=("metrics.jsonl", score),
              paper="BPCO notes sec. 4: BPCO+Ans raises the training reward"),
        Claim("bounded_head_explained_variance", "critic explained variance, mean over the RL run", mean_over_run(ev),
              {"s3ac_bounded": "bounded head", "s3ac": "linear head"}, True, [("s3ac_bounded", "s3ac")],
              curve=("metrics.jsonl", ev), paper="BPCO notes: the arctan-bounded value head"),
        Claim("bounded_head_privileged_explained_variance", "critic explained variance, mean over the RL run",
              mean_over_run(ev), {"s3ac_privileged_bounded": "bounded head + answer",
                                  "s3ac_privileged": "linear head + answer"}, True,
              [("s3ac_privileged_bounded", "s3ac_privileged")], curve=("metrics.jsonl", ev),
              paper="BPCO notes: the bounded head with the privileged input"),
        Claim("single_rollout_score", final, last_value(score),
              {"k1_s3ac": "S3AC", "k1_reinforce_pp": "REINFORCE++", "k1_flash_reinforce": "FlashREINFORCE"}, True,
              [("k1_s3ac", "k1_reinforce_pp"), ("k1_s3ac", "k1_flash_reinforce")], curve=("metrics.jsonl", score),
              paper="Tables 2-3, K = 1: S3AC > REINFORCE++ and FlashREINFORCE"),
        Claim("single_rollout_stability", "drop of the held-out score from its peak to the last RL step (K = 1)",
              drop_from_peak(score), {"k1_s3ac": "S3AC", "k1_reinforce_pp": "REINFORCE++",
                                      "k1_flash_reinforce": "FlashREINFORCE"}, False,
              [("k1_s3ac", "k1_reinforce_pp"), ("k1_s3ac", "k1_flash_reinforce")],
              curve=("metrics.jsonl", "rollout/entropy"), paper="Fig. 4: critic-free K=1 baselines decline, S3AC holds"),
        Claim("daps_discarded_trajectories", "trajectories discarded by the group filter per step (mean over the run)",
              mean_over_run("filter/discarded_trajectories"), {"s3ac": "DAPS", "uniform_sampling": "uniform"},
              False, [("s3ac", "uniform_sampling")], curve=("metrics.jsonl", "filter/discarded_trajectories"),
              paper="Fig. 6a: DAPS discards fewer trajectories"),
        Claim("daps_final_score", final, last_value(score), {"s3ac": "DAPS", "uniform_sampling": "uniform"}, True,
              [("s3ac", "uniform_sampling")], curve=("metrics.jsonl", score), paper="Table 5: DAPS improves the score"),
        Claim("length_adaptive_lambda", final, last_value(score),
              {"s3ac": "lambda = 1 - 1/(alpha T)", "fixed_lambda_0.95": "lambda = 0.95"}, True,
              [("s3ac", "fixed_lambda_0.95")], curve=("metrics.jsonl", score),
              paper="§3.1 / VAPO: length-adaptive actor lambda"),
        Claim("dapo_refill_explained_variance_first", f"critic explained variance, mean over the first {n_first} RL steps",
              first_mean(ev, n_first), {"dapo_refill": "refill on", "s3ac": "refill off"}, True,
              [("dapo_refill", "s3ac")], curve=("metrics.jsonl", ev),
              paper="issue 17 (paper silent): refilling filtered groups feeds the critic more data"),
        Claim("dapo_refill_explained_variance_last", f"critic explained variance, mean over the last {n_first} RL steps",
              last_mean(ev, n_first), {"dapo_refill": "refill on", "s3ac": "refill off"}, True,
              [("dapo_refill", "s3ac")], curve=("metrics.jsonl", "refill/drawn_groups"),
              paper="issue 17 (paper silent): refilling filtered groups feeds the critic more data"),
    ]


QUICK_CLAIMS = ("value_pretraining_explained_variance", "critic_grad_clip", "value_head_gradient_share",
                "s3ac_vs_grpo_x")
# the chain task's quick mode: 3 arms (S3AC, GRPO-X, clip 1) x 3 seeds fit its 10 minutes (docs/reproduction.md)
CHAIN_QUICK_CLAIMS = ("s3ac_vs_grpo_x", "critic_grad_clip", "value_head_gradient_share")


def base_overrides(args, size: Size) -> list[str]:
    """Settings shared by every arm: size, layout and the task variant."""
    o = size.overrides()
    if args.nproc == 1:  # one rank per job (faster on 2 cores than EP=2 over gloo: docs/reproduction.md)
        o += ["actor_layout.tp=1", "actor_layout.pp=1", "actor_layout.ep=1"]
    if args.max_operand is not None:
        o.append(f"data.max_operand={args.max_operand}")
    if args.task == "chain":
        from megatron_s3ac.tasks.chain import ChainSpec

        cs = ChainSpec(kind=args.chain, min_len=args.min_len, max_len=args.max_len)
        o += ["data.task=chain", "rollout.reward=chain", f"data.chain={cs.kind}", f"data.min_len={cs.min_len}",
              f"data.max_len={cs.max_len}", f"rollout.max_new_tokens={cs.max_response_tokens()}",
              # the warm-up's pass rate jumps within ~50 steps on this task (docs/reproduction.md): evaluate
              # often enough to stop inside the 10-60% band
              "demo.warmup_eval_every=25",
              # coverage from two snapshots past the target beside it: the ones before the jump pass ~0-6%
              "demo.coverage_overshoot_evals=2"]
    if args.task in CREDIT_TASKS:
        o.append("train.credit_every=1")  # per-token advantages of every step: the credit plot
    if args.task == "multistep":
        from megatron_s3ac.tasks.multistep import MultistepSpec

        spec = MultistepSpec(min_operands=args.min_operands, max_operands=args.max_operands,
                             max_operand=args.max_operand or 99, ops=args.ops)
        o += ["data.task=multistep", "rollout.reward=multistep", f"data.min_operands={spec.min_operands}",
              f"data.max_operands={spec.max_operands}", f"data.ops={spec.ops}",
              f"rollout.max_new_tokens={spec.max_response_tokens()}"]
    return o + list(args.override)


# ----------------------------------------------------------------------------------------------
# Planning: one pipeline job per arm x seed, stage directories by fingerprint
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Job:
    arm: str
    seed: int
    overrides: list[str]  # everything after CONFIG on the pipeline command line
    dirs: RunDirs
    status: str = "pending"  # pending | reused | ok | failed | not run
    wall_s: float = 0.0
    cpu_s: float = 0.0  # CPU seconds of the job's processes (user + system)
    note: str = ""

    @property
    def name(self) -> str:
        return f"{self.arm} seed {self.seed}"

    def complete(self) -> bool:
        return os.path.exists(os.path.join(self.dirs.out, "pipeline.json"))


def stage_done(d: str) -> bool:
    return os.path.exists(os.path.join(d, "DONE.json"))


def plan_arm(config: str, out: str, arm: str, a: Arm, seeds: list[int], base: list[str], size: Size) -> list[Job]:
    """The arm's job per seed: overrides and directories; raises ConfigError when the trainer rejects
    the arm. (The config is loaded once per arm: only train.seed differs between its seeds.)"""
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.stages.pipeline import planned_stages, stage_fingerprint

    length = {"main": [f"train.steps={size.steps}"], "first": [f"train.steps={size.first}"],
              "vpt": ["pipeline.stop_after=value_pretrain"]}[a.length]
    over = base + list(a.overrides) + length
    cfg = load_config(config, over + [f"train.seed={seeds[0]}"])
    runs = [s for s, why in planned_stages(cfg).items() if why == "run" and s in STAGES]
    if a.length == "vpt" and "value_pretrain" not in runs:
        raise ValueError(f"arm {arm} stops after value pretraining but runs none")
    jobs = []
    for seed in seeds:
        cfg.train.seed = seed
        stages = tuple((s, os.path.join(out, "stages", f"seed{seed}", f"{s}-{stage_fingerprint(cfg, s)[:12]}"))
                       for s in runs)
        run_out = os.path.join(out, "runs", arm, f"seed{seed}")
        job_over = over + [f"train.seed={seed}"] + [f"pipeline.{s}_dir={d}" for s, d in stages] + \
            [f"train.out_dir={run_out}"]
        jobs.append(Job(arm, seed, job_over, RunDirs(run_out, stages)))
    return jobs


def plan(args, size: Size, chosen: list[Claim]) -> tuple[list[Job], dict[str, str]]:
    """Jobs in launch priority (every seed's recipe arm first: it produces the shared stages) and
    the arms the trainer rejects (arm -> error)."""
    from megatron_s3ac.config import ConfigError, load_config

    out = os.path.abspath(args.out)
    base = base_overrides(args, size)
    cfg0 = load_config(args.config, base)
    hidden = _hidden_size(cfg0)
    arm_def = arms(size, hidden, cfg0.demo.coverage_prompts)
    needed = list(dict.fromkeys(a for c in chosen for a in c.arms))
    needed.sort(key=lambda a: list(arm_def).index(a))  # launch priority: the order of arms()
    jobs, missing = [], {}
    for a in needed:
        try:
            jobs += plan_arm(args.config, out, a, arm_def[a], args.seeds, base, size)
        except (ConfigError, ValueError) as e:
            missing[a] = str(e).replace("\n", " ")
    # arm by arm, every seed of an arm before the next arm: the recipe arm (which produces the shared
    # stages) first; a report cut short then lacks whole arms, not seeds of every arm
    return jobs, missing


def _hidden_size(cfg) -> int:
    if cfg.model.tiny is not None:
        from megatron_s3ac.tasks.arithmetic import tiny_arithmetic_hf_config

        return int(tiny_arithmetic_hf_config().hidden_size)
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(cfg.model.hf_config).hidden_size)


def check_recorded(job: Job) -> Optional[str]:
    """A run directory made by other settings is an error (never silently reused)."""
    p = os.path.join(job.dirs.out, "claims_job.json")
    if not os.path.exists(p):
        return None
    rec = json.load(open(p)).get("overrides")
    if rec != job.overrides:
        diff = sorted(set(rec or []) ^ set(job.overrides))
        return f"{job.dirs.out} was run with other settings ({', '.join(diff)}); delete it or choose another --out"
    return None


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------
def pipeline_cmd(config: str, job: Job, nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "megatron_s3ac.trainer.cli", "pipeline", config, *job.overrides,
            "train.progress=false", "train.tensorboard=false"]


def start_job(config: str, job: Job, nproc: int):
    os.makedirs(job.dirs.out, exist_ok=True)
    with open(os.path.join(job.dirs.out, "claims_job.json"), "w") as f:
        json.dump({"overrides": job.overrides}, f, indent=1)
    cmd = pipeline_cmd(config, job, nproc)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    log = open(os.path.join(job.dirs.out, "log.txt"), "w")
    log.write(" ".join(cmd) + "\n")
    log.flush()
    # own session: a timeout kills the job's whole process group (torchrun and its ranks), nothing else
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    return proc, log, time.time()


def run_jobs(config: str, jobs: list[Job], nproc: int, max_jobs: int, timeout_s: float,
             on_done: Callable[[Job], None] = lambda j: None) -> None:
    """Run the pending jobs, ``max_jobs`` at a time. A job starts once no running job is producing a
    stage it needs (a stage without DONE.json that a running job uses); a job needing a stage whose
    producer failed is failed without running (its log names the producer)."""
    pending = [j for j in jobs if j.status == "pending"]
    running: dict[int, tuple] = {}
    try:
        _schedule(config, pending, running, nproc, max_jobs, timeout_s, on_done)
    finally:  # interrupted (Ctrl-C, an error): the jobs it started go with it, nothing else
        for j, proc, log, _t0 in running.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()


def _schedule(config, pending, running, nproc, max_jobs, timeout_s, on_done) -> None:
    failed_dirs: dict[str, str] = {}
    while pending or running:
        for key, (j, proc, log, t0) in list(running.items()):
            # wait4: the exit status and the CPU time of the job (torchrun + its ranks, which it reaps)
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid == 0 and time.time() - t0 > timeout_s:
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, ru = os.wait4(proc.pid, 0)
                log.write(f"\nreproduce_claims: killed after {timeout_s:.0f} s\n")
            if pid == 0:
                continue
            rc = proc.returncode = os.waitstatus_to_exitcode(status)
            log.close()
            j.wall_s, j.cpu_s = time.time() - t0, ru.ru_utime + ru.ru_stime
            j.status = "ok" if rc == 0 and j.complete() else "failed"
            if j.status == "failed":
                j.note = f"exit {rc}, see {os.path.join(j.dirs.out, 'log.txt')}"
                for _, d in j.dirs.stages:
                    if not stage_done(d):
                        failed_dirs[d] = j.name
            del running[key]
            on_done(j)
        for j in list(pending):
            if len(running) >= max_jobs:
                break
            bad = [failed_dirs[d] for _, d in j.dirs.stages if d in failed_dirs and not stage_done(d)]
            if bad:
                j.status, j.note = "failed", f"a stage it needs failed in {bad[0]}"
                pending.remove(j)
                on_done(j)
                continue
            busy = {d for (r, *_rest) in running.values() for _, d in r.dirs.stages if not stage_done(d)}
            if any(d in busy for _, d in j.dirs.stages if not stage_done(d)):
                continue
            proc, log, t0 = start_job(config, j, nproc)
            running[id(j)] = (j, proc, log, t0)
            pending.remove(j)
            print(f"start {j.name}", flush=True)
        time.sleep(0.5)


def evaluate_claim(c: Claim, values: dict[str, list[Optional[float]]], missing: dict[str, str]) -> dict:
    """The claims.json entry of one claim from its arms' per-seed values."""
    entry = {"name": c.name, "metric": c.metric, "arms": {a: arm_summary(values[a]) for a in c.arms}}
    not_run = {a: missing[a] for a in c.arms if a in missing}
    if not_run:
        entry["verdict"] = "inconclusive"
        entry["rule"] = "not run: the trainer lacks settings for " + "; ".join(
            f"arm {a} ({e})" for a, e in not_run.items())
        return entry
    verdicts, sentences = [], []
    for better, worse in c.comparisons:
        v, s = compare(values[better], values[worse], c.higher_is_better, (better, worse))
        verdicts.append(v)
        sentences.append(s)
    if c.above is not None:
        arm, thr = c.above
        v, s = threshold(values[arm], thr, above=True, name=arm)
        verdicts.append(v)
        sentences.append(s)
    entry["verdict"] = combine(verdicts)
    prefix = RULE_PREFIX + ("higher" if c.higher_is_better else "lower") + " is better. " if c.comparisons else THRESHOLD_RULE
    entry["rule"] = prefix + "; ".join(sentences)
    return entry


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------
def plot_claim(c: Claim, entry: dict, run_dirs: dict[str, list[RunDirs]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if c.curve else 1, figsize=(10 if c.curve else 5, 3.3), squeeze=False)
    ax = axes[0, 0]
    for i, (arm, label) in enumerate(c.arms.items()):
        a = entry["arms"][arm]
        vals = [v for v in a["values"] if v is not None]
        ax.scatter([i] * len(vals), vals, color="gray", s=14, zorder=3)
        if a["mean"] is not None:
            lo, hi = a["ci95"]
            err = None if lo is None else [[a["mean"] - lo], [hi - a["mean"]]]
            ax.errorbar([i], [a["mean"]], yerr=err, fmt="o", color=f"C{i}", capsize=5, zorder=4)
    ax.set_xticks(range(len(c.arms)), list(c.arms.values()), fontsize=7)
    ax.set_xlim(-0.5, len(c.arms) - 0.5)
    ax.set_title(f"{c.name}: {entry['verdict']}", fontsize=9)
    ax.set_ylabel(c.metric[:60], fontsize=7)
    if c.curve:
        file, key = c.curve
        ax = axes[0, 1]
        for i, (arm, label) in enumerate(c.arms.items()):
            curves = [cv for cv in (series(d, key, file) for d in run_dirs.get(arm, [])) if cv]
            if not curves:
                continue
            n = min(len(cv) for cv in curves)
            for cv in curves:
                ax.plot(range(len(cv)), cv, color=f"C{i}", alpha=0.25, lw=0.8)
            ax.plot(range(n), [sum(cv[j] for cv in curves) / len(curves) for j in range(n)], color=f"C{i}", label=label)
        ax.set_xlabel("logged point (per-seed thin, mean thick)", fontsize=8)
        ax.set_title(key, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


CREDIT_ARMS = {"s3ac": "S3AC", "grpo_x": "GRPO-X"}


def credit_plot(run_dirs: dict[str, list[RunDirs]], path: str) -> Optional[dict]:
    """The Figure-2-style plot of the S3AC and GRPO-X arms (their seeds pooled) from the runs'
    credit.jsonl (train.credit_every): S3AC split by its V(s0) and by the group mean reward, GRPO-X by
    the group mean reward; None when neither arm recorded one. Also writes credit.json."""
    from megatron_s3ac.eval.credit import credit_curves, plot_credit, read_credit

    panels = {}
    for arm, label in CREDIT_ARMS.items():
        files = [os.path.join(d.out, "credit.jsonl") for d in run_dirs.get(arm, [])]
        rows = [r for f in files if os.path.exists(f) for r in read_credit(f)]
        if rows:
            panels[label] = credit_curves(rows)
            if any(r.get("v0") is not None for r in rows):  # also split like GRPO-X, for a like-for-like view
                panels[f"{label} (split as GRPO-X)"] = credit_curves(rows, by="group")
    if not panels:
        return None
    plot_credit(panels, path, "mean advantage by response position (all RL steps, seeds pooled)")
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(panels, f, indent=1)
    return panels


def _fmt_arm(a: dict) -> str:
    if a["mean"] is None:
        return "n/a"
    lo, hi = a["ci95"]
    ci = "" if lo is None else f" [{lo:.4g}, {hi:.4g}]"
    return f"{a['mean']:.4g}{ci} (n={sum(v is not None for v in a['values'])})"


def write_report(out: str, entries: list[dict], claims_by_name: dict[str, Claim], cmdline: str, seeds: list[int],
                 jobs: list[Job], missing: dict[str, str], size: Size, wall_s: float,
                 credit: Optional[dict] = None) -> str:
    fmt = _fmt_arm

    lines = ["# S3AC claims in miniature", "", f"Command: `{cmdline}`", "",
             f"Seeds: {seeds}; wall time {wall_s / 60:.1f} min for {len(jobs)} pipeline jobs. RL size: "
             f"{size.prompts_per_step} prompts x K = {size.k} per step, {size.minibatches} actor and critic "
             f"mini-batches, {size.steps} steps (arms that need only the first steps: {size.first}); held-out "
             f"avg@{size.eval_k} on {size.eval_prompts} prompts every {size.eval_every} steps. Intervals: 95% "
             "Student-t over seeds. Verdict rule: megatron_s3ac/eval/claims.py (paired differences; the rule "
             "column of claims.json gives each claim's numbers).", "",
             "| claim | paper | metric | arms: mean [95% CI] (n) | verdict |", "|---|---|---|---|---|"]
    for e in entries:
        c = claims_by_name[e["name"]]
        arms_s = "<br>".join(f"{c.arms[a]}: {fmt(s)}" for a, s in e["arms"].items())
        lines.append(f"| {e['name']} | {c.paper} | {e['metric']} | {arms_s} | **{e['verdict']}** |")
    lines += ["", "## Rules with numbers", ""] + [f"- **{e['name']}**: {e['rule']}" for e in entries]
    if missing:
        lines += ["", "## Arms not run (the trainer rejects their settings)", ""] + [f"- {a}: {e}" for a, e in missing.items()]
    bad = [j for j in jobs if j.status == "failed"]
    if bad:
        lines += ["", "## Jobs that failed (their values are null)", ""] + [f"- {j.name}: {j.note}" for j in bad]
    lines += ["", "## Jobs", "", "| job | status | wall s | CPU s |", "|---|---|---|---|"]
    lines += [f"| {j.name} | {j.status} | {j.wall_s:.0f} | {j.cpu_s:.0f} |" for j in jobs]
    if credit:
        lines += ["", "## Credit by response position (paper Fig. 2b)", "",
                  "Mean advantage over all tokens of each group (all RL steps, seeds pooled; easy / hard: above / at "
                  "or below the step's median difficulty estimate; curves in plots/credit.png, numbers in "
                  "plots/credit.json).", "", "| arm | split by | " + " | ".join(next(iter(credit.values()))["mean"])
                  + " |", "|---|---|" + "---|" * len(next(iter(credit.values()))["mean"])]
        for label, c in credit.items():
            cells = [("n/a" if v is None else f"{v:+.3f} (n={c['responses'][g]})") for g, v in c["mean"].items()]
            lines.append(f"| {label} | {c['estimate']} | " + " | ".join(cells) + " |")
        lines += ["", "![credit](plots/credit.png)"]
    lines += ["", "## Plots", ""] + [f"![{e['name']}](plots/{e['name']}.png)" for e in entries]
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="train.seed of each run (default 1 2 3; quick on the arithmetic / multistep task 1 2)")
    p.add_argument("--out", required=True, help="output directory (runs/, stages/, claims.json, report.md, plots/)")
    p.add_argument("--quick", action="store_true", help="CI-sized smoke: short runs, claims " + ", ".join(
        CHAIN_QUICK_CLAIMS) + " (arithmetic / multistep: " + ", ".join(QUICK_CLAIMS) + ")")
    p.add_argument("--claims", nargs="+", default=None, help="only these claims (names in claims.json)")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--steps", type=int, default=None, help="RL steps of the whole-run arms (default: the size's)")
    p.add_argument("--task", choices=("chain", "arithmetic", "multistep"), default="chain",
                   help="chain (default): the digit-chain task, 12-32-token answers (tasks/chain.py); "
                        "arithmetic: the demo's a+b=; multistep: a+b+c= written step by step")
    p.add_argument("--chain", default="cumsum", help="chain: the kind (cumsum, add, reverse, sort, runsum)")
    p.add_argument("--min-len", type=int, default=12, help="chain: shortest chain")
    p.add_argument("--max-len", type=int, default=12, help="chain: longest chain")
    p.add_argument("--max-operand", type=int, default=None)
    p.add_argument("--min-operands", type=int, default=3, help="multistep: fewest operands per prompt")
    p.add_argument("--max-operands", type=int, default=5, help="multistep: most operands per prompt")
    p.add_argument("--ops", default="+", help="multistep: operators drawn ('+' or '+-')")
    p.add_argument("--override", nargs="*", default=[], help="extra key=value for every run")
    p.add_argument("--nproc", type=int, default=1, help="torchrun ranks per job (1: tp = pp = ep = 1)")
    p.add_argument("--jobs", type=int, default=2, help="pipeline jobs at a time")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds before a job is killed")
    p.add_argument("--dry-run", action="store_true", help="print the jobs and exit")
    p.add_argument("--reuse-only", action="store_true",
                   help="launch nothing: use the runs already in OUT (a missing one counts as failed)")
    args = p.parse_args(argv)
    if args.seeds is None:
        args.seeds = [1, 2] if args.quick and args.task != "chain" else [1, 2, 3]
    if len(set(args.seeds)) != len(args.seeds):
        p.error("--seeds must be distinct")
    if args.jobs < 1 or args.nproc < 1:
        p.error("--jobs and --nproc must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    size = SIZES[args.task][1 if args.quick else 0]
    if args.steps is not None:
        size = dataclasses.replace(size, steps=args.steps, eval_every=max(1, min(size.eval_every, args.steps)))
    out = os.path.abspath(args.out)
    from megatron_s3ac.config import load_config

    hidden = _hidden_size(load_config(args.config, base_overrides(args, size)))
    all_claims = claims(n_first=size.first, hidden=hidden)
    quick_claims = CHAIN_QUICK_CLAIMS if args.task == "chain" else QUICK_CLAIMS
    names = args.claims or (list(quick_claims) if args.quick else [c.name for c in all_claims])
    unknown = set(names) - {c.name for c in all_claims}
    if unknown:
        print(f"reproduce_claims: unknown claims {sorted(unknown)}", file=sys.stderr)
        return 2
    chosen = [c for c in all_claims if c.name in names]
    jobs, missing = plan(args, size, chosen)
    for a, e in missing.items():
        print(f"arm {a}: not run ({e})", file=sys.stderr)
    errors = [e for e in (check_recorded(j) for j in jobs) if e]
    if errors:
        print("reproduce_claims: " + "\n".join(errors), file=sys.stderr)
        return 2
    if args.dry_run:
        for j in jobs:
            print(j.name, " ".join(j.overrides))
        return 0
    os.makedirs(os.path.join(out, "plots"), exist_ok=True)
    for j in jobs:
        if j.complete():
            j.status = "reused"
        elif args.reuse_only:
            j.status, j.note = "failed", "not in OUT (--reuse-only)"

    def write_jobs():
        with open(os.path.join(out, "jobs.json"), "w") as f:
            json.dump([dataclasses.asdict(x) for x in jobs], f, indent=1)

    def record(j):
        print(f"[{sum(x.status != 'pending' for x in jobs)}/{len(jobs)}] {j.name}: {j.status} "
              f"({j.wall_s:.0f} s wall, {j.cpu_s:.0f} s CPU)"
              + (f" {j.note}" if j.note else ""), flush=True)
        write_jobs()

    run_jobs(args.config, jobs, args.nproc, args.jobs, args.run_timeout, record)
    write_jobs()
    by_name = {c.name: c for c in all_claims}
    dirs = {(j.arm, j.seed): j.dirs for j in jobs}
    run_dirs = {a: [dirs[(a, s)] for s in args.seeds if (a, s) in dirs] for a in {j.arm for j in jobs}}
    entries = []
    for c in chosen:
        vals = {a: [c.fn(dirs[(a, s)]) if (a, s) in dirs else None for s in args.seeds] for a in c.arms}
        entries.append(evaluate_claim(c, vals, missing))
    write_claims(entries, os.path.join(out, "claims.json"))
    for e in entries:
        plot_claim(by_name[e["name"]], e, run_dirs, os.path.join(out, "plots", f"{e['name']}.png"))
    credit = credit_plot(run_dirs, os.path.join(out, "plots", "credit.png"))
    cmdline = "python tools/reproduce_claims.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rep = write_report(out, entries, by_name, cmdline, args.seeds, jobs, missing, size, time.time() - t0, credit)
    for e in entries:  # the verdict with the numbers it follows from (the rule of megatron_s3ac/eval/claims.py)
        arms_s = "; ".join(f"{a} {_fmt_arm(s)}" for a, s in e["arms"].items())
        # every seed's value (seeds in order): the paired differences and their t-interval can be recomputed
        per_seed = "; ".join(f"{a} " + ", ".join(f"seed {sd}: " + ("n/a" if v is None else f"{v:.6g}")
                                               for sd, v in zip(args.seeds, s["values"])) for a, s in e["arms"].items())
        print(f"{e['name']}: {e['verdict']}\n  arms: {arms_s}\n  per seed: {per_seed}\n  rule: {e['rule']}")
    print(f"claims: {os.path.join(out, 'claims.json')}  report: {rep}  wall {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

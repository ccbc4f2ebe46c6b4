"""Evaluation every N training steps, for s3ac-train: held-out sets loaded once, best step tracked.

The trainer calls, after the rollout engine holds step `step`'s weights:

    if evaluator.should_run(step):
        metrics = evaluator.run(step, engine, tokenizer)   # {"eval/<name>/avg@k": ..., "eval/average": ...}
        logger.log(metrics, step)
    ... when rotating checkpoints, never delete evaluator.best_step ...

Every call uses the same sampling seed, so differences between steps come from the weights, not
from sampling noise. evaluate() restores all global RNG states, so training with evaluation draws
the same random numbers as training without it.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping, Optional, Union

from megatron_s3ac.eval.report import flat_metrics, write_report
from megatron_s3ac.eval.runner import BenchmarkSource, as_spec, evaluate
from megatron_s3ac.rollout.base import SamplingParams


class PeriodicEvaluator:
    """every_n_steps <= 0 disables it. report_dir: where eval_step<step>.json reports go (None: not written).
    Other arguments are evaluate()'s."""

    def __init__(self, benchmarks: Mapping[str, BenchmarkSource], every_n_steps: int,
                 k: Union[int, Mapping[str, int]] = 1, params: Optional[SamplingParams] = None, seed: int = 0,
                 template: str = "auto", report_dir: Optional[str] = None, reward_pool=None, batch_size: int = 64,
                 judge=None, vision=None):
        # Load (and validate) the files once, at start-up, not at the first evaluation hours later.
        self.benchmarks = {}
        for name, src in benchmarks.items():
            spec, bench = as_spec(name, src)
            self.benchmarks[name] = dataclasses.replace(spec, source=bench)  # the caller's spec is left as is
        self.every_n_steps = every_n_steps
        self.k, self.params, self.seed, self.template = k, params, seed, template
        self.report_dir, self.reward_pool, self.batch_size = report_dir, reward_pool, batch_size
        self.judge = judge  # eval.judge.LLMJudge or None (math-verify)
        self.vision = vision  # evaluate()'s: a VL checkpoint's VisionProcessor for image sets
        self.best_step: Optional[int] = None
        self.best_score = -math.inf
        self.history: list[tuple[int, float]] = []  # (step, average avg@k)

    def should_run(self, step: int) -> bool:
        return self.every_n_steps > 0 and step > 0 and step % self.every_n_steps == 0

    def run(self, step: int, engine, tokenizer) -> dict[str, float]:
        """Evaluate now; returns flat metrics (plus "eval/is_best" 1.0/0.0) and updates best_step."""
        report = evaluate(engine, tokenizer, self.benchmarks, k=self.k, params=self.params, seed=self.seed,
                          template=self.template, reward_pool=self.reward_pool, batch_size=self.batch_size,
                          judge=self.judge, vision=self.vision)
        report["step"] = step
        avg = report["average_avg_at_k"]
        is_best = math.isfinite(avg) and avg > self.best_score  # ties keep the earlier step
        if is_best:
            self.best_step, self.best_score = step, avg
        self.history.append((step, avg))
        if self.report_dir is not None:
            write_report(report, os.path.join(self.report_dir, f"eval_step{step}.json"))
        return {**flat_metrics(report), "eval/is_best": float(is_best)}

    # -- resume ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        # plain numbers (a numpy float from the report would need a full unpickle to load: checkpoint.safe_load)
        return {"best_step": None if self.best_step is None else int(self.best_step),
                "best_score": float(self.best_score), "history": [(int(s), float(a)) for s, a in self.history]}

    def load_state_dict(self, state: dict) -> None:
        self.best_step, self.best_score = state["best_step"], state["best_score"]
        self.history = [tuple(h) for h in state["history"]]


class TrainerEvaluation:
    """A trainer's evaluation (rank 0, where the engine lives): the held-out split and the
    ``eval.benchmarks`` files as benchmark specs, the periodic evaluator, greedy and sampled reports.
    ``eval_cfg``: the trainer's ``eval`` section (read by attribute); ``heldout_rows``: pre-tokenized
    rows {prompt, answer, prompt_ids} (the exact ids the trainer would feed); ``reward_pool``: a
    callable returning the run's one verifier pool (called only when the reward is isolated)."""

    def __init__(self, eval_cfg, *, default_reward: str, default_max_new_tokens: int, heldout_rows: list,
                 every_n_steps: int, report_dir: Optional[str], reward_pool, vision=None):
        from megatron_s3ac.eval.runner import BenchmarkSpec
        from megatron_s3ac.rollout.rewards import get_reward

        e = self.cfg = eval_cfg
        self.default_max_new_tokens = default_max_new_tokens
        self.evaluator: Optional[PeriodicEvaluator] = None
        self.reward_pool = None
        self.sets: dict = {}
        self.vision = vision  # data.prompts.VisionProcessor of a VL checkpoint: image sets go to the engine with images
        reward = e.reward or default_reward
        self.judge = judge_from_cfg(getattr(e, "judge", None))
        if e.heldout and heldout_rows:
            self.sets["heldout"] = BenchmarkSpec(heldout_rows, reward=reward, k=e.k_for.get("heldout"))
        for name, path in e.benchmarks.items():
            self.sets[name] = BenchmarkSpec(path, reward=reward, k=e.k_for.get(name),
                                            schema=getattr(e, "schema_for", {}).get(name))
        if not self.sets:
            return
        if self.judge is not None:  # a misspelt set name would silently fall back to math-verify
            unknown = set(self.judge.sets) - set(self.sets)
            if unknown:
                from megatron_s3ac.eval.judge import JudgeError

                raise JudgeError(f"eval.judge.sets names no evaluation set: {sorted(unknown)} (sets: {sorted(self.sets)})")
        if get_reward(reward).isolate:  # one verifier pool for the whole run, not one per evaluation
            self.reward_pool = reward_pool()
        self.evaluator = PeriodicEvaluator(self.sets, every_n_steps=every_n_steps, k=e.k,
                                           params=self.params(greedy=False), seed=e.seed, template=e.template,
                                           report_dir=report_dir, reward_pool=self.reward_pool,
                                           batch_size=e.batch_size, judge=self.judge, vision=vision)
        self.sets = self.evaluator.benchmarks  # loaded once (files validated at start-up)
        if self.judge is not None and every_n_steps > 0 and any(
                self.judge.applies(n, s.reward) for n, s in self.sets.items()):
            self.judge.check()  # a down judge stops the run now, not at the first evaluation

    def params(self, greedy: bool) -> SamplingParams:
        e = self.cfg
        return SamplingParams(temperature=0.0 if greedy else e.temperature, top_p=1.0 if greedy else e.top_p,
                              max_new_tokens=e.max_new_tokens or self.default_max_new_tokens)

    def report(self, engine, tokenizer, greedy: bool, sets: Optional[dict] = None) -> Optional[dict]:
        """``evaluate`` on the engine's current weights: greedy = T 0 and k 1, else the eval
        section's sampling settings and k. None when there is nothing to evaluate."""
        sets = self.sets if sets is None else sets
        if not sets:
            return None
        e = self.cfg
        return evaluate(engine, tokenizer, sets, k=1 if greedy else e.k, params=self.params(greedy), seed=e.seed,
                        template=e.template, reward_pool=self.reward_pool, batch_size=e.batch_size, judge=self.judge,
                        vision=self.vision)

    def pass_rate(self, engine, tokenizer, greedy: bool, name: str) -> Optional[float]:
        """avg@k of one set (greedy: k = 1); None if there is no such set."""
        if name not in self.sets:
            return None
        spec = dataclasses.replace(self.sets[name], k=1) if greedy else self.sets[name]
        return self.report(engine, tokenizer, greedy, {name: spec})["benchmarks"][name]["avg_at_k"]

    def periodic(self, step: int, engine, tokenizer) -> dict:
        """Every ``every_n_steps`` steps (after the step's weight sync): eval/<set>/avg@k, pass@k,
        eval/average, eval/is_best (+ eval/<set>/greedy with ``greedy``); {} otherwise."""
        if self.evaluator is None or not self.evaluator.should_run(step):
            return {}
        m = self.evaluator.run(step, engine, tokenizer)
        if self.cfg.greedy:
            rep = self.report(engine, tokenizer, True, {n: dataclasses.replace(s, k=1) for n, s in self.sets.items()})
            m.update({f"eval/{n}/greedy": b["avg_at_k"] for n, b in rep["benchmarks"].items()})
        return m


def judge_from_cfg(cfg):
    """The trainer's ``eval.judge`` section (read by attribute) -> eval.judge.LLMJudge, or None for
    ``math_verify`` (and for a config without the section)."""
    if cfg is None:
        return None
    from megatron_s3ac.eval.judge import make_judge

    name = getattr(cfg, "name", "math_verify")
    name = getattr(name, "value", name)
    return make_judge(name, url=cfg.url, model=cfg.model, api_key_env=cfg.api_key_env, timeout_s=cfg.timeout_s,
                      max_retries=cfg.max_retries, concurrency=cfg.concurrency, max_tokens=cfg.max_tokens,
                      sets=tuple(cfg.sets or ()))

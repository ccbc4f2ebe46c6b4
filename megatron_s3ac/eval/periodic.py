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
                 template: str = "auto", report_dir: Optional[str] = None, reward_pool=None, batch_size: int = 64):
        # Load (and validate) the files once, at start-up, not at the first evaluation hours later.
        self.benchmarks = {}
        for name, src in benchmarks.items():
            spec, bench = as_spec(name, src)
            self.benchmarks[name] = dataclasses.replace(spec, source=bench)  # the caller's spec is left as is
        self.every_n_steps = every_n_steps
        self.k, self.params, self.seed, self.template = k, params, seed, template
        self.report_dir, self.reward_pool, self.batch_size = report_dir, reward_pool, batch_size
        self.best_step: Optional[int] = None
        self.best_score = -math.inf
        self.history: list[tuple[int, float]] = []  # (step, average avg@k)

    def should_run(self, step: int) -> bool:
        return self.every_n_steps > 0 and step > 0 and step % self.every_n_steps == 0

    def run(self, step: int, engine, tokenizer) -> dict[str, float]:
        """Evaluate now; returns flat metrics (plus "eval/is_best" 1.0/0.0) and updates best_step."""
        report = evaluate(engine, tokenizer, self.benchmarks, k=self.k, params=self.params, seed=self.seed,
                          template=self.template, reward_pool=self.reward_pool, batch_size=self.batch_size)
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
        return {"best_step": self.best_step, "best_score": self.best_score, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.best_step, self.best_score = state["best_step"], state["best_score"]
        self.history = [tuple(h) for h in state["history"]]

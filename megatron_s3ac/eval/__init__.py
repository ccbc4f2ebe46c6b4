"""Evaluation: avg@k / pass@k with 95% intervals on held-out benchmarks (standalone and periodic).

estimators.py  avg@k, unbiased pass@k, bootstrap intervals
benchmarks.py  benchmark files in the MATH500/AIME/AMC23/OlympiadBench/Minerva/GPQA schemas -> items
scoring.py     math-verify (worker pool, timeouts score 0) and multiple-choice letter extraction
rng.py         save/restore of every global RNG around evaluation
runner.py      evaluate(engine, tokenizer, benchmarks, k, params, seed) -> report dict
report.py      table, flat metrics, JSON
periodic.py    PeriodicEvaluator for s3ac-train (every N steps, best step tracked)
cli.py         s3ac-eval
Kept import-light: torch/transformers are imported by the modules that need them.
"""

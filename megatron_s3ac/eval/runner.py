"""evaluate(): generate k samples per benchmark prompt with a rollout engine, score, report.

The report (JSON-serialisable dict):
  {"seed", "sampling": {...}, "average_avg_at_k": mean avg@k over non-empty benchmarks,
   "benchmarks": {name: {"k", "avg_at_k", "avg_at_k_ci95": [lo, hi], "pass_at_k", "pass_at_k_ci95",
                         "num_prompts", "num_samples", "num_skipped", "skipped": {reason: n},
                         "verifier_timeouts", "verifier_crashes", "verifier_errors",
                         "judge" (math_verify | llm:<model> | the reward), "judge_calls", "judge_unparsable",
                         "finish_reasons": {reason: n}, "mean_response_tokens", "seconds"}}}
Intervals: percentile bootstrap over prompts (estimators.py).

It never touches training state: the engine is only asked to generate (no weight update, no
cache of training statistics), sampling uses seeds derived from `seed` alone, and every global RNG
(python, numpy, torch CPU/CUDA) is restored on exit, so a training run with periodic evaluation
draws exactly the random numbers it would draw without it.
"""
from __future__ import annotations

import collections
import dataclasses
import time
import zlib
from typing import Any, Iterable, Mapping, Optional, Union

import numpy as np
import torch

from megatron_s3ac.eval.benchmarks import (Benchmark, EvalInputError, decode_response, load_benchmark, prompt_inputs,
                                           undecodable_ids)
from megatron_s3ac.eval.estimators import summarize
from megatron_s3ac.eval.rng import preserved_rng_state
from megatron_s3ac.eval.scoring import score
from megatron_s3ac.rollout.base import RolloutEngine, SamplingParams
from megatron_s3ac.rollout.rewards import RewardPool, get_reward


@dataclasses.dataclass
class BenchmarkSpec:
    """A benchmark with per-benchmark settings; None fields fall back to evaluate()'s arguments.

    source: a file path, an iterable of row dicts, or a loaded Benchmark.
    reward: registered reward for kind "math" items; see resolve_reward for how it combines with the
        reward the file declares.
    template: see benchmarks.render_prompt ("auto", "chat", "raw", or a "{prompt}" format).
    schema: a release schema the file must follow (benchmarks.SCHEMAS: aime26, hmmt26, imo_answerbench);
        None: the one the benchmark's name implies, if any; "auto": rows detected one by one.
    """

    source: Union[str, Iterable[Any], Benchmark]
    k: Optional[int] = None
    reward: Optional[str] = None
    template: Optional[str] = None
    schema: Optional[str] = None


BenchmarkSource = Union[str, Iterable[Any], Benchmark, BenchmarkSpec]


def as_spec(name: str, source: BenchmarkSource) -> tuple[BenchmarkSpec, Benchmark]:
    """Normalise any accepted source into (spec, loaded benchmark)."""
    spec = source if isinstance(source, BenchmarkSpec) else BenchmarkSpec(source)
    bench = spec.source if isinstance(spec.source, Benchmark) else load_benchmark(name, spec.source, spec.schema)
    return spec, bench


DEFAULT_REWARD = "math"


def resolve_reward(spec: BenchmarkSpec, bench: Benchmark) -> str:
    """The reward `bench`'s math items are scored with; raises EvalInputError instead of guessing.

    - caller's (spec.reward) and file's (bench.reward) both set: they must agree;
    - one of them set: that one;
    - neither: "math" (math-verify) for text benchmarks (the public math schemas); refused for a
      pre-tokenized set: such files are written by a trainer for its own task (e.g. the CPU demo's
      "a+b=" with reward "arithmetic"), and the math verifier scoring it would be a guess.
    The name must be registered.
    """
    from megatron_s3ac.rollout.rewards import registered_rewards

    if spec.reward is not None and bench.reward is not None and spec.reward != bench.reward:
        raise EvalInputError(f"{bench.name}: reward {spec.reward!r} was asked for but {bench.source} declares "
                             f"{bench.reward!r}; drop --reward or fix the file")
    name = spec.reward or bench.reward
    if name is None:
        if bench.pretokenized and any(it.kind != "choice" for it in bench.items):
            raise EvalInputError(
                f"{bench.name}: {bench.source} is pre-tokenized (rows carry prompt_ids) and declares no reward; "
                f"refusing to guess: pass --reward NAME (registered: {registered_rewards()}), add a \"reward\" "
                f"field to its rows, or a sidecar {bench.source}.meta.json with {{\"reward\": NAME}}")
        name = DEFAULT_REWARD
    if name not in registered_rewards():
        raise EvalInputError(f"{bench.name}: unknown reward {name!r}; registered: {registered_rewards()}")
    return name


def batch_seed(seed: int, name: str, batch: int) -> int:
    """A 31-bit sampling seed that depends only on (seed, benchmark name, batch index)."""
    state = np.random.SeedSequence([seed, zlib.crc32(name.encode()), batch]).generate_state(1)[0]
    return int(state) & 0x7FFFFFFF


def evaluate(engine: RolloutEngine, tokenizer, benchmarks: Mapping[str, BenchmarkSource], k: Union[int, Mapping[str, int]] = 1,
             params: Optional[SamplingParams] = None, seed: int = 0, *, template: str = "auto",
             reward_pool: Optional[RewardPool] = None, batch_size: int = 64, reward_workers: int = 2,
             verifier_timeout_s: float = 5.0, keep_samples: bool = False, judge=None, vision=None) -> dict:
    """Evaluate `engine` on each benchmark with k samples per prompt; returns the report dict.

    k: one value, or {name: k} (missing names get 1); a BenchmarkSpec's own k wins.
    params: sampling settings; its seed is replaced by seeds derived from `seed`.
    reward_pool: reused if given (the trainer's), else one is started only if a benchmark needs it.
    batch_size: prompts per engine.generate call (each expands to batch_size * k sequences).
    keep_samples: also return per-prompt responses and correctness under "samples".
    judge: None (math items scored by their reward: math-verify for "math") or an eval.judge.LLMJudge, which
        scores the math items of the sets it applies to (``judge.applies(name, reward)``); its endpoint is
        checked before anything is generated.
    vision: the model's ``data.prompts.VisionProcessor`` (image benchmarks: each item's images go to the engine
        with its expanded ids); None for a text-only model, which refuses an image benchmark.
    """
    params = params or SamplingParams()
    loaded = {name: as_spec(name, src) for name, src in benchmarks.items()}
    # every benchmark's reward is settled before anything is generated: no partial report
    loaded = {name: (dataclasses.replace(spec, reward=resolve_reward(spec, bench)), bench)
              for name, (spec, bench) in loaded.items()}
    for name, (_, bench) in loaded.items():  # before anything is generated: no partial report
        if vision is None and any(it.images for it in bench.items):
            raise EvalInputError(f"{name}: an image benchmark, but the model is text-only (no vision_config / "
                                 f"preprocessor_config.json): evaluate a vision-language checkpoint")
    judged = {name for name, (spec, _) in loaded.items() if judge is not None and judge.applies(name, spec.reward)}
    if judged:
        judge.check()  # a down endpoint fails now, not after the generation
    own_pool = None
    report: dict[str, Any] = {"seed": seed, "sampling": dataclasses.asdict(params), "benchmarks": {}}
    with preserved_rng_state(), torch.no_grad():
        try:
            for name, (spec, bench) in loaded.items():
                bench_k = spec.k or (k.get(name, 1) if isinstance(k, Mapping) else k)
                pool = reward_pool
                needs_pool = (name not in judged and any(it.kind != "choice" for it in bench.items)
                              and get_reward(spec.reward).isolate)
                if needs_pool and pool is None:
                    own_pool = own_pool or RewardPool(num_workers=reward_workers, timeout_s=verifier_timeout_s)
                    pool = own_pool
                report["benchmarks"][name] = _evaluate_one(
                    engine, tokenizer, bench, spec, bench_k, params, seed, spec.template or template, pool,
                    batch_size, keep_samples, judge if name in judged else None, vision)
        finally:
            if own_pool is not None:
                own_pool.close()
    scores = [b["avg_at_k"] for b in report["benchmarks"].values() if b["num_prompts"]]
    report["average_avg_at_k"] = float(np.mean(scores)) if scores else float("nan")
    return report


def _undecodable(tokenizer, samples, texts) -> tuple[list[int], int, int]:
    """(ids outside the tokenizer's vocabulary, responses with non-special tokens, those among them
    that decode to empty text) for one prompt's samples and their decoded texts."""
    specials = getattr(tokenizer, "all_special_ids", None)
    if specials is None:  # a non-HF vocabulary (CharVocab): a special token is one that decodes to ""
        is_content = lambda t: bool(decode_response(tokenizer, [t]))  # noqa: E731
    else:
        specials = set(specials)
        is_content = lambda t: t not in specials  # noqa: E731
    bad, content, empty = [], 0, 0
    for s, text in zip(samples, texts):
        bad += undecodable_ids(tokenizer, s.response_ids)
        if any(is_content(t) for t in s.response_ids):
            content += 1
            empty += not text
    return bad, content, empty


def _check_decodable(name: str, tokenizer, bad: list[int], content: int, empty: int, example) -> None:
    """Raise EvalInputError when responses cannot be decoded: any token outside the tokenizer's
    vocabulary, or every response with content decoding to "" (a stand-in tokenizer; one odd empty
    decode is left to the verifier). Scoring such text would report a wrong number, not a measurement."""
    if not bad and not (content and empty == content):
        return
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "size", "?")
    why = (f"{len(bad)} generated ids are outside its vocabulary (e.g. {sorted(set(bad))[:8]})" if bad
           else f"all {content} responses with content decode to empty text")
    raise EvalInputError(f"{name}: the tokenizer ({type(tokenizer).__name__}, {size} tokens) cannot decode the "
                         f"model's responses: {why}; e.g. ids {list(example)[:16]}. Is it the model's tokenizer? "
                         f"(a model directory without tokenizer files gets an empty stand-in)")


def encoded_prompt(bench: Benchmark, index: int, item, tokenizer, template: str, vision=None):
    """``prompt_inputs`` of item ``index`` of ``bench``; an EvalInputError names the file and the item."""
    try:
        return prompt_inputs(item, tokenizer, template, vision)
    except EvalInputError as err:
        raise EvalInputError(f"{bench.source}: item {index} of {bench.name}: {err}") from None


def check_encodable(benches: dict, tokenizer, template: str) -> None:
    """Every text item of ``{name: BenchmarkSpec}`` through the tokenizer, before an engine starts (image items are
    expanded at generation: their processor needs the model)."""
    for spec in benches.values():
        bench = spec.source
        for i, it in enumerate(bench.items):
            if not it.images:
                encoded_prompt(bench, i, it, tokenizer, template)


def _evaluate_one(engine, tokenizer, bench: Benchmark, spec: BenchmarkSpec, k: int, params: SamplingParams,
                  seed: int, template: str, pool, batch_size: int, keep_samples: bool, judge=None, vision=None) -> dict:
    if k < 1:
        raise ValueError(f"{bench.name}: k must be >= 1, got {k}")
    t0 = time.monotonic()
    items = bench.items
    texts: list[list[str]] = []
    finish = collections.Counter()
    num_tokens = 0
    bad, content, empty, example = [], 0, 0, ()
    for b, start in enumerate(range(0, len(items), batch_size)):
        batch = items[start:start + batch_size]
        inputs = [encoded_prompt(bench, start + j, it, tokenizer, template, vision) for j, it in enumerate(batch)]
        ids, images = [i for i, _ in inputs], [im for _, im in inputs]
        p = dataclasses.replace(params, seed=batch_seed(seed, bench.name, b))
        if any(im is not None for im in images):
            out = engine.generate(ids, p, n_samples=k, images=images)
        else:  # engines without image prompts keep their four-argument generate
            out = engine.generate(ids, p, n_samples=k)
        for samples in out:
            texts.append([s.response_text if s.response_text is not None
                          else decode_response(tokenizer, s.response_ids) for s in samples])
            got = _undecodable(tokenizer, samples, texts[-1])
            bad, content, empty = bad + got[0], content + got[1], empty + got[2]
            example = example or next((s.response_ids for s in samples if s.response_ids), ())
            finish.update(s.finish_reason for s in samples)
            num_tokens += sum(len(s.response_ids) for s in samples)

    _check_decodable(bench.name, tokenizer, bad, content, empty, example)
    correct = np.zeros((len(items), k), dtype=bool)
    counts = collections.Counter()
    for kind in sorted({it.kind for it in items}):
        rows = [i for i, it in enumerate(items) if it.kind == kind]
        responses = [t for i in rows for t in texts[i]]
        references = [items[i].reference for i in rows for _ in range(k)]
        nchoices = [len(items[i].choices) for i in rows for _ in range(k)]
        if judge is not None and kind == "math":
            ok, c = judge.score([items[i].prompt for i in rows for _ in range(k)], responses, references)
        else:
            ok, c = score(kind, responses, references, num_choices=nchoices, reward=spec.reward, pool=pool)
        correct[rows] = ok.reshape(len(rows), k)
        counts.update(c)

    result = {"k": k, **summarize(correct, seed=seed),
              "num_prompts": len(items), "num_samples": len(items) * k,
              "num_skipped": bench.num_skipped, "skipped": dict(bench.skipped),
              "verifier_timeouts": counts["timeouts"], "verifier_crashes": counts["crashes"],
              "verifier_errors": counts["errors"], "finish_reasons": dict(finish),
              "judge": judge.label if judge is not None else ("math_verify" if spec.reward == "math" else spec.reward),
              "judge_calls": counts["judge_calls"], "judge_unparsable": counts["judge_unparsable"],
              "mean_response_tokens": num_tokens / max(1, len(items) * k),
              "seconds": time.monotonic() - t0}
    if keep_samples:
        result["samples"] = [{"prompt": it.prompt, "reference": it.reference, "responses": texts[i],
                              "correct": correct[i].tolist()} for i, it in enumerate(items)]
    return result

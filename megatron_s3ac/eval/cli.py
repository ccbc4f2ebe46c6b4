"""s3ac-eval: evaluate a model on local benchmark files; prints a table and writes a JSON report.

    s3ac-eval --model CKPT_OR_HF_DIR --bench aime24=data/aime24.jsonl --bench math500=data/math500.parquet \
              --k 1 --k-for aime24=16 --temperature 0.6 --top-p 0.95 --max-new-tokens 8192 --out report.json

--model: a Hugging Face directory (config.json + weights + tokenizer); a directory holding such an
export under hf/; or a megatron torch_dist checkpoint of this project: a training checkpoint step
directory (its actor/ is used) or a converted checkpoint directory, turned into HF safetensors with
megatron_s3ac.convert.mcore_to_hf first (into --convert-dir, else a temporary directory removed
afterwards). Training checkpoints do not store their HF config: pass --hf-config DIR (config.json
+ tokenizer files of the model that was trained).

--engine cpu | hf | sglang: the engine comes from the rollout factory training uses
(megatron_s3ac.rollout.factory.make_engine_factory): cpu = transformers on the CPU, hf = the same on
the GPU when CUDA is present (--dtype fp32|bf16), sglang = sglang.Engine on --tp-size GPUs; a model
the engine cannot serve exits 2 naming --engine.

--judge llm scores free-form answers with an LLM behind an OpenAI-compatible endpoint (eval/judge.py:
strict verdict parsing, bounded timeout and retries, key from --judge-key-env's variable).

Exit status 2, with the cause on stderr and no report, when the numbers could not be trusted: the
model directory has no tokenizer files (and no --tokenizer), a pre-tokenized benchmark declares no
reward and --reward names none, --reward contradicts the file's, the responses cannot be decoded, a
file is not in the release schema its name implies (or --schema names), or the LLM judge is down.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from typing import Optional, Sequence

from megatron_s3ac.eval.benchmarks import EvalInputError
from megatron_s3ac.eval.report import format_table, write_report
from megatron_s3ac.eval.runner import BenchmarkSpec, as_spec, check_encodable, evaluate, resolve_reward
from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.registry import engine_spec, registered_engines


def resolve_model_dir(path: str) -> str:
    """The HF directory to load: `path` itself or its hf/ export; raises if neither exists."""
    for candidate in (path, os.path.join(path, "hf")):
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return candidate
    raise FileNotFoundError(f"{path}: no HF model (config.json) here or under hf/")


def mcore_checkpoint_dir(path: str):
    """The torch_dist directory to convert: <step>/actor of a training checkpoint, or `path` itself."""
    for candidate in (os.path.join(path, "actor"), path):
        if os.path.isfile(os.path.join(candidate, ".metadata")):
            return candidate
    return None


def check_weight_files(model_dir: str) -> None:
    """EvalInputError naming the first *.safetensors file of ``model_dir`` that is truncated or malformed
    (``convert.safetensors_io.check_weight_files``), before a model loads and dies in a raw deserializer traceback."""
    from megatron_s3ac.convert.plan import ConversionError
    from megatron_s3ac.convert.safetensors_io import check_weight_files as check

    try:
        check(model_dir)
    except ConversionError as err:
        raise EvalInputError(str(err)) from None


@contextlib.contextmanager
def model_directory(path: str, hf_config: Optional[str] = None, convert_dir: Optional[str] = None):
    """Yield an HF directory for `path` (see the module docstring), converting a megatron checkpoint."""
    try:
        hf_dir = resolve_model_dir(path)
    except FileNotFoundError:
        hf_dir = None
    if hf_dir is not None:
        yield hf_dir
        return
    mcore = mcore_checkpoint_dir(path)
    if mcore is None:
        raise FileNotFoundError(f"{path}: neither an HF model directory (config.json, or hf/config.json) "
                                f"nor a megatron torch_dist checkpoint (.metadata, or actor/.metadata)")
    from megatron_s3ac.convert import mcore_to_hf

    with contextlib.ExitStack() as stack:
        out = convert_dir or os.path.join(stack.enter_context(tempfile.TemporaryDirectory(prefix="s3ac-eval-")), "hf")
        print(f"converting {mcore} -> {out}", file=sys.stderr)
        mcore_to_hf(mcore, out, hf_config=hf_config, progress=False)
        yield out


def _pairs(values: Sequence[str], flag: str) -> list[tuple[str, str]]:
    out = []
    for v in values:
        name, sep, rest = v.partition("=")
        if not sep or not name or not rest:
            raise SystemExit(f"{flag} expects NAME=VALUE, got {v!r}")
        out.append((name, rest))
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="s3ac-eval", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF directory, or a checkpoint (hf/ export or torch_dist)")
    p.add_argument("--hf-config", default=None, help="HF config/tokenizer dir for a training checkpoint")
    p.add_argument("--convert-dir", default=None, help="keep the HF conversion of a checkpoint here")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--bench", action="append", required=True, metavar="NAME=PATH",
                   help="benchmark file (.jsonl/.json/.parquet); a bare PATH is named by its file stem")
    p.add_argument("--schema", action="append", default=[], metavar="NAME=SCHEMA",
                   help="release schema a benchmark file must follow: aime26 | hmmt26 | imo_answerbench "
                        "(default: the one its NAME implies, if any; 'auto': detect rows one by one)")
    p.add_argument("--k", type=int, default=1, help="samples per prompt (avg@k, pass@k)")
    p.add_argument("--k-for", action="append", default=[], metavar="NAME=K", help="per-benchmark k")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--template", default="auto", help="auto | chat | raw | a format string with {prompt}")
    p.add_argument("--reward", default=None,
                   help="reward for non-choice items (default: the file's 'reward' field or <file>.meta.json; "
                        "else math for text sets; a pre-tokenized set without one is refused)")
    p.add_argument("--judge", choices=("math_verify", "llm"), default="math_verify",
                   help="free-form answers: math_verify (the training reward) or an LLM judge behind an "
                        "OpenAI-compatible /v1/chat/completions endpoint (--judge-url, --judge-model)")
    p.add_argument("--judge-url", default=None, help="judge server: http://host:8000, .../v1 or the full endpoint")
    p.add_argument("--judge-model", default=None, help="the judge model name the server serves")
    p.add_argument("--judge-key-env", default=None, metavar="VAR",
                   help="environment variable holding the judge's API key (never the key itself)")
    p.add_argument("--judge-for", action="append", default=[], metavar="NAME",
                   help="benchmarks the LLM judge scores (default: every set scored with the math reward)")
    p.add_argument("--judge-timeout", type=float, default=60.0, help="seconds per judge request")
    p.add_argument("--judge-retries", type=int, default=3, help="retries per judge request (timeouts, 429, 5xx)")
    p.add_argument("--engine", choices=registered_engines(), default="cpu",
                   help="cpu: transformers on the CPU (exact); hf: the same on the GPU when CUDA is present; "
                        "sglang: sglang.Engine; vllm: a vLLM engine in its own environment (make vllm-env) "
                        "(rollout.factory, as training uses)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="cpu / hf engine weights dtype")
    p.add_argument("--tp-size", type=int, default=1, help="SGLang tensor parallel size")
    p.add_argument("--batch-size", type=int, default=64, help="prompts per generate call")
    p.add_argument("--reward-workers", type=int, default=2)
    p.add_argument("--verifier-timeout", type=float, default=5.0, help="seconds per answer; over it scores 0")
    p.add_argument("--save-samples", action="store_true", help="include every response in the JSON report")
    p.add_argument("--out", default="eval_report.json", help="JSON report path")
    return p.parse_args(argv)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def has_tokenizer_files(path: str) -> bool:
    """True when `path` holds the files of a saved HF tokenizer (any of TOKENIZER_FILES)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def build_engine(kind: str, model_dir: str, tokenizer, tp_size: int = 1, seeded: bool = True, seed: int = 0,
                 dtype: str = "fp32", multimodal: bool = False):
    """The evaluated model's engine, through the rollout factory training uses (one engine, in this process).

    kind: cpu | hf | sglang | vllm (``--engine``; a model sglang cannot serve is refused naming ``--engine``).
    cpu / hf: transformers in ``dtype`` (fp32 | bf16); hf on the GPU when CUDA is present; the engine decodes
    stop strings with ``tokenizer`` (``--tokenizer`` may differ from the model's own).
    sglang: tp_size GPUs; ``seeded``: deterministic inference (SGLang honours per-request seeds only with it)."""
    import torch

    from megatron_s3ac.rollout.engines.registry import EngineRequest
    from megatron_s3ac.rollout.factory import ConfigError, validate_rollout_engine

    try:
        validate_rollout_engine(kind, model_dir=model_dir, key="--engine")
    except ConfigError as e:
        raise EvalInputError(str(e)) from None
    spec = engine_spec(kind, key="--engine")
    # one engine in this process (sglang / vllm start their own processes); no R3 routes needed here
    engine = spec.factory(EngineRequest(
        purpose="eval", model_dir=model_dir, weights_dir=model_dir, seed=seed, routes=False, tp_size=tp_size,
        seeded=seeded, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], device=spec.local_device(),
        multimodal=multimodal))()
    engine.tokenizer = tokenizer  # stop strings decode with the evaluated tokenizer (engines that decode read it)
    return engine


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_s3ac.console import silence_known_warnings

    silence_known_warnings()  # before anything imports megatron
    args = parse_args(argv)
    try:
        return _run(args)
    except (EvalInputError, FileNotFoundError, UnicodeDecodeError) as e:
        print(f"s3ac-eval: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    benches = {}
    for v in args.bench:
        name, sep, path = v.partition("=")
        if not sep:
            name, path = os.path.splitext(os.path.basename(v))[0], v
        benches[name] = BenchmarkSpec(path, reward=args.reward)
    k_for = {name: int(k) for name, k in _pairs(args.k_for, "--k-for")}
    unknown = set(k_for) - set(benches)
    if unknown:
        raise SystemExit(f"--k-for names no --bench: {sorted(unknown)}")
    schemas = dict(_pairs(args.schema, "--schema"))
    unknown = set(schemas) - set(benches)
    if unknown:
        raise SystemExit(f"--schema names no --bench: {sorted(unknown)}")
    for name, spec in benches.items():
        spec.k = k_for.get(name, args.k)
        spec.schema = schemas.get(name)
        # load and settle each file's reward now, before a (possibly slow) engine starts
        spec.source = as_spec(name, spec)[1]
        spec.reward = resolve_reward(spec, spec.source)
    from megatron_s3ac.eval.judge import make_judge

    unknown = set(args.judge_for) - set(benches)
    if unknown:
        raise SystemExit(f"--judge-for names no --bench: {sorted(unknown)}")
    if args.judge == "math_verify" and (args.judge_url or args.judge_model or args.judge_for):
        raise SystemExit("--judge-url / --judge-model / --judge-for need --judge llm")
    judge = make_judge(args.judge, url=args.judge_url, model=args.judge_model, api_key_env=args.judge_key_env,
                       timeout_s=args.judge_timeout, max_retries=args.judge_retries, sets=tuple(args.judge_for))
    if judge is not None:
        judge.check()  # before the model loads: a down judge fails in seconds
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens)
    with model_directory(args.model, args.hf_config, args.convert_dir) as model_dir:
        tok_dir = args.tokenizer or model_dir
        if os.path.isdir(tok_dir) and not has_tokenizer_files(tok_dir):
            # transformers would build the model type's tokenizer with an empty vocabulary and every
            # response would decode to "" (scored 0): refuse instead
            raise EvalInputError(f"{tok_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass --tokenizer DIR")
        check_weight_files(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        check_encodable(benches, tokenizer, args.template)  # a row it cannot encode: named now, not mid-run
        from megatron_s3ac.data.prompts import VisionProcessor

        # image benchmarks: the checkpoint's image processor, and the cpu / hf engine loads the full VL model
        images = any(it.images for spec in benches.values() for it in spec.source.items)
        vision = VisionProcessor.from_pretrained(model_dir) if images and os.path.isdir(model_dir) else None
        if images and vision is None:
            raise EvalInputError(f"{args.model}: image benchmarks need a vision-language checkpoint (vision_config "
                                 f"in config.json); this one is text-only")
        engine = build_engine(args.engine, model_dir, tokenizer, args.tp_size, seed=args.seed, dtype=args.dtype,
                              multimodal=images and engine_spec(args.engine).multimodal_flag)
        try:
            report = evaluate(engine, tokenizer, benches, k=args.k, params=params, seed=args.seed,
                              template=args.template, batch_size=args.batch_size,
                              reward_workers=args.reward_workers, verifier_timeout_s=args.verifier_timeout,
                              keep_samples=args.save_samples, judge=judge, vision=vision)
        finally:
            engine.shutdown()
    report["model"] = os.path.abspath(args.model)
    print(format_table(report))
    write_report(report, args.out)
    print(f"report: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

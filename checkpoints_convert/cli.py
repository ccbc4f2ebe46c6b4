"""Command line: ``hf-to-mcore``, ``mcore-to-hf`` and ``verify`` (see ``--help`` of each).

Errors in the inputs (missing or misshapen tensors, unsupported model_type, corrupted headers,
existing output, config mismatch) print one line naming the cause and exit with status 2; the
output directory is then not created. Numerical disagreement in ``verify`` exits with status 1.
"""
from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="s3ac-convert", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors dir -> megatron-core torch_dist checkpoint")
    a.add_argument("--hf", required=True, help="HF model directory (config.json + *.safetensors)")
    a.add_argument("--out", required=True, help="new checkpoint directory (must not exist)")
    a.add_argument("--workers", type=int, default=2, help="parallel writer threads, one .distcp file each")
    b = sub.add_parser("mcore-to-hf", help="megatron-core torch_dist checkpoint -> HF safetensors dir")
    b.add_argument("--mcore", required=True, help="checkpoint from hf-to-mcore, or an actor checkpoint of training")
    b.add_argument("--out", required=True, help="new HF directory (must not exist)")
    b.add_argument("--hf-config", default=None,
                   help="HF dir (or config.json) of the model: required for training checkpoints; "
                        "config/tokenizer files are copied from it")
    b.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size limit")
    b.add_argument("--dtype", choices=("auto", "fp8"), default="auto",
                   help="auto: the checkpoint's dtypes; fp8: block-scaled e4m3 weights + weight_scale_inv and a "
                        "quantization_config, the layout SGLang loads (docs/fp8.md)")
    b.add_argument("--fp8-keep", default=None, metavar="PATTERNS",
                   help="comma-separated module patterns kept unquantized with --dtype fp8 "
                        "(default: megatron_s3ac.convert.fp8.DEFAULT_KEEP; '' quantizes every matrix)")
    v = sub.add_parser("verify", help="compare transformers and megatron logits of a converted checkpoint")
    v.add_argument("--hf", required=True)
    v.add_argument("--mcore", required=True)
    v.add_argument("--tp", type=int, default=1)
    v.add_argument("--pp", type=int, default=1)
    v.add_argument("--ep", type=int, default=1)
    v.add_argument("--etp", type=int, default=None, help="expert TP (default: tp without EP, else 1)")
    v.add_argument("--cp", type=int, default=1, help="context parallel: the sequence split over cp ranks")
    v.add_argument("--batch", type=int, default=2)
    v.add_argument("--seq-len", type=int, default=16)
    v.add_argument("--atol", type=float, default=1e-4, help="max abs logit difference allowed")
    v.add_argument("--min-top1", type=float, default=0.99, help="min fraction of equal argmax tokens")
    v.add_argument("--dump-logits", default=None, help="torch.save {'hf','mcore'} logits [batch, seq, vocab] to FILE")
    for s in (a, b):
        s.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    from megatron_s3ac.console import silence_known_warnings

    silence_known_warnings()  # before anything imports megatron
    args = _parser().parse_args(argv)
    from megatron_s3ac.convert.plan import ConversionError
    from megatron_s3ac.models.registry import UnsupportedModelError

    try:
        if args.cmd == "hf-to-mcore":
            from megatron_s3ac.convert.hf_to_mcore import hf_to_mcore

            stats = hf_to_mcore(args.hf, args.out, workers=args.workers, progress=not args.no_progress)
            print(stats.summary(f"hf-to-mcore {args.hf} -> {args.out}"))
        elif args.cmd == "mcore-to-hf":
            from megatron_s3ac.convert.mcore_to_hf import mcore_to_hf

            stats = mcore_to_hf(args.mcore, args.out, hf_config=args.hf_config,
                                max_shard_bytes=int(args.max_shard_gb * (1 << 30)), progress=not args.no_progress,
                                dtype=args.dtype, fp8_keep=_keep(args.fp8_keep))
            print(stats.summary(f"mcore-to-hf {args.mcore} -> {args.out}"))
        else:
            return _verify(args)
    except (ConversionError, UnsupportedModelError, FileNotFoundError) as e:
        print(f"s3ac-convert {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


def _keep(arg: str | None):
    if arg is None:
        return None
    return tuple(p.strip() for p in arg.split(",") if p.strip())


def _verify(args) -> int:
    import torch

    from megatron_s3ac.convert.verify import verify

    r = verify(args.hf, args.mcore, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, batch=args.batch,
               seq=args.seq_len, cp=args.cp)
    print(f"verify tp={args.tp} pp={args.pp} ep={args.ep} cp={args.cp}: {r.summary()}")
    if args.dump_logits:
        torch.save({"hf": r.hf_logits, "mcore": r.mcore_logits}, args.dump_logits)
    ok = r.max_abs_diff <= args.atol and r.top1_agreement >= args.min_top1
    if not ok:
        print(f"verify FAILED: tolerance atol={args.atol}, min top-1 {args.min_top1}", file=sys.stderr)
    return 0 if ok else 1

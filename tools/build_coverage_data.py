"""Coverage data for value pretraining (paper §3.3): roll out several policy checkpoints (HF dirs) over
a prompt set and pool (prompt ids, response ids, reward) into one jsonl.

    python tools/build_coverage_data.py --checkpoints ckpt_step0 ckpt_step800 ckpt_step1600 \
        --prompts dapo_math_17k.parquet --reward math --k 4 --max-new-tokens 8192 --out coverage.jsonl \
        --engine sglang --num-engines 4 --tp-size 2

The engine comes from the trainer's factory (megatron_s3ac.rollout.factory): --engine cpu (CPUEngine, in this
process) or sglang (an EnginePool of --num-engines engines of --tp-size GPUs each, in Ray actors).
"""
import argparse
import sys

from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.factory import (
    ConfigError, SGLangSettings, build_rollout_engine, make_engine_factory, validate_rollout_engine, validate_sglang_settings,
)
from megatron_s3ac.rollout.rewards import RewardPool
from megatron_s3ac.trainer.data import load_math_prompts, write_coverage

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", nargs="+", required=True, help="HF dirs of policies of different strengths")
    ap.add_argument("--prompts", required=True, help="jsonl/parquet in DAPO-Math-17k or MATH-1460 schema")
    ap.add_argument("--reward", default="math")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--out", required=True)
    ap.add_argument("--engine", choices=("cpu", "sglang"), default="cpu")
    ap.add_argument("--num-engines", type=int, default=1, help="sglang: data-parallel engines")
    ap.add_argument("--tp-size", type=int, default=1, help="sglang: GPUs (tensor parallel) per engine")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    settings = SGLangSettings(num_engines=a.num_engines, gpus_per_engine=a.tp_size, tp_size=a.tp_size)
    try:  # refuse before any rollout: no partial output
        validate_sglang_settings(settings, prefix="--sglang")
        for ck in a.checkpoints:
            validate_rollout_engine(a.engine, model_dir=ck, key="--engine")
    except ConfigError as err:
        sys.exit(f"build_coverage_data: {err}")
    with RewardPool(num_workers=2) as pool:
        for ck in a.checkpoints:
            eng = build_rollout_engine(make_engine_factory(a.engine, model_dir=ck, settings=settings,
                                                           return_routed_experts=False))
            tokenizer = AutoTokenizer.from_pretrained(ck)
            prompts, stats = load_math_prompts(a.prompts, tokenizer, a.max_prompt_tokens)
            prompts = prompts[:a.num_prompts]
            outs = eng.generate([p.ids for p in prompts], SamplingParams(temperature=a.temperature,
                                max_new_tokens=a.max_new_tokens, seed=0), n_samples=a.k)
            flat = [(p, s) for p, grp in zip(prompts, outs) for s in grp if s.finish_reason != "abort"]
            eng.shutdown()
            texts = [s.response_text or tokenizer.decode(s.response_ids, skip_special_tokens=True) for _, s in flat]
            rewards = pool.score(a.reward, texts, [p.reference for p, _ in flat])
            write_coverage(a.out, [{"prompt_ids": p.ids, "response_ids": s.response_ids, "reward": float(r),
                                    "source": ck} for (p, s), r in zip(flat, rewards)])
            print(f"{ck}: {len(flat)} trajectories, pass rate {(rewards > 0).mean():.3f}, data {stats}")

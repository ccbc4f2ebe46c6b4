"""Coverage data for value pretraining (paper §3.3): roll out several policy checkpoints (HF dirs) over the
trainer config's prompts and pool (prompt ids, response ids, reward) into one jsonl — what the pipeline's
coverage stage writes (``s3ac-train pipeline``; both call megatron_s3ac.trainer.stages.coverage.build_coverage).

    python tools/build_coverage_data.py --config examples/paper/qwen25_math_1p5b_k16.yaml \
        --checkpoints ckpt_step0 ckpt_step800 ckpt_step1600 --out coverage.jsonl [key=value ...]

Everything else comes from the trainer config (and its ``key=value`` overrides): the engine (``rollout.engine``:
cpu | hf | sglang with ``rollout.sglang``), the prompts (``data.*``), the reward (``rollout.reward``), the
response length (``rollout.max_new_tokens``: the RL length, so long correct responses are kept), the sampling
(``rollout.temperature`` / ``top_p``), ``pipeline.coverage_prompts`` / ``coverage_k`` (else ``demo.*``) and
the seed. ``--checkpoints`` defaults to ``pipeline.policies`` (step numbers resolve in ``--warmup-dir``).
A bad config or checkpoint exits 2 before any rollout; the output is written atomically.
"""
import argparse
import json
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the trainer YAML (s3ac-train's schema)")
    ap.add_argument("--checkpoints", nargs="+", default=None,
                    help="HF dirs of policies of different strengths (default: pipeline.policies)")
    ap.add_argument("--warmup-dir", default=None,
                    help="where step-number policies live (default: the pipeline's warm-up stage dir)")
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    a = ap.parse_args(argv)
    from megatron_s3ac.rollout.factory import ConfigError as EngineConfigError, validate_rollout_engine
    from megatron_s3ac.trainer.step.build import build_data
    from megatron_s3ac.config import ConfigError, load_config
    from megatron_s3ac.trainer.stages.coverage import resolve_policies

    try:  # refuse before any rollout: no partial output
        try:
            cfg = load_config(a.config, a.overrides)
        except ConfigError as err:  # the loader names the key; the file is named here
            raise ConfigError(f"--config {a.config}: {err}") from None
        if a.checkpoints is not None:
            cfg.pipeline.policies = list(a.checkpoints)
        from megatron_s3ac.trainer.stages.pipeline import stage_dirs

        policies = resolve_policies(cfg, a.warmup_dir or stage_dirs(cfg)["warmup"])
        for ck in policies:
            validate_rollout_engine(str(getattr(cfg.rollout.engine, "value", cfg.rollout.engine)), model_dir=ck,
                                    key="rollout.engine")
        data = build_data(cfg, use_daps=False)  # the prompt file: a bad row is named here, not mid-run
    except (ConfigError, EngineConfigError, ValueError, FileNotFoundError) as err:
        print(f"build_coverage_data: {err}", file=sys.stderr)
        return 2
    from megatron_s3ac.rollout.rewards import RewardPool, get_reward, score_answers
    from megatron_s3ac.trainer.stages.coverage import build_coverage

    r = cfg.rollout
    with RewardPool(num_workers=r.reward_workers, timeout_s=r.reward_timeout_s) as pool:
        def score(texts, refs):
            return score_answers(r.reward, texts, refs, pool if get_reward(r.reward).isolate else None)

        res = build_coverage(cfg, policies, data.prompts, data.vocab, score, a.out,
                             log=lambda st: print(json.dumps(st), flush=True))
    print(f"{a.out}: {res['trajectories']} trajectories, pass rate {res['pass_rate']:.3f}, "
          f"max_new_tokens {r.max_new_tokens}, data {data.stats}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())

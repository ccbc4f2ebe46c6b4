"""The CPU demo, end to end in one torchrun job (so megatron starts once): the pipeline's stages
(trainer.stages.pipeline) — supervised warm-up of a tiny Qwen3-MoE on "a+b=" until the greedy pass rate enters
the 10-60% band -> coverage data from several warm-up snapshots -> value pretraining -> S3AC (or GRPO-X)
— then the before/after pass-rate table and curve PNGs. The warm-up itself lives in trainer.stages.warmup."""
from __future__ import annotations

import json
import os
import shutil
import time

from megatron_s3ac.trainer.stages.warmup import save_engine_hf, supervised_warmup  # noqa: F401 (the demo's API)


def export_eval_inputs(tr, out: str, tag: str) -> None:
    """Rank 0: the engine's current model as an HF directory (``OUT/hf_<tag>``, with the character
    vocabulary as its tokenizer) and the held-out set as a benchmark file (``OUT/heldout.jsonl``,
    pre-tokenized rows that name their reward), so the table's pass rates can be
    re-derived by standalone evaluation (``megatron_s3ac.eval.runner.evaluate`` on a fresh engine)."""
    if tr.rank != 0:
        return
    save_engine_hf(tr, os.path.join(out, f"hf_{tag}"))
    if not tr.eval_prompts:  # a file set named "heldout" (eval.benchmarks: the multimodal miniature's drawings)
        return
    # the reward travels with the set: s3ac-eval scores it as the trainer did, never by a guess
    reward = tr.cfg.eval.reward or tr.cfg.rollout.reward
    path = os.path.join(out, "heldout.jsonl")
    with open(path + ".tmp", "w") as f:
        for p in tr.eval_prompts:
            f.write(json.dumps({"prompt": p.text, "answer": p.reference, "prompt_ids": list(p.ids),
                                "reward": reward}) + "\n")
    os.replace(path + ".tmp", path)


def run_demo(cfg) -> dict:
    """The pipeline's stages (trainer.stages.pipeline: warm-up -> coverage -> value pretraining -> RL, each
    resumable and skipped when done) + the before/after table, curves and ``demo_result.json``."""
    from megatron_s3ac.trainer.stages.pipeline import Pipeline

    t_start = time.time()
    out = cfg.train.out_dir
    os.makedirs(out, exist_ok=True)
    p = Pipeline(cfg)
    tr = p.tr

    def after_stage(stage, ran):
        if stage == "warmup" or (stage == "rl" and ran):  # the models the table's pass rates are of
            export_eval_inputs(tr, out, "warmup" if stage == "warmup" else "final")

    try:
        st = p.run(after_stage)
    finally:
        tr.close()
    total = time.time() - t_start
    before, after = st["warmup"]["result"]["before"], st["rl"]["result"]["after"]
    vpt = {k: v for k, v in st["value_pretrain"]["result"].items() if k.startswith("vpt/")}
    # a skipped stage's time is the one recorded when it ran (this invocation only loaded its output)
    secs = {s: v["wall_s"] if v["status"] != "skipped" else v.get("recorded_wall_s") or 0.0 for s, v in st.items()}
    e = cfg.eval
    res = {"before": before, "after": after, "wall_s": total, "warmup_s": secs["warmup"],
           "coverage_s": secs["coverage"], "value_pretrain_s": secs["value_pretrain"], "rl_s": secs["rl"],
           "stages": {s: v["status"] for s, v in st.items()}, "algo": cfg.algo.name, "rl_steps": cfg.train.steps,
           "eval": {"set": os.path.abspath(os.path.join(out, "heldout.jsonl") if tr.eval_prompts
                                           else cfg.eval.benchmarks["heldout"]),
                    "models": {"before": os.path.abspath(os.path.join(out, "hf_warmup")),
                               "after": os.path.abspath(os.path.join(out, "hf_final"))},
                    "seed": e.seed, "batch_size": e.batch_size, "sampled_temperature": e.temperature, "sampled_k": e.k,
                    "max_new_tokens": e.max_new_tokens or cfg.rollout.max_new_tokens}, **vpt}
    if tr.rank == 0:
        from megatron_s3ac.trainer.run.plotting import plot_run

        # the stages' logs next to metrics.jsonl, where plot_run and tools/reproduce_claims.py read them
        for stage, name in (("warmup", "warmup.jsonl"), ("value_pretrain", "value_pretrain.jsonl")):
            src = os.path.join(p.dirs[stage], name)
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(out, name))
        pngs = plot_run(out)
        n_held = len(tr.eval_prompts) or len(tr.eval_sets["heldout"].source.items)
        print("\n  pass rate on %d held-out prompts (%s)" % (n_held, cfg.algo.name))
        print("  %-26s %8s %8s" % ("", "before", "after"))
        labels = {"greedy": "greedy (T=0)", "sampled": f"sampled (T={cfg.eval.temperature:g}, avg@{cfg.eval.k})"}
        for k in ("greedy", "sampled"):
            print("  %-26s %7.1f%% %7.1f%%" % (labels[k], 100 * before[k], 100 * after[k]))
        print(f"  wall time {total:.0f} s (warm-up {secs['warmup']:.0f} s, coverage {secs['coverage']:.0f} s, "
              f"value pretraining {secs['value_pretrain']:.0f} s, RL {secs['rl']:.0f} s; stages "
              + ", ".join(f"{s} {v['status']}" for s, v in st.items()) + f"); curves: {', '.join(pngs)}")
        with open(os.path.join(out, "demo_result.json"), "w") as f:
            json.dump(res, f, indent=1)
    return res

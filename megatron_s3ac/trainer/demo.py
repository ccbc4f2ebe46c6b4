"""The CPU demo, end to end in one torchrun job (so megatron starts once):
supervised warm-up of a tiny Qwen3-MoE on "a+b=" until the greedy pass rate enters the 10-60% band
-> coverage data from several warm-up checkpoints -> value pretraining -> S3AC (or GRPO-X) ->
before/after pass-rate table and curve PNGs."""
from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from megatron_s3ac.trainer.batch import collate, per_token
from megatron_s3ac.trainer.data import EOS
from megatron_s3ac.trainer.minibatch import run_minibatches


def supervised_warmup(tr, log) -> list[list[dict]]:
    """Cross-entropy on answer tokens through the actor's megatron optimizer; returns coverage
    trajectories from the last ``coverage_checkpoints`` evaluation points."""
    from megatron_s3ac.models.logprobs import vocab_parallel_log_probs
    from megatron_s3ac.rollout.base import SamplingParams

    d = tr.cfg.demo
    for grp in tr.actor_opt.param_groups:
        grp["lr"] = d.warmup_lr
    g = torch.Generator().manual_seed(tr.cfg.train.seed + 5)
    cov_prompts = [tr.prompts[i] for i in torch.randperm(len(tr.prompts), generator=g)[:d.coverage_prompts].tolist()]
    snapshots, t0 = [], time.time()

    def loss_fn(mb, out):
        targets = torch.roll(mb.input_ids, -1, dims=1)
        lp = per_token(vocab_parallel_log_probs(out, targets, tr.info.vocab_size), mb)
        return -(lp * mb.mask).sum(), mb.mask.sum().long(), {"nll": -(lp * mb.mask).sum().detach()}

    for step in range(1, d.warmup_max_steps + 1):
        pids = torch.randint(0, len(tr.prompts), (d.warmup_batch,), generator=g)
        samples = [{"prompt_ids": tr.prompts[i].ids, "response_ids": tr.vocab.encode(tr.prompts[i].reference) + [EOS],
                    "logprobs": [0.0] * (len(tr.prompts[i].reference) + 1), "reward": 1.0, "pid": i}
                   for i in pids.tolist()]
        batch = collate(samples, tr.pad_to)
        for _ in run_minibatches(tr.actor_ddp, tr.actor_opt, batch, [(0, torch.arange(len(samples)))], loss_fn,
                                 tr.micro_batches):
            pass
        if step % d.warmup_eval_every == 0:
            tr.sync_weights()
            payload = [None]
            if tr.rank == 0:
                acc = tr.evaluate()
                outs = tr.engine.generate([p.ids for p in cov_prompts],
                                          SamplingParams(temperature=1.0, max_new_tokens=tr.cfg.rollout.max_new_tokens,
                                                         seed=step), n_samples=d.coverage_k)
                flat = [(p, s) for p, grp in zip(cov_prompts, outs) for s in grp]
                rewards = tr._score([tr.decode(s.response_ids) for _, s in flat], [p.reference for p, _ in flat])
                recs = [{"prompt_ids": p.ids, "response_ids": s.response_ids or [0], "reward": float(rew),
                         "source": f"warmup_step_{step}"} for (p, s), rew in zip(flat, rewards)]
                payload = [(acc, recs)]
            dist.broadcast_object_list(payload, src=0)
            acc, recs = payload[0]
            snapshots.append(recs)
            log({"step": step, "warmup/greedy_pass_rate": acc, "warmup/time": time.time() - t0,
                 "warmup/sampled_pass_rate": sum(r["reward"] > 0 for r in recs) / len(recs)})
            if acc >= d.target_pass_rate:
                break
    # RL starts from fresh Adam moments at the RL learning rate: the warm-up's momentum points along
    # the supervised gradient and its second moments were sized for lr warmup_lr
    tr.reset_optimizer(tr.actor_opt, tr.cfg.algo.actor_lr)
    return snapshots[-d.coverage_checkpoints:]


def export_eval_inputs(tr, out: str, tag: str) -> None:
    """Rank 0: the engine's current model as an HF directory (``OUT/hf_<tag>``, with the character
    vocabulary as its tokenizer) and the held-out set as a benchmark file (``OUT/heldout.jsonl``,
    pre-tokenized rows that name their reward), so the table's pass rates can be
    re-derived by standalone evaluation (``megatron_s3ac.eval.runner.evaluate`` on a fresh engine)."""
    if tr.rank != 0:
        return
    path = os.path.join(out, f"hf_{tag}")
    if hasattr(tr.engine, "call"):  # separate placement: the model lives in the engine's process
        tr.engine.call("model.save_pretrained", path)
    else:
        tr.engine.model.save_pretrained(path)
    if hasattr(tr.vocab, "chars"):  # the character vocabulary as HF tokenizer files: any HF tool decodes it
        from megatron_s3ac.trainer.char_tokenizer import save_char_tokenizer

        save_char_tokenizer(tr.vocab, path)
    # the reward travels with the set: s3ac-eval scores it as the trainer did, never by a guess
    reward = tr.cfg.eval.reward or tr.cfg.rollout.reward
    path = os.path.join(out, "heldout.jsonl")
    with open(path + ".tmp", "w") as f:
        for p in tr.eval_prompts:
            f.write(json.dumps({"prompt": p.text, "answer": p.reference, "prompt_ids": list(p.ids),
                                "reward": reward}) + "\n")
    os.replace(path + ".tmp", path)


def run_demo(cfg) -> dict:
    from megatron_s3ac.trainer.run import train_loop
    from megatron_s3ac.trainer.loop import Trainer
    from megatron_s3ac.trainer.value_pretrain import value_pretrain

    t_start = time.time()
    tr = Trainer(cfg)
    out = cfg.train.out_dir
    os.makedirs(out, exist_ok=True)
    wlog = open(os.path.join(out, "warmup.jsonl"), "w") if tr.rank == 0 else None

    def log(m):
        if wlog is not None:
            wlog.write(json.dumps(m) + "\n")
            wlog.flush()
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}, flush=True)

    snaps = supervised_warmup(tr, log)
    if tr.uses_critic:  # both runs share the warm-up actor; the critic starts from it
        tr.init_critic_from_actor()
    tr.sync_weights()
    before = {"greedy": tr.evaluate(), "sampled": tr.evaluate(greedy=False)}
    export_eval_inputs(tr, out, "warmup")
    t_warm = time.time() - t_start
    vpt = {}
    if tr.uses_critic and cfg.value_pretrain.enabled:
        rows = [r for s in snaps for r in s]
        if tr.rank == 0:
            from megatron_s3ac.trainer.data import write_coverage

            path = os.path.join(out, "coverage.jsonl")
            if os.path.exists(path):
                os.remove(path)
            write_coverage(path, rows)
        vlog = open(os.path.join(out, "value_pretrain.jsonl"), "w") if tr.rank == 0 else None
        vpt = value_pretrain(tr, rows, log=(lambda m: vlog.write(json.dumps(m) + "\n")) if vlog else None)
        if vlog:
            vlog.close()
        log(vpt)
    t_vpt = time.time() - t_start
    train_loop(tr)
    after = {"greedy": tr.evaluate(), "sampled": tr.evaluate(greedy=False)}
    export_eval_inputs(tr, out, "final")
    tr.close()
    total = time.time() - t_start
    e = cfg.eval
    res = {"before": before, "after": after, "wall_s": total, "warmup_s": t_warm, "value_pretrain_s": t_vpt - t_warm,
           "rl_s": total - t_vpt, "algo": cfg.algo.name, "rl_steps": cfg.train.steps,
           "eval": {"set": os.path.abspath(os.path.join(out, "heldout.jsonl")),
                    "models": {"before": os.path.abspath(os.path.join(out, "hf_warmup")),
                               "after": os.path.abspath(os.path.join(out, "hf_final"))},
                    "seed": e.seed, "batch_size": e.batch_size, "sampled_temperature": e.temperature, "sampled_k": e.k,
                    "max_new_tokens": e.max_new_tokens or cfg.rollout.max_new_tokens}, **vpt}
    if tr.rank == 0:
        from megatron_s3ac.trainer.plotting import plot_run

        pngs = plot_run(out)
        print("\n  pass rate on %d held-out prompts (%s)" % (len(tr.eval_prompts), cfg.algo.name))
        print("  %-26s %8s %8s" % ("", "before", "after"))
        labels = {"greedy": "greedy (T=0)", "sampled": f"sampled (T={cfg.eval.temperature:g}, avg@{cfg.eval.k})"}
        for k in ("greedy", "sampled"):
            print("  %-26s %7.1f%% %7.1f%%" % (labels[k], 100 * before[k], 100 * after[k]))
        print(f"  wall time {total:.0f} s (warm-up {t_warm:.0f} s, value pretraining {t_vpt - t_warm:.0f} s, "
              f"RL {total - t_vpt:.0f} s); curves: {', '.join(pngs)}")
        with open(os.path.join(out, "demo_result.json"), "w") as f:
            json.dump(res, f, indent=1)
        wlog.close()
    return res

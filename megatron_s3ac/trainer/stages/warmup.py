"""The CPU demo's supervised warm-up (the pipeline's ``warmup`` stage, trainer.stages.pipeline): a from-scratch
tiny model is trained by cross-entropy on reference answers until its greedy held-out pass rate enters
the 10-60% band RL needs; its evaluation points are saved as HF dirs (the coverage policies). With
``demo.coverage_overshoot_evals = n`` it trains on for n more evaluation intervals past the target, saving
each as a stronger coverage policy, then restores the target's weights (the RL start policy)."""
from __future__ import annotations

import os
import shutil
import time

import torch

from megatron_s3ac.trainer.step.batch import collate, cp_count, next_token_targets, per_token
from megatron_s3ac.data.prompts import EOS
from megatron_s3ac.trainer.step.minibatch import run_minibatches


def supervised_warmup(tr, log, snapshot=None) -> dict:
    """Cross-entropy on answer tokens through the actor's megatron optimizer until the greedy held-out
    pass rate reaches ``demo.target_pass_rate`` (or ``demo.warmup_max_steps``). At every evaluation
    point (``demo.warmup_eval_every``) rank 0 calls ``snapshot(step)`` with the engine holding that
    step's weights (the pipeline saves it as a coverage policy). Returns {"steps", "greedy_pass_rate"}
    (the stopping evaluation), the same on every rank.

    ``demo.coverage_overshoot_evals`` = n > 0 (only once the target is reached): n more evaluation
    intervals of the same training, each snapshotted (``"overshoot": [{"step", "greedy_pass_rate"}]``
    in the result), then the actor is set back to the stopping step's weights. Why: on a task whose
    warm-up is a phase change (the digit chains), the last snapshots before the target pass ~0-5% of
    sampled answers, so coverage data from them is almost only failures and value pretraining learns
    a constant; the paper's coverage pools policies of different strengths, stronger ones included
    (§3.3, §4.3: the policy of step 1,600 beside the initial one)."""
    from megatron_s3ac.models.logprobs import vocab_parallel_log_probs

    d = tr.cfg.demo
    for grp in tr.actor_opt.param_groups:
        grp["lr"] = d.warmup_lr
    g = torch.Generator().manual_seed(tr.cfg.train.seed + 5)
    # the coverage prompt draw used to come first from this generator: kept so the warm-up's batches
    # (and so its result) are the same as before coverage became its own stage
    torch.randperm(len(tr.prompts), generator=g)
    t0, acc, step = time.time(), None, 0

    def loss_fn(mb, out):
        lp = per_token(vocab_parallel_log_probs(out, next_token_targets(mb), tr.info.vocab_size), mb)
        return -(lp * mb.mask).sum(), cp_count(mb.mask.sum().long()), {"nll": -(lp * mb.mask).sum().detach()}

    saved, overshoot, stop = None, [], None  # the stopping step's weights while overshooting
    for step in range(1, d.warmup_max_steps + 1 + d.coverage_overshoot_evals * d.warmup_eval_every):
        if stop is None and step > d.warmup_max_steps:
            break
        pids = torch.randint(0, len(tr.prompts), (d.warmup_batch,), generator=g)
        samples = [warmup_sample(tr, i) for i in pids.tolist()]
        batch = collate(samples, tr.pad_to).to(tr.device)  # on the models' device
        nll = []
        for r in run_minibatches(tr.actor_ddp, tr.actor_opt, batch, [(0, torch.arange(len(samples)))], loss_fn,
                                 tr.micro_batches):
            nll += [float(o["nll"]) for o in r.outputs]
        if step % d.warmup_eval_every == 0:
            tr.sync_weights()
            acc = None
            if tr.rank == 0:
                acc = tr.evaluate()
                if snapshot is not None:
                    snapshot(step)
            acc = tr.rank0.share("warm-up evaluation", acc)  # the other ranks wait on gloo (trainer.step.rank0)
            log({"step": step, "warmup/greedy_pass_rate": acc, "warmup/time": time.time() - t0,
                 "warmup/nll_rank0": sum(nll), **({"warmup/overshoot": True} if stop is not None else {})})
            if stop is not None:
                overshoot.append({"step": step, "greedy_pass_rate": acc})
                if len(overshoot) >= d.coverage_overshoot_evals:
                    break
            elif acc >= d.target_pass_rate:
                stop = (step, acc)
                if d.coverage_overshoot_evals <= 0:
                    break
                saved = {k: v.detach().clone() for k, v in tr.actor.state_dict().items() if torch.is_tensor(v)}
    if stop is None:  # the step cap before the target: no overshoot (the loop may have gone one step past it)
        stop = (min(step, d.warmup_max_steps), acc)
    if saved is not None:  # back to the RL start policy (and the optimizer's main params with it)
        tr.actor.load_state_dict(saved, strict=False)
        tr.actor_opt.reload_model_params()
        tr.sync_weights()
    # RL starts from fresh Adam moments at the RL learning rate: the warm-up's momentum points along
    # the supervised gradient and its second moments were sized for lr warmup_lr
    tr.reset_optimizer(tr.actor_opt, tr.cfg.algo.actor_lr)
    out = {"steps": stop[0], "greedy_pass_rate": stop[1], "wall_s": time.time() - t0}
    return {**out, "overshoot": overshoot} if d.coverage_overshoot_evals > 0 else out


def warmup_sample(tr, i: int) -> dict:
    """The warm-up's training sample of prompt ``i``: its reference answer + EOS as the response. The character
    vocabulary (text demos) encodes it with its own EOS; an HF tokenizer (a checkpoint's, e.g. the multimodal
    miniature's) with ``add_special_tokens=False`` + its ``eos_token_id`` (what the engine stops on). An image
    prompt's ``Prompt.images`` travels with the sample into the actor's forward (trainer.step.batch.collate)."""
    p = tr.prompts[i]
    if hasattr(tr.vocab, "chars"):  # the text demos' path, unchanged
        return {"prompt_ids": p.ids, "response_ids": tr.vocab.encode(p.reference) + [EOS],
                "logprobs": [0.0] * (len(p.reference) + 1), "reward": 1.0, "pid": i}
    eos = tr.vocab.eos_token_id
    if eos is None:
        raise ValueError("supervised warm-up: the checkpoint's tokenizer has no eos_token_id to end the answers with")
    resp = list(tr.vocab(p.reference, add_special_tokens=False)["input_ids"]) + [int(eos)]
    s = {"prompt_ids": p.ids, "response_ids": resp, "logprobs": [0.0] * len(resp), "reward": 1.0, "pid": i}
    if getattr(p, "images", None) is not None:
        s["images"] = p.images
    return s


def save_engine_hf(tr, path: str) -> None:
    """Rank 0: the engine's current model as an HF directory at ``path`` (with the character vocabulary
    as its tokenizer for the demo's model, so any HF tool and the coverage engines load it)."""
    if hasattr(tr.engine, "call"):  # separate placement: the model lives in the engine's process
        tr.engine.call("model.save_pretrained", path)
    else:
        tr.engine.model.save_pretrained(path)
    if hasattr(tr.vocab, "chars"):  # the character vocabulary as HF tokenizer files: any HF tool decodes it
        from megatron_s3ac.data.char_tokenizer import save_char_tokenizer

        save_char_tokenizer(tr.vocab, path)
    elif hasattr(tr.vocab, "save_pretrained"):
        tr.vocab.save_pretrained(path)
    # a vision-language checkpoint's image processor travels with it (s3ac-eval and the data loader read it there)
    from megatron_s3ac.config import engine_model_dir

    src = engine_model_dir(tr.cfg)
    pre = os.path.join(src, "preprocessor_config.json") if src else None
    if pre and os.path.isfile(pre):
        shutil.copyfile(pre, os.path.join(path, "preprocessor_config.json"))

"""Run a built trainer to ``train.steps``: resume, metrics log, periodic evaluation, checkpoints."""
from __future__ import annotations

import os

from megatron_s3ac import faults


def train_loop(tr) -> None:
    """Resume if a checkpoint exists, run to ``train.steps``; held-out evaluation every ``eval_every``
    steps (rank 0, logged in that step's metrics row); checkpoint every ``save_every`` steps, and also
    at a step whose evaluation is the best so far (kept from the keep-last-K rotation)."""
    from megatron_s3ac.trainer.run.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from megatron_s3ac.trainer.run.logging import MetricsLogger, truncate_after

    cfg = tr.cfg.train
    if tr.cfg.data.prompt_subset:  # before a resume: the stream and DAPS state are the subset's
        sub = tr.use_prompt_subset(tr.cfg.data.prompt_subset)
        if tr.rank == 0:
            print(f"data.prompt_subset: RL on {sub['kept']} of {sub['of']} prompts", flush=True)
    ck = latest_checkpoint(cfg.out_dir) if cfg.resume else None
    if ck is not None:
        load_checkpoint(tr, ck)
        if tr.rank == 0:
            print(f"resumed from {ck} at step {tr.step_idx}", flush=True)
    log = None
    if tr.rank == 0:
        path = os.path.join(cfg.out_dir, "metrics.jsonl")
        truncate_after(path, tr.step_idx) if ck is not None else (os.path.exists(path) and os.remove(path))
        from omegaconf import OmegaConf

        log = MetricsLogger(cfg.out_dir, cfg.steps, cfg.tensorboard, cfg.progress, initial_step=tr.step_idx,
                            wandb_project=cfg.wandb_project,
                            run_config=OmegaConf.to_container(OmegaConf.structured(tr.cfg), enum_to_str=True),
                            desc=tr.cfg.algo.name)
    while tr.step_idx < cfg.steps:
        m = tr.step()
        m.update(tr.periodic_eval())  # rank 0 only; after the step's weight sync
        # saving is collective: every rank must agree (eval runs on rank 0, the others wait: trainer.step.rank0)
        best = tr.rank0.share("periodic evaluation", float(m.get("eval/is_best", 0.0)))
        if log is not None:
            log.log(m)
        if cfg.save_every and (tr.step_idx % cfg.save_every == 0 or best > 0):
            save_checkpoint(tr, cfg.keep_last)
        faults.after_step(tr.step_idx)  # testing seam (no-op unless its env var is set)
    if log is not None:
        log.close()

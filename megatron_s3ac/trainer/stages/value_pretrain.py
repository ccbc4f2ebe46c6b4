"""Value pretraining (paper §3.3): critic regresses the terminal return on coverage trajectories.

Coverage data = trajectories (prompt ids, response ids, reward in {-1, +1}) pooled from policies of
different strengths (``tools/build_coverage_data.py`` or the demo's warm-up checkpoints). The critic
trains ``epochs`` epochs on a token-averaged 1/2 (V - R)^2 (no value clipping), attention and MoE
router frozen, value head init std 1/(H+1) (the builder's), grad clip 10. Logged per optimizer step:
value loss, explained variance, whether the gradient was clipped, head-vs-backbone grad-norm split.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_s3ac import algorithms as A
from megatron_s3ac.trainer.step.batch import collate, cp_count, per_token
from megatron_s3ac.trainer.step.device import trainer_device
from megatron_s3ac.trainer.step.minibatch import run_minibatches, shuffled_minibatches
from megatron_s3ac.trainer.step.privileged import critic_view


def value_pretrain(tr, rows: list[dict], log=None) -> dict:
    """Pretrain a frozen-attention copy of ``tr``'s critic on ``rows``; copy the result into
    ``tr.critic``. Returns summary metrics. Collective (all ranks, same rows), at the critic's layout
    (any TP/PP/EP; metrics are reduced over all ranks, so rank 0 logs global figures)."""
    with tr.model_scope("critic"):
        return _value_pretrain(tr, rows, log)


def attach_row_images(prompts, rows: list[dict]) -> list[dict]:
    """Coverage rows of image prompts (trainer.stages.coverage: ``prompt_index`` = the prompt's index in the trainer's
    prompt set) -> the same rows with ``images`` = that prompt's ``ImageInputs`` (what the critic's vision path
    takes, as in RL). A row whose index is out of range, whose prompt has no images, or whose ``prompt_ids`` are
    not that prompt's ids (coverage data of another prompt set) raises ValueError naming the row. Text rows pass
    unchanged."""
    out = []
    for i, r in enumerate(rows):
        j = r.get("prompt_index")
        if j is None:
            out.append(r)
            continue
        if not (isinstance(j, int) and 0 <= j < len(prompts)):
            raise ValueError(f"coverage row {i}: prompt_index {j!r} is not an index of the {len(prompts)} prompts")
        p = prompts[j]
        if getattr(p, "images", None) is None or list(p.ids) != list(r["prompt_ids"]):
            raise ValueError(f"coverage row {i}: prompt {j} of the trainer's data is not the row's image prompt "
                             f"(coverage data written from another prompt set?)")
        out.append(dict(r, images=p.images))
    return out


def _mp_grad_sq(model) -> tuple[float, float]:
    """(head, backbone) squared grad norms summed over the model-parallel group, TP duplicates once."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    split = A.grad_norm_split(((n, p) for n, p in model.named_parameters()
                               if param_is_not_tensor_parallel_duplicate(p)), is_head=r"output_layer")
    t = torch.tensor([split["head"] ** 2, split["backbone"] ** 2], dtype=torch.float64, device=trainer_device())
    if ps.get_model_parallel_group().size() > 1:
        dist.all_reduce(t, group=ps.get_model_parallel_group())
    return float(t[0]), float(t[1])


def _value_pretrain(tr, rows: list[dict], log=None) -> dict:
    from megatron_s3ac.models.actor_critic import ValueHeadConfig, build_critic, freeze_attention_and_router
    from megatron_s3ac.models.optim import build_optimizer, wrap_ddp

    vc = tr.cfg.value_pretrain
    # on the trainer's device like build.build_critic's: megatron allocates its own layers there, but this project's
    # modules (norms, the value head) start on the host, and DDP moves only trainable params (the frozen ones stay)
    critic = build_critic(tr.info, tr.critic_config, ValueHeadConfig(kind=tr.cfg.model.critic_head))
    critic = critic.to(trainer_device())
    critic.load_state_dict(tr.critic.state_dict())
    from megatron_s3ac.models.vision import attach_vision, vision_meta, vision_of

    tower = vision_of(tr.critic, spare=True)
    if tower is not None:  # image rows: the trainer critic's (frozen) vision tower
        attach_vision(critic.module, tower, False, vision_meta(tr.critic)[0])
    frozen = freeze_attention_and_router(critic) if vc.freezes(tr.privileged is not None) else []
    ddp = wrap_ddp(critic, tr.critic_config)
    opt = build_optimizer([ddp], lr=vc.lr, clip_grad=vc.clip_grad)
    samples = [dict(r, logprobs=[0.0] * len(r["response_ids"]), pid=0) for r in attach_row_images(tr.prompts, rows)]
    batch = collate(samples, tr.pad_to).to(tr.device)  # on the models' device (trainer.step.device)
    # lambda = 1, gamma = 1: the return of every valid token is the terminal reward R; a row may instead carry
    # per-token "returns" (one per response token): a controlled target (tools/critic_reference_fit.py, issue 29)
    batch.returns = batch.scores[:, None] * batch.mask
    for i, r in enumerate(rows):
        if r.get("returns") is not None:
            if len(r["returns"]) != len(r["response_ids"]):
                raise ValueError(f"value pretraining row {i}: {len(r['returns'])} returns for "
                                 f"{len(r['response_ids'])} response tokens")
            batch.returns[i, :len(r["returns"])] = torch.as_tensor(r["returns"], dtype=batch.returns.dtype)
    extra = {}
    if tr.privileged is not None:  # the critic reads each row's reference as online
        got = [tr.privileged.ids(r.get("reference"), r.get("solution")) for r in rows]
        batch = critic_view(batch, [ids for ids, _ in got], tr.pad_to)
        extra["vpt/privileged_missing"] = sum(miss for _, miss in got)
    g = torch.Generator().manual_seed(tr.cfg.train.seed + 17)
    hist = []
    # grad norm split before the optimizer clips (main_grad holds the reduced gradient)
    for step, r in enumerate(run_minibatches(ddp, opt, batch, shuffled_minibatches(len(samples), vc.epochs, g,
                                                                                   size=vc.batch_size),
                                             _loss, tr.micro_batches, before_step=lambda out: _mp_grad_sq(critic))):
        m = {"step": step, "epoch": r.epoch, **_step_metrics(r.outputs, r.grad_norm, *r.before_step, vc.clip_grad)}
        hist.append(m)
        if log is not None and tr.rank == 0:
            log(m)
    tr.critic.load_state_dict(critic.state_dict())
    k = min(20, len(hist))
    return {"vpt/steps": len(hist), "vpt/frozen_params": len(frozen), **extra,
            "vpt/loss_first": sum(h["vpt/value_loss"] for h in hist[:k]) / max(1, k),
            "vpt/loss_last": sum(h["vpt/value_loss"] for h in hist[-k:]) / max(1, k),
            "vpt/clip_frac": sum(h["vpt/clipped"] for h in hist) / max(1, len(hist)),
            "vpt/ev_last": hist[-1]["vpt/explained_variance"] if hist else float("nan")}


def _loss(mb, out):
    """1/2 (V - R)^2 summed over tokens (no clipping), plus the sums of a global explained variance."""
    v = per_token(out, mb)
    m, ret = mb.mask, mb.returns
    loss, _ = A.value_loss(v, v.detach(), ret, m, None, num_global_tokens=1)
    err = (ret - v.detach()) * m
    # sums for a global explained variance 1 - Var(R - V) / Var(R) over all ranks' tokens
    sums = torch.stack([m.sum(), (ret * m).sum(), (ret ** 2 * m).sum(), err.sum(), (err ** 2).sum()])
    return loss, cp_count(m.sum().long()), {"loss_sum": loss.detach(), "sums": sums.double()}


def _step_metrics(outputs: list, gn: float, head_sq: float, back_sq: float, clip_grad: float) -> dict:
    """Loss and explained variance over every rank's tokens of one optimizer step (collective)."""
    from megatron.core import parallel_state as ps

    t = torch.zeros(6, dtype=torch.float64, device=trainer_device())  # loss sum + the 5 sums (last stage only)
    for o in outputs:
        t[0] += float(o["loss_sum"])
        t[1:] += o["sums"]
    if ps.get_tensor_model_parallel_rank() == 0:  # TP ranks hold the same tokens: count them once
        dist.all_reduce(t)
    else:
        dist.all_reduce(torch.zeros_like(t))
    cnt = t[1].clamp(min=1)
    var_r = t[3] / cnt - (t[2] / cnt) ** 2
    var_e = t[5] / cnt - (t[4] / cnt) ** 2
    tot = head_sq + back_sq
    return {"vpt/value_loss": float(t[0] / cnt),
            "vpt/explained_variance": float(1 - var_e / var_r) if var_r > 0 else float("nan"),
            "vpt/grad_norm": float(gn), "vpt/clipped": float(float(gn) > clip_grad),
            "vpt/head_sq_share": head_sq / tot if tot > 0 else 0.0, "vpt/head_grad_norm": head_sq ** 0.5,
            "vpt/backbone_grad_norm": back_sq ** 0.5}

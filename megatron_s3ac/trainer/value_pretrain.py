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
from megatron_s3ac.trainer.batch import collate, micro_batches, shard_rows


def value_pretrain(tr, rows: list[dict], log=None) -> dict:
    """Pretrain a frozen-attention copy of ``tr``'s critic on ``rows``; copy the result into
    ``tr.critic``. Returns summary metrics. Collective (all ranks, same rows)."""
    from megatron_s3ac.models.actor_critic import ValueHeadConfig, build_critic, freeze_attention_and_router
    from megatron_s3ac.models.optim import build_optimizer, wrap_ddp
    from megatron_s3ac.models.pipeline import forward_backward

    vc = tr.cfg.value_pretrain
    critic = build_critic(tr.info, tr.critic_config, ValueHeadConfig(kind=tr.cfg.model.critic_head))
    critic.load_state_dict(tr.critic.state_dict())
    frozen = freeze_attention_and_router(critic) if vc.freeze_attention_and_router else []
    ddp = wrap_ddp(critic, tr.critic_config)
    opt = build_optimizer([ddp], lr=vc.lr, clip_grad=vc.clip_grad)
    samples = [dict(r, logprobs=[0.0] * len(r["response_ids"]), pid=0) for r in rows]
    batch = collate(samples, tr.pad_to)
    batch["returns"] = A.terminal_rewards(batch["scores"], batch["mask"])
    # lambda = 1, gamma = 1: the return of every valid token is the terminal reward R
    batch["returns"] = batch["scores"][:, None] * batch["mask"]
    g = torch.Generator().manual_seed(tr.cfg.train.seed + 17)
    hist = []

    def loss_fn(mb, out):
        v = out.gather(1, mb["idx"])
        loss, _ = A.value_loss(v, v.detach(), mb["returns"], mb["mask"], None, num_global_tokens=1)
        ev_num = ((mb["returns"] - v.detach()) ** 2 * mb["mask"]).sum()
        return loss, mb["mask"].sum().long(), {"loss_sum": loss.detach(), "sq_err": ev_num,
                                               "ntok": mb["mask"].sum(), "values": v.detach(),
                                               "returns": mb["returns"], "mask": mb["mask"]}

    n, step = len(samples), 0
    for epoch in range(vc.epochs):
        perm = torch.randperm(n, generator=g)
        for mb_rows in perm.split(vc.batch_size):
            rows_, real = shard_rows(mb_rows, tr.dp_rank, tr.dp)
            mbs = micro_batches(batch, rows_, real, tr.cfg.algo.micro_batch_size)
            ddp.zero_grad_buffer()
            opt.zero_grad()
            out = forward_backward([ddp], mbs, loss_fn)
            # grad norm split before the optimizer clips (main_grad holds the reduced gradient)
            split = A.grad_norm_split(critic.named_parameters(), is_head=r"output_layer")
            ok, gn, _ = opt.step()
            vals = torch.cat([o["values"].reshape(-1) for o in out])
            rets = torch.cat([o["returns"].reshape(-1) for o in out])
            msk = torch.cat([o["mask"].reshape(-1) for o in out])
            t = torch.tensor([sum(float(o["loss_sum"]) for o in out), float(msk.sum())], dtype=torch.float64)
            dist.all_reduce(t)
            m = {"step": step, "epoch": epoch, "vpt/value_loss": float(t[0] / t[1].clamp(min=1)),
                 "vpt/explained_variance": float(A.explained_variance(vals[None], rets[None], msk[None])),
                 "vpt/grad_norm": float(gn), "vpt/clipped": float(float(gn) > vc.clip_grad),
                 "vpt/head_sq_share": split["head_sq_share"], "vpt/head_grad_norm": split["head"],
                 "vpt/backbone_grad_norm": split["backbone"]}
            hist.append(m)
            if log is not None and tr.rank == 0:
                log(m)
            step += 1
    tr.critic.load_state_dict(critic.state_dict())
    k = min(20, len(hist))
    return {"vpt/steps": len(hist), "vpt/frozen_params": len(frozen),
            "vpt/loss_first": sum(h["vpt/value_loss"] for h in hist[:k]) / max(1, k),
            "vpt/loss_last": sum(h["vpt/value_loss"] for h in hist[-k:]) / max(1, k),
            "vpt/clip_frac": sum(h["vpt/clipped"] for h in hist) / max(1, len(hist)),
            "vpt/ev_last": hist[-1]["vpt/explained_variance"] if hist else float("nan")}

"""Shared pieces of the multi-rank R3 tests: a tiny Qwen3-MoE with one dense layer, rollout samples
with routes in SGLang's layout, micro-batches (padded or packed), and per-rank run helpers.

Module-level functions only: ``run_distributed`` imports them by name in each rank.
"""
from __future__ import annotations

import os
from functools import partial

import numpy as np
import torch

from megatron_s3ac.models.tiny_models import tiny_config

E, K, L = 4, 2, 4
LENGTHS = [9, 12, 6, 10]  # prompt + response tokens per sample
PROMPT = 3                # first 3 tokens are the prompt; the loss covers the response


def cfg_dict():
    """Tiny Qwen3-MoE, layer 0 dense (mlp_only_layers): dense rows must be skipped, indices global."""
    return tiny_config("qwen3_moe", mlp_only_layers=[0]).to_dict()


def samples(seed=5):
    """[(tokens [T], routes [T-1, L, K] uint8)]: random distinct experts per MoE row, 0 on layer 0."""
    g = np.random.default_rng(seed)
    out = []
    for T in LENGTHS:
        tokens = g.integers(1, 90, T)
        r = np.zeros((T - 1, L, K), np.uint8)
        for t in range(T - 1):
            for layer in range(1, L):
                r[t, layer] = g.permutation(E)[:K]
        out.append((tokens, r))
    return out


def microbatches(kind, smp):
    """Two micro-batches of two samples each. Returns (mbs, placements per mb, sample ids per mb).

    padded: input_ids [2, 12], sample j of the mb in row j from 0, right padding, causal mask.
    packed: input_ids [1, s] with both samples back to back + padding to an even s (the SP split),
            block-diagonal mask, positions restarting per sample; the two mbs differ in length.
    The trainer feeds all T tokens; labels are the next tokens (last one ignored by the mask).
    """
    from megatron_s3ac.r3.align import packed_placements, padded_placements

    mbs, pls, ids_per_mb = [], [], []
    for sids in ([0, 1], [2, 3]):
        toks = [smp[i][0] for i in sids]
        lens = [len(t) for t in toks]
        if kind == "padded":
            b, s = len(toks), 12
            pl = padded_placements(lens)
        else:
            b, s = 1, sum(lens) + sum(lens) % 2
            pl = packed_placements(lens)
        ids = torch.zeros(b, s, dtype=torch.long)
        labels = torch.zeros(b, s, dtype=torch.long)
        mask = torch.zeros(b, s)
        pos = torch.zeros(b, s, dtype=torch.long)
        attn = torch.ones(b, 1, s, s, dtype=torch.bool)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        covered = torch.zeros(b, s, dtype=torch.bool)
        for t, (row, start, n) in zip(toks, pl):
            ids[row, start:start + n] = torch.as_tensor(t)
            labels[row, start:start + n - 1] = torch.as_tensor(t[1:])
            mask[row, start + PROMPT - 1:start + n - 1] = 1  # positions predicting response tokens
            pos[row, start:start + n] = torch.arange(n)
            attn[row, 0, start:start + n, start:start + n] = ~causal[:n, :n]
            covered[row, start:start + n] = True
        for row in range(b):  # padding: its own causal block (no fully-masked rows)
            free = (~covered[row]).nonzero()[:, 0]
            if len(free):
                a, z = int(free[0]), int(free[-1]) + 1
                attn[row, 0, a:z, a:z] = ~causal[:z - a, :z - a]
                pos[row, a:z] = torch.arange(z - a)
        mb = {"input_ids": ids, "labels": labels, "mask": mask, "position_ids": pos}
        if kind == "packed":
            mb["attention_mask"] = attn
        mbs.append(mb)
        pls.append(pl)
        ids_per_mb.append(sids)
    return mbs, pls, ids_per_mb


def build(layout, seed=3, **overrides):
    """Model on this rank at ``layout`` with routing replay enabled; returns (info, config, model, ddp)."""
    import torch.distributed as dist

    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.optim import wrap_ddp
    from megatron_s3ac.models.parallel import initialize_model_parallel
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.r3.config import R3Config

    info = model_info(cfg_dict())
    layout.validate(info, dist.get_world_size())
    initialize_model_parallel(layout, seed=seed)
    torch.manual_seed(11)
    kw = R3Config().transformer_config_overrides(info)
    kw.update(overrides)
    config = build_transformer_config(info, layout, **kw)
    model = build_actor(info, config)
    return info, config, model, wrap_ddp(model, config, distributed_optimizer=False)


def save_or_load(model, ckpt_dir, save):
    from megatron.core import dist_checkpointing

    if save:
        os.makedirs(ckpt_dir, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))


def logprob_loss(info, batch, out):
    """Sum of -log p(label) over response positions; reports the [b, s] log-probs."""
    from megatron_s3ac.models.logprobs import vocab_parallel_log_probs

    lp = vocab_parallel_log_probs(out, batch["labels"], info.vocab_size)
    return -(lp * batch["mask"]).sum(), batch["mask"].sum().long(), {"lp": lp.detach()}


def run(ddp, info, mbs, forward_only):
    """forward_backward over mbs; [b, s] log-probs per micro-batch (last stage) or []."""
    from megatron_s3ac.models.pipeline import forward_backward

    out = forward_backward([ddp], mbs, partial(logprob_loss, info), forward_only=forward_only)
    return [o["lp"] for o in out]


def aligned(ddp, config, info, mbs, pls, ids_per_mb, smp):
    """The rollout routes of each micro-batch, aligned for this rank."""
    from megatron_s3ac.r3.align import align_microbatch, sp_split
    from megatron_s3ac.r3.replay import local_moe_layers

    layers = local_moe_layers([ddp])
    rank, size = sp_split(config)
    return [align_microbatch([smp[i][1] for i in sids], pl, tuple(mb["input_ids"].shape), layers,
                             info.num_experts, sp_rank=rank, sp_size=size)
            for mb, pl, sids in zip(mbs, pls, ids_per_mb)]


def main_grads(model):
    """fp32 main_grad copy of every parameter, by name."""
    return {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}


def one_hot(mb_routes, layer, num_experts):
    """A micro-batch's replayed routes at ``layer`` as a [tokens, E] bool routing map."""
    idx = mb_routes.layer(layer)
    return torch.zeros(idx.shape[0], num_experts, dtype=torch.bool).scatter_(1, idx, True)


def train_step_recording(ddp, config, info, model, smp, replay):
    """forward+backward over the padded micro-batches of smp (under routing replay of the rollout's
    routes when ``replay``), hooking every router. Returns (main_grads, UsedExperts, routes, mbs)."""
    from megatron_s3ac.r3.replay import routing_replay

    mbs, pls, sids = microbatches("padded", smp)
    routes = aligned(ddp, config, info, mbs, pls, sids, smp)
    used = UsedExperts(model)
    ddp.zero_grad_buffer()
    if replay:
        with routing_replay([ddp], routes):
            run(ddp, info, mbs, forward_only=False)
    else:
        run(ddp, info, mbs, forward_only=False)
    used.remove()
    return main_grads(model), used, routes, mbs


class UsedExperts:
    """Forward hooks on every TopKRouter of a model: the routing_map each forward actually produced
    (what the token dispatcher sends tokens by), per global layer, one [tokens, E] bool per call."""

    def __init__(self, model):
        from megatron_s3ac.r3.replay import chunk_routers

        self.maps: dict[int, list[torch.Tensor]] = {}
        self.handles = [router.register_forward_hook(self._hook(layer)) for layer, router in chunk_routers(model)]

    def _hook(self, layer):
        def hook(module, args, output):
            self.maps.setdefault(layer, []).append(output[1].detach().clone())
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def check_used_equals_rollout(used, config, mbs, pls, ids_per_mb, smp) -> int:
    """Every (token, MoE layer) of every sample: the experts the router used == the rollout's.

    Independent of align: router rows are gathered over the SP group (contiguous chunks of the
    sequence), viewed as [s, b, E] and read at (position start + t, row). Returns pairs checked.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    checked = 0
    for layer, maps in used.maps.items():
        assert len(maps) == len(mbs), f"layer {layer}: {len(maps)} router calls for {len(mbs)} micro-batches"
        for m, mb, pl, sids in zip(maps, mbs, pls, ids_per_mb):
            if config.sequence_parallel:
                parts = [torch.empty_like(m, dtype=torch.uint8) for _ in range(ps.get_tensor_model_parallel_world_size())]
                dist.all_gather(parts, m.to(torch.uint8), group=ps.get_tensor_model_parallel_group())
                m = torch.cat(parts).bool()
            b, s = mb["input_ids"].shape
            m = m.view(s, b, -1)
            for (row, start, n), i in zip(pl, sids):
                routes = torch.as_tensor(smp[i][1][:, layer].astype(np.int64))  # [T-1, K]
                want = torch.zeros(n - 1, m.shape[-1], dtype=torch.bool).scatter_(1, routes, True)
                got = m[start:start + n - 1, row]
                bad = (got != want).any(-1)
                assert not bad.any(), (f"layer {layer}, sample {i}: {int(bad.sum())}/{n - 1} tokens routed "
                                       f"differently from the rollout")
                checked += n - 1
    return checked

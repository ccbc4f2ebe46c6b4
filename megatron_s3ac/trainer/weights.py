"""Weight sync trainer -> rollout engine: iterate (hf_name, full tensor) from the live sharded actor.

Uses ``megatron_s3ac.convert.export_hf_weights`` when that module provides it (the project's
converter, any layout). Until it lands, ``_fallback_export`` covers what the CPU demo and tests need:
Qwen2/Qwen3/Qwen3-MoE on the local (TE-free) spec, any TP/EP/ETP, PP = 1. Collective: every rank of
the model-parallel group must iterate it; every rank gets the same full tensors.
"""
from __future__ import annotations

import re
from typing import Iterator

import torch
import torch.distributed as dist


def export_hf_weights(model, info, bucket_bytes: int = 256 << 20) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        from megatron_s3ac.convert import export_hf_weights as _export  # type: ignore[attr-defined]
    except ImportError:
        _export = None
    if _export is not None:
        for item in _export([model], info, bucket_bytes):
            # the converter yields buckets (lists of pairs) or pairs; accept both
            if isinstance(item, (list, tuple)) and item and isinstance(item[0], (list, tuple)):
                yield from item
            else:
                yield item
        return
    yield from _fallback_export(model, info)


def _gather(t: torch.Tensor, dim: int, group) -> list[torch.Tensor]:
    n = dist.get_world_size(group) if group is not None else 1
    if n == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _fused_cat(parts: list[torch.Tensor], n_fused: int) -> torch.Tensor:
    """Shards of a fused [a; b] row-parallel weight -> [cat(a shards); cat(b shards)]."""
    split = [p.chunk(n_fused, dim=0) for p in parts]
    return torch.cat([torch.cat([s[i] for s in split], 0) for i in range(n_fused)], 0)


@torch.no_grad()
def _fallback_export(model, info) -> Iterator[tuple[str, torch.Tensor]]:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("weight export with pp > 1 needs megatron_s3ac.convert.export_hf_weights")
    tp_g = ps.get_tensor_model_parallel_group()
    etp_g = ps.get_expert_tensor_parallel_group()
    ep_g = ps.get_expert_model_parallel_group()
    ep_rank = ps.get_expert_model_parallel_rank()
    m = getattr(model, "module", model)
    hd, nq, nkv = info.head_dim, info.num_heads, info.num_kv_heads
    expert_re = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")
    for name, p in m.named_parameters():
        t = p.detach().float()
        is_expert = getattr(p, "allreduce", True) is False
        g = etp_g if is_expert else tp_g
        if getattr(p, "tensor_model_parallel", False):
            parts = _gather(t, p.partition_dim, g)
            if "linear_fc1" in name and info.hf.get("hidden_act", "silu") == "silu":
                t = _fused_cat(parts, 2)  # gate/up are fused and sharded separately
            else:
                t = torch.cat(parts, p.partition_dim)
        mo = expert_re.fullmatch(name)
        if mo:
            layer, local, kind = int(mo[1]), int(mo[2]), mo[3]
            n_local = info.num_experts // max(1, dist.get_world_size(ep_g))
            for r, te in enumerate(_gather(t, 0, ep_g)):
                e = r * n_local + local
                pre = f"model.layers.{layer}.mlp.experts.{e}"
                if kind == "linear_fc1":
                    gate, up = te.chunk(2, 0)
                    yield f"{pre}.gate_proj.weight", gate
                    yield f"{pre}.up_proj.weight", up
                else:
                    yield f"{pre}.down_proj.weight", te
            continue
        yield from _map_dense(name, t, info, hd, nq, nkv)


def _map_dense(name: str, t: torch.Tensor, info, hd: int, nq: int, nkv: int):
    if name == "embedding.word_embeddings.weight":
        yield "model.embed_tokens.weight", t[: info.vocab_size]
        return
    if name == "output_layer.weight":
        if not info.tie_embeddings:
            yield "lm_head.weight", t[: info.vocab_size]
        return
    if name == "decoder.final_layernorm.weight":
        yield "model.norm.weight", t
        return
    mo = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if not mo:
        raise KeyError(f"no HF name for megatron parameter {name}")
    pre, rest = f"model.layers.{mo[1]}", mo[2]
    simple = {
        "input_layernorm.weight": "input_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.router.weight": "mlp.gate.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }
    if rest in simple:
        yield f"{pre}.{simple[rest]}", t
    elif rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]  # weight | bias
        per = nq // nkv
        x = t.view(nkv, (per + 2) * hd, -1) if kind == "weight" else t.view(nkv, (per + 2) * hd)
        q, k, v = x.split([per * hd, hd, hd], dim=1)
        for hf, y in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            yield f"{pre}.self_attn.{hf}.{kind}", y.reshape(-1, t.shape[-1]) if kind == "weight" else y.reshape(-1)
    elif rest == "mlp.linear_fc1.weight":
        gate, up = t.chunk(2, 0)
        yield f"{pre}.mlp.gate_proj.weight", gate
        yield f"{pre}.mlp.up_proj.weight", up
    else:
        raise KeyError(f"no HF name for megatron parameter {name}")

"""Layer specs: Transformer Engine when TE and CUDA are present, else a project-owned torch spec.

The torch spec differs from megatron-core's ``get_gpt_layer_local_spec`` in two modules only:
  * ``SPNorm``: a torch RMSNorm/LayerNorm that accepts sequence parallelism (megatron's
    ``WrappedTorchNorm`` asserts it off, yet MoE + TP requires SP) and tags its parameters with
    ``sequence_parallel`` so megatron's grad finalisation all-reduces them across TP ranks;
  * ``SDPAttention``: core attention through ``torch.nn.functional.scaled_dot_product_attention``
    instead of the unfused baddbmm/softmax path (less memory, fused kernels where torch has them).
Behaviour is chosen by spec, never by flags inside forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_s3ac.models.cpu_compat import cuda_available


class SPNorm(torch.nn.Module):
    """RMSNorm/LayerNorm over the last dim, sequence-parallel aware. x: [s, b, h] -> same."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"SPNorm supports RMSNorm and LayerNorm, not {config.normalization!r}")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # Every norm's grad is a partial sum over TP ranks (SP: different tokens; qk-norm: different
        # heads), so mark them all; finalize_model_grads all-reduces marked params when SP is on.
        for p in self.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()  # statistics in fp32, like the HF reference
        if self.rms:
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * y.to(dtype)
        y = F.layer_norm(xf, (xf.shape[-1],), None, None, self.eps).to(dtype)
        return y * self.weight + self.bias


class SDPAttention(DotProductAttention):
    """Core attention via torch SDPA. q: [sq, b, np, hn], k/v: [sk, b, ng, hn] -> [sq, b, np*hn].

    ``attention_mask`` follows megatron's convention (bool, True = masked out, [b, 1, sq, sk]);
    None means causal. Block-diagonal masks express packed sequences.

    Context parallel (cp > 1): q / k / v hold this CP rank's tokens and K / V are all-gathered over the
    CP group (``context_parallel.cp_core_attention``) or passed round a ring (``cp_ring_attention``,
    ``ParallelLayout.cp_comm='ring'``); the mask, if any, covers the whole sequence.
    megatron's ``DotProductAttention`` asserts cp == 1 (TE-only CP), so its constructor sees a copy
    of the config with cp = 1; nothing else it builds depends on cp.
    """

    def __init__(self, config, *args, **kwargs):
        import copy

        from megatron.core import parallel_state

        cp = config.context_parallel_size
        base = copy.copy(config)
        base.context_parallel_size = 1
        super().__init__(base, *args, **kwargs)
        self.config = config
        self.cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None
        self.cp_comm = getattr(config, "s3ac_cp_comm", "allgather")  # set by build_transformer_config

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise NotImplementedError("SDPAttention takes packed sequences as a block-diagonal attention_mask")
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention has no attention_bias")
        dropout = self.attention_dropout.p if self.training else 0.0
        if self.cp_group is not None:
            from megatron_s3ac.models.context_parallel import CP_ATTENTION

            return CP_ATTENTION[self.cp_comm](query, key, value, attention_mask, self.softmax_scale, dropout,
                                              self.cp_group)
        sq, b, np_, hn = query.shape
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        if k.shape[1] != np_:  # GQA: expand kv groups to query heads
            rep = np_ // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=~attention_mask, dropout_p=dropout, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


class TorchSpecProvider(LocalSpecProvider):
    """megatron-core's local backend with the two modules above swapped in."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return SPNorm

    def core_attention(self) -> type:
        return SDPAttention


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return cuda_available()


def _swap_local_modules(spec: ModuleSpec) -> ModuleSpec:
    """Replace megatron's local norm and core attention in a local-backend layer spec."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    sub = spec.submodules
    if sub.input_layernorm is WrappedTorchNorm:
        sub.input_layernorm = SPNorm
    if sub.pre_mlp_layernorm is WrappedTorchNorm:
        sub.pre_mlp_layernorm = SPNorm
    attn = sub.self_attention.submodules
    attn.core_attention = SDPAttention
    if attn.q_layernorm is WrappedTorchNorm:
        attn.q_layernorm = SPNorm
    if attn.k_layernorm is WrappedTorchNorm:
        attn.k_layernorm = SPNorm
    return spec


def gpt_layer_spec(num_experts: int | None, qk_layernorm: bool, use_te: bool | None = None) -> ModuleSpec:
    """Per-layer spec for a Qwen-style decoder layer (RMSNorm, SwiGLU or MoE, optional qk-norm)."""
    if use_te is None:
        use_te = have_transformer_engine()
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=num_experts is not None, qk_layernorm=qk_layernorm)
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=qk_layernorm, normalization="RMSNorm")
    return _swap_local_modules(spec)


def final_norm_class(use_te: bool | None = None) -> type:
    if use_te is None:
        use_te = have_transformer_engine()
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return SPNorm


def moe_layer_pattern(config) -> list[int]:
    """1 for an MoE layer, 0 for dense, over all ``config.num_layers`` (global layer order)."""
    if not config.num_moe_experts:
        return [0] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return list(freq)


def decoder_block_spec(config, qk_layernorm: bool, use_te: bool | None = None, pp_rank: int | None = None):
    """TransformerBlockSubmodules holding only this pipeline stage's layers (dense or MoE per layer)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules, get_num_layers_to_build)
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    dense = gpt_layer_spec(None, qk_layernorm, use_te)
    moe = gpt_layer_spec(config.num_moe_experts, qk_layernorm, use_te) if config.num_moe_experts else None
    specs = [moe if m else dense for m in moe_layer_pattern(config)]
    n = get_num_layers_to_build(config, pp_rank=pp_rank)
    off = get_transformer_layer_offset(config, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=specs[off:off + n], layer_norm=final_norm_class(use_te))

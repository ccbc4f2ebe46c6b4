"""Qwen3.5-MoE modules and layer specs for megatron-core 0.19.2 (see ``qwen3_5.py`` for the architecture).

Torch spec (CPU, and GPUs without Transformer Engine): megatron's ``GatedDeltaNet`` (torch kernels when
flash-linear-attention is absent), megatron's ``SelfAttention`` with the output gate and SDPA core
attention, ``SequentialMLP`` experts + gated ``SharedExpertMLP``, and zero-centred RMSNorms.
Checkpoint keys are those of megatron's TE hybrid spec (fused input norms), so a checkpoint loads with
either spec.
"""
from __future__ import annotations

import torch

from megatron_s3ac.models.registry import UnsupportedModelError
from megatron_s3ac.models.specs import SPNorm


# ---- modules -----------------------------------------------------------------------------------
class ZeroCenteredNorm(SPNorm):
    """SPNorm that honours ``config.layernorm_zero_centered_gamma``: RMSNorm ``x_hat * (1 + w)`` with w
    initialised to 0, computed in fp32 and cast back like HF's ``Qwen3_5MoeRMSNorm``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(config, hidden_size, eps)
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        if self.zero_centered:
            if not self.rms:
                raise ValueError("ZeroCenteredNorm: zero-centred gamma is implemented for RMSNorm only")
            with torch.no_grad():
                self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered:
            return super().forward(x)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def _gdn_class():
    """megatron-core 0.19.2: upstream's forward, context parallelism included; three overrides."""
    import inspect

    import torch.nn.functional as F
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.ssm.gated_delta_net.common import _GDNBase

    from megatron_s3ac.models import cpu_compat

    cpu_compat.patch_missing_fla()

    def eager(name):  # the undecorated function under megatron's ``@jit_fuser`` (torch.compile)
        return inspect.unwrap(getattr(_GDNBase, name))

    class TorchGatedDeltaNet(GatedDeltaNet):
        """megatron-core 0.19.2's GatedDeltaNet (``megatron/core/ssm/gated_delta_net/gdn.py``: its forward, and
        its context parallelism: a head-parallel all-to-all, ``gdn.py:134-164``) with:

        * an attention mask other than causal refused: 0.19.2's forward still ignores ``attention_mask``
          (``gdn.py:64-278``; its packed sequences are THD ``packed_seq_params`` with fla's varlen kernels,
          which the torch kernel refuses, ``common.py:821-823``);
        * the decay ``g = -exp(A_log) * softplus(alpha + dt_bias)`` in fp32 from an fp32 copy of ``A_log``
          (megatron takes ``A_log.exp()`` in the parameter dtype, ``common.py:444``: in bf16 up to 2^-9
          relative off per head; transformers and fla compute it in fp32). In fp32 the same computation;
        * the helpers megatron wraps in ``@jit_fuser`` (torch.compile, ``megatron/core/jit.py``;
          ``common.py:369-445``) run eagerly: on CPU torch.compile needs a compiler toolchain, and it
          changes nothing numerically here. On a GPU this forgoes their fusion (elementwise / reshape work
          beside the kernels; the numerics stay those verified on CPU); not measured.

        The kernels are the module globals ``cpu_compat.patch_missing_fla`` binds (fla's, or the torch ones)."""

        def forward(self, hidden_states, attention_mask, inference_context=None, packed_seq_params=None,
                    sequence_len_offset=None, *, inference_params=None, **kwargs):
            if attention_mask is not None and not _is_causal(attention_mask):
                raise NotImplementedError(
                    "qwen3_5_moe: megatron-core's Gated DeltaNet ignores attention masks, so packed "
                    "sequences (block-diagonal masks) and left padding are not supported; use right "
                    "padding with a causal mask (attention_mask=None)")
            return super().forward(hidden_states, attention_mask, inference_context, packed_seq_params,
                                   sequence_len_offset, inference_params=inference_params, **kwargs)

        def _compute_g_and_beta(self, A_log_local_cp, dt_bias_local_cp, alpha, beta):
            g = -A_log_local_cp.float().exp() * F.softplus(alpha.float() + dt_bias_local_cp)  # fp32 (class doc)
            return g, beta.sigmoid()

        _apply_gated_norm = eager("_apply_gated_norm")
        _prepare_input_for_gated_delta_rule = eager("_prepare_input_for_gated_delta_rule")

    return TorchGatedDeltaNet


_GDN = None


def gated_delta_net_class():
    global _GDN
    if _GDN is None:
        _GDN = _gdn_class()
    return _GDN


def _is_causal(mask: torch.Tensor) -> bool:
    """megatron convention (True = masked): exactly the upper triangle of every [s, s] block."""
    s = mask.shape[-1]
    if mask.shape[-2] != s:
        return False
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).triu(1)
    return bool((mask.bool() == causal).all())


# ---- layer specs --------------------------------------------------------------------------------
def _attention_layer_spec(config):
    """Gated full attention + MoE, torch modules; norms zero-centred; TE-spec checkpoint names."""
    from megatron_s3ac.models.specs import gpt_layer_spec

    spec = gpt_layer_spec(config.num_moe_experts, qk_layernorm=True, use_te=False)
    sub = spec.submodules
    sub.input_layernorm = ZeroCenteredNorm
    sub.pre_mlp_layernorm = ZeroCenteredNorm
    attn = sub.self_attention.submodules
    attn.q_layernorm = ZeroCenteredNorm
    attn.k_layernorm = ZeroCenteredNorm
    # TE fuses the input norm into linear_qkv; the MoE pre-MLP norm stays ``pre_mlp_layernorm``.
    sub.sharded_state_dict_keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    return spec


def _gdn_layer_spec(config, moe_spec):
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    gdn = ModuleSpec(module=gated_delta_net_class(), submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=SPNorm, out_proj=RowParallelLinear))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=ZeroCenteredNorm, self_attention=gdn, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=ZeroCenteredNorm, mlp=moe_spec, mlp_bda=get_bias_dropout_add,
        # TE fuses the input norm into in_proj (TELayerNormColumnParallelLinear)
        sharded_state_dict_keys_map={"input_layernorm.": "self_attention.in_proj.layer_norm_"}))


def _te_block_spec(config, pp_rank):
    """megatron's TE hybrid spec, with the GDN output norm made plain (see module docstring).
    Chosen wherever Transformer Engine and CUDA are (``use_te=None``, models/qwen3_5.py); not exercised on this
    project's CPU machines (no TE): the GPU device checks build it."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec)

    block = get_transformer_block_with_experimental_attention_variant_spec(config, pp_rank=pp_rank)
    for spec in block.layer_specs:
        attn = spec.submodules.self_attention
        if getattr(attn.submodules, "out_norm", None) is not None:
            attn.module = gated_delta_net_class()
            attn.submodules.out_norm = SPNorm
    return block


def qwen3_5_block_spec(config, use_te: bool = False, pp_rank: int | None = None):
    """TransformerBlockSubmodules with this pipeline stage's layers: GDN or gated attention by
    ``config.linear_attention_freq``, MoE on every layer. Torch modules unless ``use_te``."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_s3ac.models.specs import moe_layer_pattern

    if not all(moe_layer_pattern(config)):
        raise UnsupportedModelError("qwen3_5_moe: every layer is an MoE layer")
    if use_te:
        return _te_block_spec(config, pp_rank)
    attn_spec = _attention_layer_spec(config)
    gdn_spec = _gdn_layer_spec(config, attn_spec.submodules.mlp)
    specs = [gdn_spec if la else attn_spec for la in config.linear_attention_freq]
    n = get_num_layers_to_build(config, pp_rank=pp_rank)
    off = get_transformer_layer_offset(config, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=specs[off:off + n], layer_norm=ZeroCenteredNorm)

"""Qwen3.5-MoE modules and layer specs for megatron-core 0.16.1 and 0.19.2 (see ``qwen3_5.py`` for the architecture).

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
    from megatron_s3ac.models import cpu_compat

    return _gdn_class_019() if cpu_compat.is_mcore_019() else _gdn_class_016()


def _gdn_class_019():
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
        its context parallelism, the head-parallel all-to-all this project had written for 0.16.1) with:

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


# ---- megatron-core 0.16.1 (Python 3.11) -------------------------------------------------------------
# 0.16.1's GatedDeltaNet has no context parallelism and a forward that cannot be overridden piecewise,
# so the project keeps a full forward for it. Dropping 0.16.1 deletes this function (docs/environment.md).
def _gdn_class_016():
    import torch.nn.functional as F
    from megatron.core.ssm import gated_delta_net as gdn

    from megatron_s3ac.models import cpu_compat

    cpu_compat.patch_missing_fla()

    class TorchGatedDeltaNet(gdn.GatedDeltaNet):
        """megatron's GatedDeltaNet with four changes:

        * an attention mask other than causal is refused, because megatron-core 0.16.1's GDN ignores
          masks (packed samples would leak state into each other, left padding would feed pad tokens
          into the recurrence);
        * the decay ``g = -exp(A_log) * softplus(alpha + dt_bias)`` is computed in fp32 from an fp32
          copy of ``A_log`` (megatron takes ``A_log.exp()`` in the parameter dtype: in bf16 every
          head's decay rate is off by up to 2^-9 relative, a systematic bias that compounds over a
          long sequence; transformers and fla compute it in fp32). That line is the only numerical
          difference between ``forward`` below and megatron-core 0.16.1's (training path; for
          inference and packed sequences megatron's own forward is called, and raises). In fp32 it
          is the same computation, bit for bit (tests/qwen3_5/test_bf16.py);
        * the gated output norm runs eagerly (megatron wraps it in torch.compile, which needs a
          compiler toolchain on CPU and changes nothing numerically).
        * context parallelism (megatron-core 0.16.1 has none for GDN): ``_forward_cp``, a head-parallel
          all-to-all over the CP group (the non-CP path is unchanged).

        The kernels (``l2norm``, ``chunk_gated_delta_rule``) are looked up in megatron's module at
        call time: fla's, or the fp32 torch kernels bound by ``cpu_compat.patch_missing_fla``.
        """

        def __init__(self, config, *args, **kwargs):
            from megatron.core import parallel_state

            super().__init__(config, *args, **kwargs)
            cp = config.context_parallel_size
            self.cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None

        def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                    attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                    inference_params=None, **kwargs):
            if attention_mask is not None and not _is_causal(attention_mask):
                raise NotImplementedError(
                    "qwen3_5_moe: megatron-core 0.16.1's Gated DeltaNet ignores attention masks, so packed "
                    "sequences (block-diagonal masks) and left padding are not supported; use right "
                    "padding with a causal mask (attention_mask=None)")
            if inference_context is not None or inference_params is not None or packed_seq_params is not None:
                # megatron raises NotImplementedError for these
                return super().forward(hidden_states, attention_mask, key_value_states, inference_context,
                                       attention_bias, packed_seq_params, sequence_len_offset,
                                       inference_params=inference_params, **kwargs)
            if self.cp_group is not None:
                return self._forward_cp(hidden_states)
            seq_len, batch, _ = hidden_states.shape
            seq_len = seq_len * self.sp_size
            qkvzba, _ = self.in_proj(hidden_states)
            qkvzba = qkvzba.transpose(0, 1)  # [s, b, x] -> [b, s, x]
            qkv, gate, beta, alpha = torch.split(
                qkvzba, [(self.qk_dim * 2 + self.v_dim) // self.tp_size, self.v_dim // self.tp_size,
                         self.num_value_heads // self.tp_size, self.num_value_heads // self.tp_size], dim=-1)
            gate = gate.reshape(batch, seq_len, -1, self.value_head_dim)
            beta = beta.reshape(batch, seq_len, -1)
            alpha = alpha.reshape(batch, seq_len, -1)

            qkv = qkv.transpose(1, 2).contiguous()  # [b, s, d] -> [b, d, s]
            if (gdn.causal_conv1d_fn is None) or self.config.deterministic_mode:
                qkv = self.act_fn(self.conv1d(qkv)[..., :seq_len])
            else:
                assert self.activation in ["silu", "swish"]
                qkv = gdn.causal_conv1d_fn(x=qkv, weight=self.conv1d.weight.squeeze(1), bias=self.conv1d.bias,
                                           activation=self.activation)
            qkv = qkv.transpose(1, 2)
            norm_out = self._gated_delta(qkv, gate, beta, alpha, self.A_log, self.dt_bias)
            norm_out = norm_out.reshape(batch, seq_len, -1).transpose(0, 1).contiguous()
            return self.out_proj(norm_out)

        def _gated_delta(self, qkv, gate, beta, alpha, A_log, dt_bias):
            """After the conv: l2norm, decay, the chunked delta rule, the gated norm. qkv [b, s, C] (this
            rank's heads: C = 2 nk dk + nv dv), gate [b, s, nv, dv], beta / alpha [b, s, nv], A_log /
            dt_bias [nv] -> [b, s, nv, dv] (nk / nv: the key / value heads held here)."""
            batch, seq_len = qkv.shape[:2]
            nv = A_log.shape[0]
            nk = nv * self.num_key_heads // self.num_value_heads
            query, key, value = torch.split(
                qkv, [nk * self.key_head_dim, nk * self.key_head_dim, nv * self.value_head_dim], dim=-1)
            query = query.reshape(batch, seq_len, -1, self.key_head_dim)
            key = key.reshape(batch, seq_len, -1, self.key_head_dim)
            value = value.reshape(batch, seq_len, -1, self.value_head_dim)
            if self.use_qk_l2norm:
                query = gdn.l2norm(query.contiguous())
                key = gdn.l2norm(key.contiguous())
            if self.num_value_heads // self.num_key_heads > 1:
                query = query.repeat_interleave(self.num_value_heads // self.num_key_heads, dim=2)
                key = key.repeat_interleave(self.num_value_heads // self.num_key_heads, dim=2)
            query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
            gate, beta, alpha = gate.contiguous(), beta.contiguous(), alpha.contiguous()

            g = -A_log.float().exp() * F.softplus(alpha.float() + dt_bias)  # fp32 (see class doc)
            beta = beta.sigmoid()

            kernel = gdn.chunk_gated_delta_rule
            if self.config.deterministic_mode and not cpu_compat.torch_gdn_in_use():
                kernel = gdn.torch_chunk_gated_delta_rule  # megatron's choice next to fla
            core_attn_out, _ = kernel(query, key, value, g=g, beta=beta, initial_state=None,
                                      output_final_state=False, use_qk_l2norm_in_kernel=False)
            return self._apply_gated_norm(core_attn_out, gate)

        def _forward_cp(self, hidden_states):
            """Context parallel: a head-parallel all-to-all (docs/context_parallel.md). hidden_states
            [s/cp(/tp under SP), b, h] of this CP rank's two load-balanced chunks -> (out [same], bias).

            in_proj on the rank's tokens; all-to-all over CP: every rank gets the whole sequence for
            1/cp of this TP rank's heads (the chunks put back in sequence order), so the causal conv1d
            (depthwise: per channel) and the delta rule (per head) run exactly as without CP on the
            rank's heads, with its slices of conv1d / A_log / dt_bias; the reverse all-to-all returns
            the rank's tokens with all heads for out_proj. Backward: the all-to-alls' transposes
            (megatron's ``all_to_all``); the sliced parameters' gradients are summed over DP x CP by DDP."""
            from megatron.core.ssm.mamba_context_parallel import (
                _all_to_all_cp2hp, _all_to_all_hp2cp, _redo_attention_load_balancing,
                _undo_attention_load_balancing)

            cp, r = self.cp_group.size(), self.cp_group.rank()
            qkvzba, _ = self.in_proj(hidden_states)  # [s/cp, b, D/tp]
            s_loc, batch, _ = qkvzba.shape
            nk, nv = self.num_key_heads // self.tp_size, self.num_value_heads // self.tp_size
            dk, dv = self.key_head_dim, self.value_head_dim
            parts = torch.split(qkvzba, [nk * dk, nk * dk, nv * dv, nv * dv, nv, nv], dim=-1)
            # head blocks per CP rank: [s/cp, b, cp, X] with rank j's heads of every part in block j
            x = torch.cat([t.reshape(s_loc, batch, cp, -1) for t in parts], -1).reshape(s_loc, batch, -1)
            x = _undo_attention_load_balancing(_all_to_all_cp2hp(x, self.cp_group), cp)  # [s, b, X]
            seq_len = x.shape[0]
            nk_c, nv_c = nk // cp, nv // cp
            q, k, v, gate, beta, alpha = torch.split(
                x.transpose(0, 1), [nk_c * dk, nk_c * dk, nv_c * dv, nv_c * dv, nv_c, nv_c], dim=-1)
            # this rank's conv channels: its q, k and v heads inside the TP rank's [q | k | v] channels
            dev = x.device
            ch = torch.cat([torch.arange(r * nk_c * dk, (r + 1) * nk_c * dk, device=dev),
                            nk * dk + torch.arange(r * nk_c * dk, (r + 1) * nk_c * dk, device=dev),
                            2 * nk * dk + torch.arange(r * nv_c * dv, (r + 1) * nv_c * dv, device=dev)])
            w = self.conv1d.weight.index_select(0, ch)
            bias = None if self.conv1d.bias is None else self.conv1d.bias.index_select(0, ch)
            qkv = torch.cat([q, k, v], -1).transpose(1, 2)  # [b, C, s]
            qkv = self.act_fn(F.conv1d(qkv, w, bias, padding=self.conv_kernel_dim - 1, groups=len(ch))[..., :seq_len])
            heads = slice(r * nv_c, (r + 1) * nv_c)
            out = self._gated_delta(qkv.transpose(1, 2), gate.reshape(batch, seq_len, nv_c, dv), beta, alpha,
                                    self.A_log[heads], self.dt_bias[heads])
            out = out.reshape(batch, seq_len, -1).transpose(0, 1)  # [s, b, nv_c dv]
            out = _all_to_all_hp2cp(_redo_attention_load_balancing(out.contiguous(), cp), self.cp_group)
            return self.out_proj(out)  # [s/cp, b, nv dv] -> hidden

        def _apply_gated_norm(self, x, gate):
            x_dtype = x.dtype
            y = self.out_norm(x.reshape(-1, x.shape[-1]))
            y = y * self.act_fn(gate.reshape(-1, gate.shape[-1]).float())
            return y.to(x_dtype)

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

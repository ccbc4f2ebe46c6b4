"""Actor and critic on megatron-core.

Actor: ``GPTModel`` from the registry (logits over the padded vocab, TP-sharded on the vocab dim).
Critic: the same backbone whose LM head is replaced by a scalar value head; its forward returns
values [b, s]. The critic gets its own ``TransformerConfig`` so it can use another parallel layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_s3ac.models.parallel import ParallelLayout
from megatron_s3ac.models.recompute import recompute_kwargs
from megatron_s3ac.models.registry import ModelInfo, dtype_flags, get_arch


@dataclass(frozen=True)
class ValueHeadConfig:
    """``kind='linear'``: V = w.h + b. ``kind='bounded'`` (BPCO): V = r_min + (r_max-r_min)(1/2 + atan(z)/pi)."""

    kind: str = "linear"
    r_min: float = -1.0
    r_max: float = 1.0

    def __post_init__(self):
        if self.kind not in ("linear", "bounded"):
            raise ValueError(f"value head kind must be 'linear' or 'bounded', got {self.kind!r}")
        if self.kind == "bounded" and not self.r_max > self.r_min:
            raise ValueError(f"bounded value head needs r_max > r_min, got [{self.r_min}, {self.r_max}]")


def build_transformer_config(info: ModelInfo, layout: ParallelLayout, dtype: torch.dtype = torch.float32,
                             recompute: str = "none", recompute_modules: list[str] | None = None,
                             recompute_num_layers: int | None = None, **overrides) -> TransformerConfig:
    """TransformerConfig for ``info`` at ``layout`` in ``dtype`` (fp32 or bf16 params/activations;
    bf16 trains with fp32 main grads through megatron's mixed-precision/distributed optimizer, see
    optim.build_optimizer) with activation recompute (``recompute_kwargs``); ``overrides`` win.

    An uneven layer count (num_layers % pp != 0) without explicit first/last stage sizes is split by
    ``ParallelLayout.resolve`` (the rule is documented there)."""
    layout = layout.resolve(info.num_layers)
    kw = get_arch(info.model_type).transformer_config_kwargs(info)
    kw.update(layout.transformer_config_kwargs())
    kw.update(dtype_flags(dtype))
    if layout.pp > 1:
        kw["pipeline_dtype"] = dtype
    kw.update(recompute_kwargs(recompute, recompute_modules, recompute_num_layers))
    kw.update(overrides)
    config = TransformerConfig(**kw)
    # the torch spec's CP attention exchange (SDPAttention); not a megatron field, TE reads its cp_comm_type
    config.s3ac_cp_comm = layout.cp_comm
    return config


def _stage_flags(config: TransformerConfig) -> tuple[bool, bool]:
    from megatron.core import parallel_state as ps

    if config.pipeline_model_parallel_size == 1:
        return True, True
    return ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()


def build_actor(info: ModelInfo, config: TransformerConfig, use_te: bool | None = None) -> GPTModel:
    """The policy: GPTModel for this rank's pipeline stage; logits [b, s, padded_vocab/tp]."""
    pre, post = _stage_flags(config)
    arch = get_arch(info.model_type)
    gpt = GPTModel(config=config, transformer_layer_spec=arch.block_spec(config, info, use_te),
                   pre_process=pre, post_process=post, parallel_output=True,
                   share_embeddings_and_output_weights=info.tie_embeddings, **arch.gpt_model_kwargs(info))
    arch.finish_model(gpt, info)
    return gpt


class ValueHead(MegatronModule):
    """Scalar head replacing GPTModel.output_layer. hidden [s(/tp if SP), b, h] -> ([s, b, 1], None).

    Weight init N(0, std=1/(H+1)) (S3AC), bias 0. Under sequence parallelism the hidden states are
    gathered first; every TP rank then computes the same values, so the gather's backward splits
    (not reduce-scatters) the gradient and the head's gradient needs no TP all-reduce.
    """

    def __init__(self, config: TransformerConfig, head: ValueHeadConfig):
        super().__init__(config=config)
        h = config.hidden_size
        self.head = head
        self.weight = torch.nn.Parameter(torch.empty(1, h, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))
        with torch.no_grad():
            self.weight.normal_(mean=0.0, std=1.0 / (h + 1))

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.config.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        z = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
        if self.head.kind == "bounded":
            z = self.head.r_min + (self.head.r_max - self.head.r_min) * (0.5 + torch.atan(z) / math.pi)
        return z, None


class Critic(torch.nn.Module):
    """GPTModel backbone + ValueHead. forward(input_ids [b,s], position_ids, attention_mask) -> values [b, s].

    On a non-last pipeline stage it returns the hidden states like GPTModel does. The backbone is
    ``self.module`` so megatron's wrapped-model helpers (model_type, config, ...) reach it, and the
    checkpoint keys equal the actor's (an actor checkpoint initialises a critic backbone).
    """

    def __init__(self, info: ModelInfo, config: TransformerConfig, head: ValueHeadConfig = ValueHeadConfig(),
                 use_te: bool | None = None):
        super().__init__()
        pre, post = _stage_flags(config)
        arch = get_arch(info.model_type)
        self.module = GPTModel(config=config, transformer_layer_spec=arch.block_spec(config, info, use_te),
                              pre_process=pre, post_process=post, parallel_output=True,
                              share_embeddings_and_output_weights=False, **arch.gpt_model_kwargs(info))
        arch.finish_model(self.module, info)
        if post:
            self.module.output_layer = ValueHead(config, head)
        self.config = config

    def set_input_tensor(self, t):
        self.module.set_input_tensor(t)

    def sharded_state_dict(self, prefix: str = "", *args, **kwargs):
        return self.module.sharded_state_dict(prefix=prefix, *args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)

    def forward(self, input_ids, position_ids, attention_mask, **kw):
        out = self.module(input_ids, position_ids, attention_mask, **kw)
        if self.module.post_process:
            return out.squeeze(-1)  # [b, s, 1] -> [b, s]
        return out


def build_critic(info: ModelInfo, config: TransformerConfig, head: ValueHeadConfig = ValueHeadConfig(),
                 use_te: bool | None = None) -> Critic:
    return Critic(info, config, head, use_te)


# ---- freezing ------------------------------------------------------------------------------------
FROZEN_FOR_VALUE_PRETRAIN = (".self_attention.", ".input_layernorm.", ".mlp.router.")


def freeze_attention_and_router(model: torch.nn.Module) -> list[str]:
    """Value pretraining (paper §3.3): freeze attention (incl. its pre-norm, which TE fuses into
    linear_qkv) and the MoE router; nothing else. Returns the frozen parameter names.

    Frozen parameters get requires_grad=False, so megatron's DDP gives them no grad buffer and the
    optimizer holds no state for them. Call before wrapping in DDP / building the optimizer.
    """
    frozen = []
    for name, p in model.named_parameters():
        if any(key in "." + name for key in FROZEN_FOR_VALUE_PRETRAIN):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen

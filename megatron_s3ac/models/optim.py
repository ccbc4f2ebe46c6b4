"""Megatron DDP wrapping and the (distributed) optimizer for actor and critic."""
from __future__ import annotations

import torch


def wrap_ddp(model: torch.nn.Module, config, distributed_optimizer: bool = True):
    """Wrap in megatron's DDP (contiguous grad buffers; only params with requires_grad get one)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_s3ac.models.pipeline import prepare_config

    prepare_config(config)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer,
        average_in_collective=False)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    return ddp


def build_optimizer(ddp_models: list, lr: float, weight_decay: float = 0.0, clip_grad: float = 1.0,
                    adam_betas=(0.9, 0.999), adam_eps: float = 1e-8, distributed_optimizer: bool = True,
                    bf16: bool = False):
    """megatron-core optimizer (Adam) over the DDP-wrapped chunks; frozen params are not included."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                          adam_beta1=adam_betas[0], adam_beta2=adam_betas[1], adam_eps=adam_eps,
                          use_distributed_optimizer=distributed_optimizer, bf16=bf16,
                          params_dtype=torch.bfloat16 if bf16 else torch.float32)
    return get_megatron_optimizer(cfg, ddp_models)

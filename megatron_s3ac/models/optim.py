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


class OptimizerUnavailable(RuntimeError):
    """An optimizer setting megatron-core cannot provide on this machine; the message names it."""


def _have_te() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def optimizer_refusal(ddp_models: list, cpu_offload: bool, precision_aware: bool,
                      distributed_optimizer: bool = True) -> str | None:
    """Why megatron-core 0.19.2 cannot build this optimizer here, or None. Observed on CPU with 0.16.1;
    the code paths are unchanged in 0.19.2 (line numbers are 0.19.2's ``megatron/core/optimizer/``):

    * cpu_offload: ``HybridDeviceOptimizer._get_sub_optimizer_param_groups``
      (cpu_offloading/hybrid_optimizer.py:251-297) offloads only parameters with ``is_cuda`` (:273);
      host parameters end up in its CPU group with no device twin (:285-288), and the first ``step``
      fails with a KeyError in ``_set_sub_optimizer_grads`` (``cpu_copys_map_gpu_param[param]``, :101).
      So it needs the model on CUDA (on a CPU-only machine the state is host memory anyway).
    * precision_aware: without cpu_offload ``OptimizerConfig.__post_init__`` requires TE's FusedAdam
      for bf16 moments (optimizer_config.py:430-461, a RuntimeError without it). (0.16.1's
      ``is_te_min_version`` also raised a TypeError without TE; 0.19.2's reads TE as version 0.0.0,
      utils.py:317-323.) With cpu_offload but without TE it stays refused: not run on any release.
    """
    params = [p for m in ddp_models for p in m.parameters() if p.requires_grad]
    if cpu_offload and params and not params[0].is_cuda:
        return ("optim.cpu_offload needs the model on a CUDA device: megatron-core's HybridDeviceOptimizer "
                "only offloads CUDA parameters (hybrid_optimizer.py: _get_sub_optimizer_param_groups) and "
                "fails on host parameters; on CPU the optimizer state already lives in host memory")
    if precision_aware:
        if not distributed_optimizer:
            return "optim.precision_aware needs the distributed optimizer"
        if not _have_te():
            return ("optim.precision_aware (bf16 Adam moments) needs Transformer Engine: megatron-core's "
                    "OptimizerConfig checks its version (is_te_min_version) and uses TE's FusedAdam "
                    "(or, with optim.cpu_offload, its HybridDeviceOptimizer); transformer_engine is not installed")
    return None


def build_optimizer(ddp_models: list, lr: float, weight_decay: float = 0.0, clip_grad: float = 1.0,
                    adam_betas=(0.9, 0.999), adam_eps: float = 1e-8, distributed_optimizer: bool = True,
                    bf16: bool | None = None, cpu_offload: bool = False, offload_fraction: float = 1.0,
                    overlap_d2h_h2d: bool = False, precision_aware: bool = False):
    """megatron-core optimizer (Adam) over the DDP-wrapped chunks; frozen params are not included.

    bf16:             the model's params are bf16 (None: read from the model config). megatron then
                      keeps fp32 main params (the distributed optimizer's shards) and the DDP fp32
                      main grads (``wrap_ddp``: ``grad_reduce_in_fp32``), so Adam runs in fp32.
    Settings megatron cannot run here raise ``OptimizerUnavailable`` (see ``optimizer_refusal``).
    cpu_offload:      megatron's ``HybridDeviceOptimizer``: ``offload_fraction`` of the optimizer
                      state and its update live and run on the host (torch AdamW), the rest on the
                      device; ``overlap_d2h_h2d`` overlaps the copies with compute on CUDA.
    precision_aware:  bf16 Adam moments (``use_precision_aware_optimizer`` with exp_avg(_sq) in
                      bf16). megatron provides it through Transformer Engine's FusedAdam, or with
                      ``cpu_offload`` through its hybrid optimizer; anything else is refused here.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if bf16 is None:
        bf16 = bool(getattr(ddp_models[0].config, "bf16", False))
    if not 0.0 <= offload_fraction <= 1.0:
        raise ValueError(f"optim.offload_fraction must be in [0, 1], got {offload_fraction}")
    refusal = optimizer_refusal(ddp_models, cpu_offload, precision_aware, distributed_optimizer)
    if refusal:
        raise OptimizerUnavailable(refusal)
    extra = {}
    if precision_aware:
        extra.update(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                     exp_avg_sq_dtype=torch.bfloat16)
    if cpu_offload:
        extra.update(optimizer_cpu_offload=True, optimizer_offload_fraction=float(offload_fraction),
                     overlap_cpu_optimizer_d2h_h2d=bool(overlap_d2h_h2d),
                     # pinned host buffers need CUDA; on CPU they are plain host memory
                     pin_cpu_grads=torch.cuda.is_available(), pin_cpu_params=torch.cuda.is_available())
    cfg = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                          adam_beta1=adam_betas[0], adam_beta2=adam_betas[1], adam_eps=adam_eps,
                          use_distributed_optimizer=distributed_optimizer, bf16=bf16,
                          params_dtype=torch.bfloat16 if bf16 else torch.float32, **extra)
    return get_megatron_optimizer(cfg, ddp_models)

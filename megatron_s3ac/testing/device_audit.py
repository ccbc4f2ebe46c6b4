"""Device-placement audit: every model the trainer builds ends up wholly on the trainer's device.

On a CPU machine the host *is* the trainer's device, so a model left (partly) on the host passes every CPU test
and fails only on a GPU (e.g. this project's own norm modules allocate on the host; megatron's DDP moves only
trainable params). The audit points the target device at ``meta`` (a non-CPU device torch makes without any
accelerator) and builds each model through the trainer's own code:

* ``target_device(device)``: ``trainer.step.device.trainer_device()`` returns ``device`` in every module that bound it;
* ``stop_at_ddp()``: the build stops where the model is handed to megatron's DDP (``models.optim.wrap_ddp``),
  which is where it must already be placed; the module is kept (``Captured.module``);
* ``off_device(module, device)``: names of parameters and buffers elsewhere (empty = placed);
* ``audit_trainer_models(cfg)``: actor (``build.build_actor``), critic (``build.build_critic``) and the value
  pretraining critic (``value_pretrain.value_pretrain``), each {name: off-device tensor names}.

Needs megatron's parallel state initialised (one rank is enough: ``models.gloo_ranks``).
"""
from __future__ import annotations

import contextlib
import sys
import types

import torch


class Captured(Exception):
    """Raised by the ``stop_at_ddp`` stand-in: the model as it reached DDP."""

    def __init__(self, module):
        super().__init__("build stopped where the model reaches DDP")
        self.module = module


def off_device(module: torch.nn.Module, device) -> list[str]:
    """Parameters and buffers of ``module`` not on ``device``'s type (e.g. "meta"), as "name (device)"."""
    want = torch.device(device).type
    out = [f"{n} ({t.device})" for n, t in module.named_parameters() if t.device.type != want]
    return out + [f"{n} ({t.device})" for n, t in module.named_buffers() if t is not None and t.device.type != want]


def _rebind(attr: str, original, replacement):
    """Point every loaded megatron_s3ac module's ``attr`` that is ``original`` at ``replacement``; returns undo."""
    hits = [m for name, m in list(sys.modules.items()) if name.startswith("megatron_s3ac")
            and isinstance(m, types.ModuleType) and getattr(m, attr, None) is original]
    for m in hits:
        setattr(m, attr, replacement)
    return lambda: [setattr(m, attr, original) for m in hits]


@contextlib.contextmanager
def target_device(device):
    """``trainer_device()`` returns ``torch.device(device)`` inside the block, wherever it was imported."""
    from megatron_s3ac.trainer.step import device as D

    dev = torch.device(device)
    undo = _rebind("trainer_device", D.trainer_device, lambda: dev)
    try:
        yield dev
    finally:
        undo()


@contextlib.contextmanager
def stop_at_ddp():
    """``models.optim.wrap_ddp(module, ...)`` raises ``Captured(module)`` inside the block."""
    from megatron_s3ac.models import optim

    def capture(module, *args, **kwargs):
        raise Captured(module)

    undo = _rebind("wrap_ddp", optim.wrap_ddp, capture)
    try:
        yield
    finally:
        undo()


def captured(build) -> torch.nn.Module:
    """Run ``build()`` under ``stop_at_ddp``; the module it handed to DDP (AssertionError if it never did)."""
    with stop_at_ddp():
        try:
            build()
        except Captured as c:
            return c.module
    raise AssertionError("the build never reached DDP (models.optim.wrap_ddp)")


def vpt_rows(n: int = 2, prompt=(3, 4), response=(5, 6, 7)) -> list[dict]:
    """Coverage rows as ``value_pretrain`` reads them (prompt ids, response ids, reward)."""
    return [{"prompt_ids": list(prompt), "response_ids": list(response), "reward": 1.0 if i % 2 else -1.0}
            for i in range(n)]


def audit_trainer_models(cfg, device="meta") -> dict[str, list[str]]:
    """{"actor" | "critic" | "value_pretrain_critic": off-device names} for the models ``cfg``'s trainer builds,
    the target device pointed at ``device``. The value-pretraining critic is built from a host critic (as
    ``value_pretrain`` copies the trainer's critic into it)."""
    from megatron_s3ac.models.actor_critic import build_transformer_config
    from megatron_s3ac.trainer.step import build as B
    from megatron_s3ac.config import layout_of, model_info_for
    from megatron_s3ac.trainer.stages.value_pretrain import value_pretrain

    info = model_info_for(cfg)
    layout = layout_of(cfg.actor_layout)
    out = {}
    with target_device(device):
        out["actor"] = off_device(captured(lambda: B.build_actor(cfg, info, layout, {})), device)
        out["critic"] = off_device(captured(lambda: B.build_critic(cfg, info, layout, lambda critic: None)), device)
    host_critic = captured(lambda: B.build_critic(cfg, info, layout, lambda critic: None))
    tr = types.SimpleNamespace(cfg=cfg, info=info, critic=host_critic, rank=0, pad_to=8, privileged=None,
                               critic_config=build_transformer_config(info, layout, **B._config_kw(cfg)),
                               model_scope=lambda which: contextlib.nullcontext(), device=torch.device(device))
    with target_device(device):
        out["value_pretrain_critic"] = off_device(captured(lambda: value_pretrain(tr, vpt_rows())), device)
    return out


def audit_rank(configs: dict, device="meta") -> dict:
    """Rank body (``models.gloo_ranks.run_distributed``): for each {label: trainer config overrides} (schema-checked
    only), megatron's parallel state for its actor layout, then ``audit_trainer_models``; {label: audit}."""
    from megatron.core import parallel_state

    from megatron_s3ac.models.parallel import initialize_model_parallel
    from megatron_s3ac.config import layout_of, load_config

    out = {}
    for label, overrides in configs.items():
        cfg = load_config(None, list(overrides), check=False)
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        initialize_model_parallel(layout_of(cfg.actor_layout), seed=cfg.train.seed)
        out[label] = audit_trainer_models(cfg, device)
    return out

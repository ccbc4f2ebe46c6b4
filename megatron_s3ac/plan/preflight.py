"""The trainer's pre-flight check: layout rules and memory fit of an experiment config, before launch.

``preflight(cfg, world_size=None) -> PreflightReport``

* every layout rule that needs no world size (``ParallelLayout.validate`` at a world size that satisfies
  the divisibility rules, plus ``rules.extra_layout_errors``), for the actor and the critic, always
  (e.g. ``actor_layout.ep=3`` with 4 experts);
* the world-size rules when ``world_size`` is given or the config has a ``cluster:`` section;
* the memory fit (``memory.estimate``) when the config has a ``cluster:`` section: a message per phase
  that does not fit, naming the phase and the pipeline stage.

``cfg`` is the trainer's ``Config`` (dataclasses) or a plain dict of the YAML. Layout errors are
``errors`` (the job cannot start); memory misfits are ``warnings`` (``s3ac-train check --strict``
refuses them). The planner knobs come from the trainer's own keys (``trainer_knobs``), with the
trainer's defaults when a key is absent (fp32, no recompute, no offload), unless ``knobs`` is given.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# planner knob <- the trainer config key that sets it, and the trainer's default when the key is absent
_KNOB_KEYS = {"dtype": ("model.dtype", "fp32"), "recompute": ("train.recompute", "none"),
              "offload_idle": ("train.offload_idle", False), "logprob_chunk": ("algo.logprob_chunk_tokens", 0),
              "precision_aware": ("optim.actor.precision_aware", False)}


@dataclass
class PreflightReport:
    errors: list[str] = field(default_factory=list)  # the job cannot start (illegal layout, unreadable model)
    warnings: list[str] = field(default_factory=list)  # it would run out of memory (phase + stage named)
    checked_world: int | None = None
    estimate: dict | None = None  # s3ac-plan --json object of the config's layout, when a cluster is known

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def fits(self) -> bool | None:
        return None if self.estimate is None else bool(self.estimate["fits"])

    def messages(self) -> list[str]:
        return [f"error: {m}" for m in self.errors] + [f"warning: {m}" for m in self.warnings]



def _get(cfg: Any, path: str, default=None):
    import enum

    cur = cfg
    for part in path.split("."):
        if cur is None:
            return default
        cur = cur.get(part) if isinstance(cur, dict) else getattr(cur, part, None)
    if isinstance(cur, enum.Enum):  # the trainer schema's choices are str Enums
        cur = cur.value
    return default if cur is None else cur


def _layout_of(d: Any):
    from megatron_s3ac.models.parallel import ParallelLayout

    kw = {}
    for k in ("tp", "cp", "pp", "ep", "etp", "first_stage_layers", "last_stage_layers"):
        v = _get(d, k)
        if v is not None:
            kw[k] = int(v)
    return ParallelLayout(**kw)


def _info(cfg: Any):
    from megatron_s3ac.models.registry import model_info

    if not isinstance(cfg, dict):  # the trainer's Config: its own model reader
        from megatron_s3ac.config import model_info_for

        return model_info_for(cfg)
    if _get(cfg, "model.tiny") == "arithmetic_moe":
        from megatron_s3ac.tasks.arithmetic import tiny_arithmetic_hf_config

        return model_info(tiny_arithmetic_hf_config().to_dict())
    return model_info(_get(cfg, "model.hf_config"))


def trainer_knobs(cfg: Any):
    """The planner ``Knobs`` a trainer config runs with (``model.dtype``, ``train.recompute``,
    ``train.offload_idle``, ``algo.logprob_chunk_tokens``, ``optim.actor.{cpu_offload,offload_fraction,
    precision_aware}``, ``rollout.placement``); absent keys take the trainer's defaults."""
    from megatron_s3ac.plan.memory import Knobs

    kw = {k: _get(cfg, key, default) for k, (key, default) in _KNOB_KEYS.items()}
    kw["dtype"], kw["recompute"] = str(kw["dtype"]), str(kw["recompute"])
    kw["offload_idle"], kw["precision_aware"] = bool(kw["offload_idle"]), bool(kw["precision_aware"])
    kw["logprob_chunk"] = int(kw["logprob_chunk"])
    # the optimizer offload fraction only applies when the host optimizer is on (trainer default 1.0)
    kw["optimizer_offload"] = (float(_get(cfg, "optim.actor.offload_fraction", 1.0))
                               if bool(_get(cfg, "optim.actor.cpu_offload", False)) else 0.0)
    return Knobs(placement=str(_get(cfg, "rollout.placement", "colocated")),
                 sync_overlap=bool(_get(cfg, "rollout.sync.overlap", False)), **kw)


def preflight(cfg: Any, world_size: int | None = None, knobs=None) -> PreflightReport:
    from megatron_s3ac.plan.cli import to_dict
    from megatron_s3ac.plan.memory import Cluster, Workload, critic_block_tokens, estimate
    from megatron_s3ac.plan.search import layout_errors

    rep = PreflightReport()
    try:
        info = _info(cfg)
    except Exception as e:  # noqa: BLE001 - any unreadable model config is reported, not raised
        rep.errors.append(f"model: cannot read the model config: {e}")
        return rep
    actor = _layout_of(_get(cfg, "actor_layout") or {})
    critic_cfg = _get(cfg, "critic_layout")
    critic = _layout_of(critic_cfg) if critic_cfg else actor
    gpus = _get(cfg, "cluster.gpus")
    world = world_size if world_size is not None else (int(gpus) if gpus else None)
    rep.checked_world = world
    for name, lay in (("actor_layout", actor), ("critic_layout", critic)):
        for err in layout_errors(info, lay, world):
            rep.errors.append(f"{name}: {err}")
    if rep.errors or not gpus:
        return rep
    cluster = Cluster(gpus=int(gpus), gpus_per_node=int(_get(cfg, "cluster.gpus_per_node", 8)),
                      gpu_mem_gib=float(_get(cfg, "cluster.gpu_mem_gib", 141.0)),
                      host_mem_gib=float(_get(cfg, "cluster.host_mem_gib", 2048.0)))
    w = Workload(prompt_len=int(_get(cfg, "data.max_prompt_tokens", 2048)),
                 response_len=int(_get(cfg, "rollout.max_new_tokens", 16384)),
                 prompts_per_step=int(_get(cfg, "rollout.prompts_per_step", 32)), k=int(_get(cfg, "rollout.k", 8)),
                 actor_minibatches=int(_get(cfg, "algo.actor_minibatches", 8)),
                 critic_minibatches=int(_get(cfg, "algo.critic_minibatches", 8)),
                 actor_epochs=int(_get(cfg, "algo.actor_epochs", 1)),
                 critic_epochs=int(_get(cfg, "algo.critic_epochs", 2)),
                 micro_batch_size=int(_get(cfg, "algo.micro_batch_size", 1)),
                 max_tokens_per_micro_batch=int(_get(cfg, "algo.max_tokens_per_micro_batch", 0)),
                 critic_extra_tokens=critic_block_tokens(cfg))
    if knobs is None:
        knobs = trainer_knobs(cfg)
    errs = knobs.validate()
    if errs:
        rep.errors += [f"planner knobs: {e}" for e in errs]
        return rep
    est = estimate(info, actor, cluster, w, knobs, critic)
    rep.estimate = to_dict(est, info)
    rep.warnings += [f"memory: {p}" for p in est.problems]
    return rep

"""One YAML per experiment + ``key=value`` command-line overrides, validated before heavy work.

The schema is a tree of dataclasses (OmegaConf structured config), one per YAML section: unknown
keys, wrong types and choices outside an Enum are rejected by OmegaConf with the offending key named.
Each section then checks its own values (``errors()``, messages name the dotted key); ``validate``
adds the rules that span sections (and the parallel layout against the model config) and raises
``ConfigError`` listing every problem.

One module per section (``enums``, ``model``, ``data``, ``rollout``, ``algo``, ``train``); this module holds
``Config`` and the cross-section checks and re-exports every name (``megatron_s3ac.config.X``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional
from omegaconf import DictConfig, OmegaConf
from megatron_s3ac.rollout.engines.sglang.settings import SGLangSettings  # noqa: F401 - kept importable from here
from megatron_s3ac.rollout.engines.vllm.settings import VLLMSettings  # noqa: F401 - kept importable from here
from megatron_s3ac.config.enums import (  # noqa: F401 - re-exported
    ConfigError, Task, Placement, EngineKind, WeightsDtype, CriticHead, CriticPrivileged, TinyModel, DType, Recompute, Stage,
    _missing_paths, R3_MODES,
)
from megatron_s3ac.config.model import (  # noqa: F401 - re-exported
    ModelCfg, LayoutCfg, ModelOptimCfg, OptimCfg,
)
from megatron_s3ac.config.data import (  # noqa: F401 - re-exported
    DataCfg,
)
from megatron_s3ac.config.rollout import (  # noqa: F401 - re-exported
    RolloutCfg,
)
from megatron_s3ac.config.algo import (  # noqa: F401 - re-exported
    AlgoCfg, DAPSCfg, ValuePretrainCfg,
)
from megatron_s3ac.config.train import (  # noqa: F401 - re-exported
    DemoCfg, PipelineCfg, JudgeCfg, EvalCfg, ClusterCfg, VisionCfg, TrainCfg,
)


@dataclass
class Config:
    model: ModelCfg = field(default_factory=ModelCfg)
    actor_layout: LayoutCfg = field(default_factory=LayoutCfg)
    critic_layout: Optional[LayoutCfg] = None  # None: same as the actor
    data: DataCfg = field(default_factory=DataCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    algo: AlgoCfg = field(default_factory=AlgoCfg)
    daps: DAPSCfg = field(default_factory=DAPSCfg)
    value_pretrain: ValuePretrainCfg = field(default_factory=ValuePretrainCfg)
    demo: DemoCfg = field(default_factory=DemoCfg)
    pipeline: PipelineCfg = field(default_factory=PipelineCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    cluster: ClusterCfg = field(default_factory=ClusterCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    train: TrainCfg = field(default_factory=TrainCfg)


SECTIONS = ("model", "data", "rollout", "algo", "value_pretrain", "demo", "pipeline", "eval", "cluster", "optim", "train")


def load_config(path: Optional[str] = None, overrides: list[str] = (), check: bool = True) -> Config:
    """YAML file (optional) merged onto the defaults, then ``key=value`` overrides; validated (``check=False``:
    schema only — keys, types, enums — as s3ac-plan reads configs whose model paths live elsewhere)."""
    base = OmegaConf.structured(Config)
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # noqa: BLE001 - YAML syntax, undecodable bytes: the parser's reason, one line
            raise ConfigError(f"invalid config: {path}: not YAML ({' '.join(str(e).split())})") from None
        if not isinstance(loaded, DictConfig) or not loaded:
            got = "nothing" if not loaded else f"a {type(loaded).__name__.replace('Config', '').lower()}"
            raise ConfigError(f"invalid config: {path}: a config is a mapping of sections (model:, data:, "
                              f"train:, ...), got {got}")
        base = _merged(base, loaded, path)
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"overrides must be key=value, got {bad}")
        base = _merged(base, lambda: OmegaConf.from_dotlist(list(overrides)), "command-line override")
    cfg: Config = OmegaConf.to_object(base)
    # YAML 1.1 reads a bare on/off as a boolean, which OmegaConf turns into "True"/"False"
    cfg.train.r3 = {"True": "on", "False": "off"}.get(cfg.train.r3, cfg.train.r3)
    if check:
        validate(cfg)
    return cfg


def _merged(base, other, where: str):
    """``OmegaConf.merge(base, other)`` (``other`` may be a thunk); a schema error as one ConfigError line
    naming ``where`` (the file, or the override) and the dotted key."""
    try:
        return OmegaConf.merge(base, other() if callable(other) else other)
    except Exception as e:  # noqa: BLE001 - OmegaConf names the key and the type it expected
        key, msg = getattr(e, "full_key", None), (getattr(e, "msg", None) or str(e)).strip().splitlines()[0]
        raise ConfigError(f"invalid config: {where}: {key + ': ' if key else ''}{msg}") from None


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def validate(cfg: Config, world_size: Optional[int] = None) -> None:
    """Every section's own checks, then the rules across sections; raises ConfigError listing every
    problem (cheap: reads configs only)."""
    errs = [e for name in SECTIONS for e in getattr(cfg, name).errors()]
    a, r = cfg.algo, cfg.rollout
    if not errs:
        from megatron_s3ac.algorithms.registry import get_algo

        if get_algo(a.name).needs_groups and r.k < 2:
            errs.append(f"algo.name={a.name} needs rollout.k >= 2 (group baseline)")
    if r.prompts_per_step * r.k < a.actor_minibatches:
        errs.append(f"rollout batch {r.prompts_per_step}x{r.k} is smaller than algo.actor_minibatches={a.actor_minibatches}")
    if cfg.model.tiny is not None and cfg.data.task not in (Task.arithmetic, Task.multistep, Task.chain):
        errs.append("model.tiny=arithmetic_moe uses the character vocabulary: data.task must be arithmetic, "
                    "multistep or chain")
    if cfg.data.task == Task.multistep and cfg.model.tiny is None:
        errs.append("data.task=multistep needs the character-vocabulary model (model.tiny=arithmetic_moe)")
    if cfg.data.task == Task.multistep and r.reward != "multistep":
        errs.append(f"data.task=multistep is scored by rollout.reward=multistep, got {r.reward!r}")
    if cfg.data.task == Task.chain and cfg.model.tiny is None:
        errs.append("data.task=chain needs the character-vocabulary model (model.tiny=arithmetic_moe)")
    if cfg.data.task == Task.chain and r.reward != "chain":
        errs.append(f"data.task=chain is scored by rollout.reward=chain, got {r.reward!r}")
    if a.dynamic_sampling_refill and not (a.dynamic_sampling and r.k > 1):
        errs.append("algo.dynamic_sampling_refill needs the group filter (algo.dynamic_sampling=true, rollout.k > 1)")
    if a.refill_eager:
        if not a.dynamic_sampling_refill:
            errs.append("algo.refill_eager=true submits DAPO refills as groups are filtered out: needs "
                        "algo.dynamic_sampling_refill=true")
        if Placement(r.placement) != Placement.separate or not r.stream_rewards:
            errs.append("algo.refill_eager=true needs an engine that hands groups back as they finish: "
                        "rollout.placement=separate and rollout.stream_rewards=true (got "
                        f"{Placement(r.placement).value}, {r.stream_rewards})")
        if r.partial_rollout:
            errs.append("algo.refill_eager=true is not built with rollout.partial_rollout=true (a paused round's "
                        "groups come back aborted, each would draw a replacement)")
    if any(isinstance(p, int) and not isinstance(p, bool) for p in cfg.pipeline.policies or []) \
            and cfg.model.tiny is None:
        errs.append("pipeline.policies: step numbers name warm-up snapshots, and only model.tiny runs a warm-up; "
                    "give HF dirs")
    if cfg.train.max_staleness > 0 and Placement(r.placement) != Placement.separate:
        errs.append(f"train.max_staleness={cfg.train.max_staleness} overlaps generation with training: needs "
                    f"rollout.placement=separate (got {Placement(r.placement).value}; colocated engines share the "
                    f"trainer's devices and sleep while it trains)")
    if r.partial_rollout and cfg.train.max_staleness < 1:
        errs.append("rollout.partial_rollout=true resumes responses interrupted by a weight sync of the asynchronous "
                    "loop: needs train.max_staleness >= 1 (the synchronous loop syncs only between rollouts)")
    spec = _engine_spec(r)
    if r.partial_rollout and spec is not None and not spec.partial_rollout:
        from megatron_s3ac.rollout.partial import unsupported_engine_reason

        errs.append(unsupported_engine_reason(spec.kind))
    if r.sync.overlap:
        errs += _overlap_errors(cfg, spec)
    if a.entropy_control != "none" and r.k < 2:
        errs.append(f"algo.entropy_control={a.entropy_control} shapes group advantages: needs rollout.k >= 2")
    if spec is not None:
        errs += spec.config_errors(cfg)
    if not errs:
        errs += _engine_errors(cfg, world_size)
    if cfg.train.r3 == "on" and not errs:
        try:
            if not model_info_for(cfg).is_moe:
                errs.append("train.r3=on but the model has no MoE layers (routing replay needs routers)")
        except Exception:  # noqa: BLE001 - an unreadable model config is reported by the model checks
            pass
    if not errs:
        errs += _layout_errors(cfg, world_size)
    if errs:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errs))


def _overlap_errors(cfg: Config, spec) -> list[str]:
    """``rollout.sync.overlap=true``'s rules: the asynchronous loop, an engine that can stage weights, no partial
    rollout (its pause would cut the batches the staged sync lets finish on the old weights)."""
    errs = []
    if cfg.train.max_staleness < 1:
        errs.append("rollout.sync.overlap=true stages the next weights while the engine generates the batches in "
                    "flight: needs train.max_staleness >= 1 (the synchronous loop has nothing in flight at a sync)")
    if spec is not None and not spec.stage_weights:
        errs.append(spec.stage_refusal or (
            f"rollout.sync.overlap=true: rollout.engine={spec.kind} cannot receive weights into a second copy while "
            f"it generates (EngineSpec.stage_weights); only "
            f"{' / '.join(k for k in _staging_kinds())} can (docs/rollout.md \"Overlapped weight sync\")"))
    if cfg.train.max_staleness > 1:
        # one staging copy: step t+1's first bucket would wait for step t's swap, queued behind t+2 .. t+N, inside the
        # export's collectives (the second review of AsyncSource, finding 5)
        errs.append(f"rollout.sync.overlap=true with train.max_staleness={cfg.train.max_staleness}: the engine holds "
                    f"one staging copy, so the next sync would wait for the previous swap behind the batches still "
                    f"queued; use train.max_staleness=1 with the overlapped sync")
    if getattr(cfg.algo, "refill_eager", False):
        # replacements for batch s would queue behind the N batches submitted before it is scored (finding 1)
        errs.append("rollout.sync.overlap=true with algo.refill_eager=true: with nothing drained at the sync, batch "
                    "s's eager replacements queue behind the batches submitted after it, and the engine idles while "
                    "the trainer trains; choose one")
    if cfg.rollout.partial_rollout:
        errs.append("rollout.sync.overlap=true with rollout.partial_rollout=true: partial rollout pauses the engine "
                    "at the sync and resumes on the new weights, the overlapped sync lets the batches in flight "
                    "finish on the old ones; choose one (set rollout.sync.overlap=false or "
                    "rollout.partial_rollout=false)")
    return errs


def _staging_kinds() -> list[str]:
    from megatron_s3ac.rollout.engines.registry import engine_spec, registered_engines

    return [k for k in registered_engines() if engine_spec(k).stage_weights]


def engine_model_dir(cfg: Config) -> Optional[str]:
    """The HF directory the rollout engine starts from: model.engine_hf_dir, else model.hf_config's directory."""
    path = cfg.model.engine_hf_dir or cfg.model.hf_config
    if path and os.path.isfile(path):
        path = os.path.dirname(path) or "."
    return path


def _engine_spec(r):
    """The registered spec of ``rollout.engine`` (None: an unknown kind, reported by ``RolloutCfg.errors``)."""
    from megatron_s3ac.rollout.engines.registry import engine_spec
    from megatron_s3ac.rollout.errors import ConfigError as EngineConfigError

    try:
        return engine_spec(r.engine)
    except EngineConfigError:
        return None


def _engine_errors(cfg: Config, world_size: Optional[int]) -> list[str]:
    """rollout.engine against the model (sglang cannot serve every model) and the kind's section against the GPUs
    (the kind's ``EngineSpec.check_model`` / ``check_cluster``)."""
    from megatron_s3ac.rollout.errors import ConfigError as EngineConfigError

    r = cfg.rollout
    spec = _engine_spec(r)
    if spec is None:
        return []
    tiny = None if cfg.model.tiny is None else TinyModel(cfg.model.tiny).value
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "0")) or None
    try:
        spec.check_model(engine_model_dir(cfg), tiny=tiny, key="rollout.engine")
        spec.check_cluster(spec.settings_of(r), cluster_gpus=cfg.cluster.gpus, trainer_gpus=world_size,
                           placement=Placement(r.placement).value)
    except EngineConfigError as e:
        return [str(e)]
    return []


def _layout_errors(cfg: Config, world_size: Optional[int]) -> list[str]:
    from megatron_s3ac.models.parallel import LayoutError

    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "0")) or None
    if world_size is None:
        return []
    info = model_info_for(cfg)
    out = []
    for name, lay in (("actor_layout", cfg.actor_layout), ("critic_layout", cfg.critic_layout or cfg.actor_layout)):
        try:
            layout_of(lay).validate(info, world_size)
        except LayoutError as e:
            out.append(f"{name}: {e}")
    return out


def layout_of(lay: LayoutCfg):
    from megatron_s3ac.models.parallel import ParallelLayout

    return ParallelLayout(tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=lay.etp, cp=lay.cp, cp_comm=lay.cp_comm,
                          first_stage_layers=lay.first_stage_layers,
                          last_stage_layers=lay.last_stage_layers)


def model_info_for(cfg: Config):
    from megatron_s3ac.models.registry import model_info

    if cfg.model.tiny is not None:
        from megatron_s3ac.tasks import tiny_hf_config

        return model_info(tiny_hf_config(cfg.data).to_dict())
    return model_info(cfg.model.hf_config)

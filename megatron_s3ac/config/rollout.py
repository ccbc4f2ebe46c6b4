"""The ``rollout`` section (its engines' own sections: ``rollout.sglang``, ``rollout.vllm``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional
from megatron_s3ac.rollout.engines.sglang.settings import SGLangSettings
from megatron_s3ac.rollout.engines.vllm.settings import VLLMSettings
from megatron_s3ac.config.enums import Placement, WeightsDtype


@dataclass
class RolloutSyncCfg:
    """``rollout.sync``: how the weight sync of the asynchronous loop meets the engine's generation."""

    # true: the next version's buckets go into a staging copy on the engine while it still generates the batches in
    # flight on the current one; the copy is swapped in between two generate calls (docs/trainer.md "Asynchronous
    # rollout"). Needs train.max_staleness >= 1 and an engine whose EngineSpec.stage_weights is true (cpu / hf at
    # rollout.placement=separate, vllm); costs a second copy of the engine's weights. false: the sync waits for the
    # batches in flight, then loads (today's loop, unchanged)
    overlap: bool = False


@dataclass
class RolloutLengthTailCfg:
    """``rollout.length_tail``: long-tailed response lengths by design (rollout/lengths.py; a benchmark workload,
    bench/bench_async.py --long-tail). long_frac 0 (default): off, every response may run to max_new_tokens."""

    # a fraction long_frac of the responses has the budget max_new_tokens, the rest uniform on [short_min, short_max];
    # each is decoded to its budget (ignore_eos), so the lengths are the design's; salt: another draw of the design
    long_frac: float = 0.0
    short_min: int = 1
    short_max: int = 1
    salt: int = 0


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
    # CUDA is present; sglang: sglang==0.5.23 engines (rollout.sglang; docs/rollout.md); vllm (rollout.vllm). A string
    # checked against the engine registry (rollout.engines.registry), so a registered kind is accepted too
    engine: str = "cpu"
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
    # partial rollout (train.max_staleness > 0; rollout/partial.py, docs/rollout.md "Partial rollout"): at each
    # weight sync the engine is paused instead of waited for; unfinished responses keep their tokens and resume on
    # the new weights, each token tagged with its weights version. Off: today's bounded-staleness loop, unchanged.
    # Engines: cpu / hf (CPUEngine), sglang (SGLangEngine in a pausable EnginePool) and vllm (one engine: AsyncLLM).
    partial_rollout: bool = False
    # a response spanning this many weights versions is not resumed again: its partial tokens are dropped and it is
    # regenerated from its prompt on the new weights (async/partial_regenerated); 1 = never resume
    partial_max_versions: int = 2
    sync: RolloutSyncCfg = field(default_factory=RolloutSyncCfg)
    length_tail: RolloutLengthTailCfg = field(default_factory=RolloutLengthTailCfg)

    def errors(self) -> list[str]:
        out = []
        lt = self.length_tail
        if lt.long_frac:
            from megatron_s3ac.rollout.lengths import ENGINES, check_tail

            try:
                check_tail((lt.long_frac, lt.short_min, lt.short_max, lt.salt), self.max_new_tokens)
            except ValueError as e:
                out.append(f"rollout.{e}")
            if self.engine not in ENGINES:
                out.append(f"rollout.length_tail: the engine {self.engine!r} does not apply per-response budgets "
                           f"(engines: {', '.join(ENGINES)})")
        if self.max_engine_restarts < 0:
            out.append(f"rollout.max_engine_restarts={self.max_engine_restarts} must be >= 0")
        if isinstance(self.partial_max_versions, bool) or self.partial_max_versions < 1:
            out.append(f"rollout.partial_max_versions={self.partial_max_versions} must be an integer >= 1")
        from megatron_s3ac.rollout.engines.registry import engine_spec
        from megatron_s3ac.rollout.errors import ConfigError as EngineConfigError

        try:  # the kind's own section, checked by the kind (rollout.sglang, rollout.vllm, ...)
            spec = engine_spec(self.engine)
            spec.check_settings(spec.settings_of(self))
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

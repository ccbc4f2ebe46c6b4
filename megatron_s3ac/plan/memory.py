"""The memory model: bytes per GPU for each phase of an S3AC step, per pipeline stage.

Inputs: a model (``ModelInfo``), the actor's and critic's ``ParallelLayout``, a ``Cluster``, a
``Workload`` and the trainer's ``Knobs``. Output: an ``Estimate`` with, per stage, the model states,
activations, logits and the five phase peaks (rollout, forward-only, actor update, critic update,
weight sync), the engine's capacity and the host memory per node. Every formula is in docs/planner.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from megatron_s3ac.models.registry import ModelInfo
from megatron_s3ac.plan import constants as C
from megatron_s3ac.plan.params import StageParams, rank_params, total_params, vision_config, vision_params

PHASES = ("rollout", "forward", "actor_update", "critic_update", "weight_sync")
# the phases of model-state residency (residency()): "forward" is the critic's values, then the actor's old log-probs
RESIDENCY_PHASES = ("rollout", "values", "old_logprobs", "actor_update", "critic_update", "weight_sync")


@dataclass
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    gpu_mem_gib: float = 141.0  # H200
    host_mem_gib: float = 2048.0  # per node


@dataclass
class Workload:
    prompt_len: int = 2048
    response_len: int = 16384
    prompts_per_step: int = 32
    k: int = 8
    actor_minibatches: int = 8
    critic_minibatches: int = 8
    actor_epochs: int = 1
    critic_epochs: int = 2
    micro_batch_size: int = 1  # rows per micro-batch (0 = the whole mini-batch of the rank)
    max_tokens_per_micro_batch: int = 0  # > 0: packed micro-batches of at most this many tokens
    image_tokens: int = 0  # image placeholder tokens per prompt, on top of prompt_len (vision-language models)
    # the critic's privileged block per sequence (model.critic_privileged_max_tokens): the critic's sequences only
    critic_extra_tokens: int = 0

    @property
    def seq_len(self) -> int:
        """Tokens per sequence: the prompt's text and image tokens (the decoder and the engine's KV hold both) +
        the response."""
        return self.prompt_len + self.image_tokens + self.response_len

    @property
    def sequences(self) -> int:
        return self.prompts_per_step * self.k


def critic_block_tokens(cfg) -> int:
    """The critic's privileged block bound of a trainer config (a dict or the schema):
    ``model.critic_privileged_max_tokens``, 0 without a privileged critic. The trainer refuses a longer block, so the
    planner's critic sequences are an upper bound."""
    model = None if cfg is None else (cfg.get("model") if isinstance(cfg, dict) else getattr(cfg, "model", None))
    if model is None:
        return 0
    get = model.get if isinstance(model, dict) else (lambda k, d=None: getattr(model, k, d))
    mode = get("critic_privileged", "none")
    mode = getattr(mode, "value", mode)
    return 0 if mode in (None, "none") else int(get("critic_privileged_max_tokens", 64) or 64)


@dataclass
class Knobs:
    dtype: str = "bf16"  # parameter / activation dtype: bf16 (fp32 main grads + Adam) or fp32
    recompute: str = "none"  # none | selective | full
    optimizer_offload: float = 0.0  # fraction of the optimizer states (main params + moments) on the host
    precision_aware: bool = False  # bf16 Adam moments (TE FusedAdam), fp32 main params
    offload_idle: bool = False  # an idle model's states live on the host (rollout, the other model's update)
    critic: bool = True
    placement: str = "colocated"  # colocated | separate | none
    engine_gpus: int = 0  # separate: GPUs of all engines (0 = as many as training); colocated: all
    engine_tp: int = 0  # GPUs per engine (0 = smallest that fits)
    engine_ep: int = 0  # expert parallel inside an engine (0 = engine_tp)
    engine_attn_dp: int = 1  # SGLang attention data parallel inside an engine
    engine_mem_fraction: float = 0.0  # SGLang mem_fraction_static (0 = what is left after training)
    logprob_chunk: int = 0  # tokens per log-prob / entropy chunk (0 = the whole micro-batch at once)
    backend: str = "gpu"  # gpu: TE / flash / fla kernels; cpu: this project's torch spec (calibration)
    vision_trainable: bool = False  # the vision tower trains (grads + optimizer states); default frozen
    sync_bucket_mb: int = 512  # weight-sync bucket (rollout.<engine>.bucket_mb; plan.weight_sync)
    sync_fp8: bool = False  # block-FP8 weights on the wire (rollout.weights_dtype: fp8; plan.weight_sync)
    # rollout.sync.overlap: the engine holds a staging copy of its weights (the next version received while it
    # generates on the live one): its weights count twice against the KV pool
    sync_overlap: bool = False

    def validate(self) -> list[str]:
        errs = []
        if self.dtype not in C.DTYPE_BYTES:
            errs.append(f"dtype={self.dtype!r} must be one of {sorted(C.DTYPE_BYTES)}")
        if self.recompute not in ("none", "selective", "full"):
            errs.append(f"recompute={self.recompute!r} must be none, selective or full")
        if not 0.0 <= self.optimizer_offload <= 1.0:
            errs.append(f"optimizer_offload={self.optimizer_offload} must be in [0, 1]")
        if self.placement not in ("colocated", "separate", "none"):
            errs.append(f"placement={self.placement!r} must be colocated, separate or none")
        if not 0.0 <= self.engine_mem_fraction < 1.0:
            errs.append(f"engine_mem_fraction={self.engine_mem_fraction} must be in [0, 1)")
        if self.precision_aware and self.dtype != "bf16":
            errs.append("precision_aware optimizer needs dtype=bf16")
        if self.backend not in ("gpu", "cpu"):
            errs.append(f"backend={self.backend!r} must be gpu or cpu")
        if self.sync_bucket_mb < 1:
            errs.append(f"sync_bucket_mb={self.sync_bucket_mb} must be >= 1")
        for key in ("engine_gpus", "engine_tp", "engine_ep", "logprob_chunk"):
            if getattr(self, key) < 0:
                errs.append(f"{key}={getattr(self, key)} must be >= 0")
        if self.engine_attn_dp < 1:
            errs.append(f"engine_attn_dp={self.engine_attn_dp} must be >= 1")
        return errs


# ---- model states ------------------------------------------------------------------------------
def _pad(n: int, d: int) -> int:
    return -(-n // d) * d


def buffer_numel(numels: list[int], dp: int, shared_embedding: int = 0) -> int:
    """Elements of megatron's DDP param/grad buffer with the distributed optimizer
    (``param_and_grad_buffer.py``): every parameter starts 64-element aligned, a bucket ends on a
    multiple of lcm(DP, 128). One bucket (``overlap_grad_reduce=False``), plus its own bucket for a tied
    embedding shared across pipeline stages."""
    if not numels:
        return 0
    div = math.lcm(dp, 128)
    rest = list(numels)
    total = 0
    if shared_embedding:
        rest.remove(shared_embedding)
        total += _pad(shared_embedding, div)
    if rest:
        total += _pad(sum(_pad(n, 64) for n in rest[:-1]) + rest[-1], div)
    return total


@dataclass
class States:
    """Bytes of one rank's model states (one model)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0  # main params + moments, worst DP rank (padded share); GPU + host
    optimizer_dense_group: int = 0  # dense optimizer bytes summed over the DP group (exact: no padding)
    optimizer_expert_group: int = 0  # expert optimizer bytes summed over the expert-DP group (exact)
    optimizer_host: int = 0

    @property
    def gpu(self) -> int:
        return self.params + self.grads + self.optimizer - self.optimizer_host


def opt_bytes_per_elem(knobs: Knobs) -> int:
    """fp32 main params (bf16 only) + exp_avg + exp_avg_sq (fp32, or bf16 when precision-aware)."""
    if knobs.dtype == "fp32":
        return 8  # the fp32 params are their own main params
    return 4 + (4 if knobs.precision_aware else 8)


def add_vision(states: States, n: int, layout, world: int, knobs: Knobs, trainable: bool) -> States:
    """``states`` plus a vision tower of ``n`` parameters on this rank: replicated on every rank of the first
    pipeline stage (not sharded over TP / EP), in the model dtype; frozen (the critic's always, the actor's by
    default): no grads, no optimizer states; trainable: fp32 grads and the optimizer states sharded over DP like
    the dense parameters."""
    if not n:
        return states
    b = C.DTYPE_BYTES[knobs.dtype]
    states.params += n * b
    if trainable:
        dp = world // (layout.tp * layout.pp)
        ob = opt_bytes_per_elem(knobs)
        opt = -(-n // dp) * ob
        states.grads += n * 4
        states.optimizer += opt
        states.optimizer_dense_group += n * ob
        states.optimizer_host += int(round(opt * knobs.optimizer_offload))
    return states


def model_states(sp: StageParams, layout, world: int, knobs: Knobs) -> States:
    b = C.DTYPE_BYTES[knobs.dtype]
    dp = world // (layout.tp * layout.pp)  # DP x CP: megatron shards the optimizer over both
    edp = world // (layout.ep * layout.etp * layout.pp)
    dn = buffer_numel(sp.dense_numels, dp, sp.shared_embedding)
    en = buffer_numel(sp.expert_numels, edp)
    ob = opt_bytes_per_elem(knobs)
    opt = (dn // dp + en // edp) * ob
    return States(params=(dn + en) * b, grads=(dn + en) * 4, optimizer=opt,
                  optimizer_dense_group=sp.dense * ob, optimizer_expert_group=sp.expert * ob,
                  optimizer_host=int(round(opt * knobs.optimizer_offload)))


# ---- activations -------------------------------------------------------------------------------
@dataclass
class VisionAct:
    """The vision tower's bytes per patch (an image token is ``patches_per_token`` patches before the merger):
    ``saved`` = what autograd keeps for the backward of a trainable tower (frozen: nothing, no parameter or input
    requires a gradient); ``block`` = one block's share of it, the transient peak of a forward (frozen) or of
    a block's backward (trainable)."""

    saved: float
    block: float
    patches_per_token: int


def vision_activation(hf: dict, knobs: Knobs) -> VisionAct | None:
    """Bytes per patch of a Qwen3.5 / Qwen3-VL vision tower (transformers' ``Qwen3_5MoeVisionModel`` with SDPA, as
    models/vision.py runs it; counted from its saved tensors, docs/planner.md). Per block, with h / I / n_h the
    tower's width / MLP width / heads: LayerNorm inputs and outputs (4h), the qkv output (3h: q, k, v are views
    of it), the rotary-embedded q and k (2h), the attention output and the proj input (2h), the MLP's fc1 and GELU
    outputs (2I) in the model dtype, the attention's log-sum-exp (4 n_h) and the two LayerNorms' mean / rstd (the
    model dtype on CPU, fp32 on GPU); once: the patch embedding's input (C t p^2), the position embeddings'
    interpolation indices and weights (4 int64 + 4 fp32), the rotary cos / sin (2 x fp32 head_dim), the merger's
    LayerNorm input / output and fc1 / GELU outputs (4h per patch: h m^2 per merged token) and its mean / rstd."""
    v = vision_config(hf)
    if not v:
        return None
    b = C.DTYPE_BYTES[knobs.dtype]
    stat = b if knobs.backend == "cpu" else 4
    h, inter, nh, depth = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["num_heads"]), int(v["depth"])
    c, p, t, m = int(v.get("in_channels", 3)), int(v["patch_size"]), int(v.get("temporal_patch_size", 2)), \
        int(v.get("spatial_merge_size", 2))
    block = b * (11 * h + 2 * inter) + 4 * nh + 2 * 2 * stat
    once = c * t * p * p * b + 4 * 8 + 4 * 4 + 2 * (h // nh) * 4 + 4 * h * b + 2 * stat
    return VisionAct(saved=depth * block + once, block=block, patches_per_token=m * m)


def vision_activation_bytes(va: VisionAct | None, knobs: Knobs, trainable: bool, patches: int,
                            in_flight: int) -> tuple[float, float]:
    """(held, working) bytes of the tower on a first-stage rank: every rank of the stage runs the whole tower on its
    micro-batch's images (the tower is replicated, not TP / CP sharded), ``patches`` per micro-batch. Trainable:
    ``held`` = its saved activations for each micro-batch in flight (megatron's recompute covers the decoder's
    layers only, so ``--recompute`` does not reduce it); frozen: forward only, nothing held. ``working`` = one
    block's transient peak."""
    if va is None or not patches:
        return 0.0, 0.0
    held = va.saved * patches * in_flight if trainable else 0.0
    return held, va.block * patches
def _gdn_dims(info: ModelInfo) -> dict:
    from megatron_s3ac.models.qwen3_5 import text_config

    tc = text_config(info.hf)
    nk, nv = tc.get("linear_num_key_heads", 16), tc.get("linear_num_value_heads", 32)
    dk, dv = tc.get("linear_key_head_dim", 128), tc.get("linear_value_head_dim", 128)
    return dict(nk=nk, nv=nv, dk=dk, dv=dv, qk=nk * dk, v=nv * dv, K=tc.get("linear_conv_kernel_dim", 4))


def layer_kinds(info: ModelInfo) -> list[tuple[str, str]]:
    """(token mixer, MLP) of every layer: mixer in attention | gated_attention | gdn, MLP in dense | moe."""
    if info.model_type.startswith("qwen3_5_moe"):
        from megatron_s3ac.models.qwen3_5 import layer_types, text_config

        return [("gdn" if t == "linear_attention" else "gated_attention", "moe")
                for t in layer_types(text_config(info.hf))]
    moe = set(info.moe_layers)
    return [("attention", "moe" if i in moe else "dense") for i in range(info.num_layers)]


@dataclass
class LayerAct:
    """Bytes per token kept for backward by one layer on one rank (already divided by TP / SP),
    split in what selective recompute drops and what it keeps; ``working`` = transient peak inside it."""

    kept: float
    selective: float  # dropped (recomputed) under selective recompute
    working: float

    @property
    def saved(self) -> float:
        return self.kept + self.selective


def _norm(h: int, b: int, cpu: bool) -> float:
    """RMSNorm: TE keeps its input and output (+ fp32 rstd); the torch norm also keeps x_hat."""
    return (3 * h * b + 4) if cpu else (2 * h * b + 4)


def gdn_torch_kernel_bytes(nv: int, dk: int, dv: int, C: int = C.GDN_CHUNK) -> float:
    """Extra fp32 bytes per token that megatron's torch chunked delta rule (CPU / no fla) keeps: the
    [nv, C, C] chunk matrices, the row-by-row intra-chunk solve (sum_i (i^2 + i) / C per head) and the
    inter-chunk states (counted from the saved tensors of ``torch_chunk_gated_delta_rule``)."""
    intra = sum(i * i + i for i in range(1, C)) / C
    return 4 * (nv * (6 * C + intra + 4 * dk) + nv * dk * dv / C + 4 * dk + C)


def layer_activation(info: ModelInfo, mixer: str, mlp: str, layout, knobs: Knobs) -> LayerAct:
    """Saved-for-backward bytes per token of one layer. The element counts per token follow what the
    modules keep for backward: megatron-core with TE / flash-attention / fla kernels
    (``backend='gpu'``; counted from 0.16.1's modules, not re-derived for 0.19.2) or this project's torch
    spec (``backend='cpu'``, counted with ``saved_tensors_hooks`` in tests/plan). Under SP everything is sequence-sharded, so each rank keeps
    1/TP. Expert-side terms scale with the tokens routed to the rank (k x imbalance when EP > 1, x ETP
    with the FFN dim / ETP)."""
    b = C.DTYPE_BYTES[knobs.dtype]
    tp, ep, etp = layout.tp, layout.ep, layout.etp
    h, d, nh, ng = info.hidden_size, info.head_dim, info.num_heads, info.num_kv_heads
    cpu = knobs.backend == "cpu"
    kept = sel = 0.0
    # token mixer ----------------------------------------------------------------------------------
    if mixer in ("attention", "gated_attention"):
        q, kv = nh * d, ng * d
        gated = mixer == "gated_attention"
        qkv = (2 * q if gated else q) + 2 * kv  # the fused QKV(+gate) GEMM output
        kept += _norm(h, b, cpu)
        if info.qk_norm or gated:
            kept += qkv * b  # q/k-norm inputs are views of the QKV output: its storage stays
        if info.qk_norm:
            kept += (2 * q + kv) * b + 4 * (nh + ng) if cpu else 4 * (nh + ng)  # torch norm copies + rstd
        if cpu:
            kept += 4 * d * info.rotary_percent * b  # cos / sin of the unfused RoPE
            sel += (3 * q + q) * b + 4 * nh  # SDPA: q, k, v (expanded to the query heads), output, lse
        else:
            sel += (2 * q + 2 * kv) * b + 4 * nh  # flash: rope'd q, k, v, output (= proj input), lse
            if not (info.qk_norm or gated):
                sel -= kv * b  # v is a view of the QKV output, which is kept anyway
                kept += qkv * b
        if gated:
            kept += 2 * q * b  # sigmoid(gate) and the gated output (proj input)
        if layout.cp > 1 and cpu:
            # the torch path all-gathers K / V over CP: SDPA keeps the whole sequence's K / V (expanded to
            # the query heads) per local query token; TE's ring (GPU) re-sends K / V in its backward instead
            sel += (layout.cp - 1) * 2 * q * b
    elif mixer == "gdn":
        g = _gdn_dims(info)
        qk, v, nv = g["qk"], g["v"], g["nv"]
        conv = 2 * qk + v
        kept += _norm(h, b, cpu)
        kept += (conv + v + 2 * nv) * b  # in_proj output [qkv, z, beta, alpha]
        kept += 2 * conv * b  # causal-conv1d input copy and output
        kept += 2 * qk * b + 4 * (2 * nv + 2 * g["nk"])  # l2-normed q, k; fp32 decay g, beta, rstd
        if cpu:
            sel += gdn_torch_kernel_bytes(nv, g["dk"], g["dv"])
        else:
            sel += nv * C.GDN_CHUNK * b  # fla keeps the intra-chunk matrix A [nv, C] per token
        kept += 3 * v * b  # core output, SiLU(z), gated-norm output (out_proj input)
    else:
        raise ValueError(f"unknown mixer {mixer!r}")
    # MLP ----------------------------------------------------------------------------------------------
    kept += _norm(h, b, cpu)
    if mlp == "dense":
        F = info.ffn_hidden_size
        kept += 2 * F * b  # fc1 output [gate; up]
        sel += (3 if cpu else 1) * F * b  # SiLU(gate) (+ torch: up copy), product (fc2 input)
    else:
        E, k, Fe, S = info.num_experts, info.top_k, info.moe_ffn_hidden_size, info.shared_expert_size
        kept += (0 if cpu else h * 4) + 2 * E * 4 + 2 * k * 8 + k * 4  # fp32 router input, logits/probs, indices
        routed = k * (C.MOE_IMBALANCE if ep > 1 else 1.0) * etp
        fe = Fe // etp
        kept += routed * (h * b + 2 * fe * b)  # permuted input, fc1 output
        kept += routed * h * b if not cpu else 0  # fc2 output (kept by the probs-weighted unpermute)
        sel += routed * (4 if cpu else 1) * fe * b  # SiLU + product (megatron's moe_act recompute)
        if S:
            kept += 2 * S * b + h * b + 4  # shared fc1 output, shared output, sigmoid gate
            sel += (3 if cpu else 1) * S * b
    # working: the backward of one layer holds gradients about the size of its activations
    return LayerAct(kept=kept / tp, selective=sel / tp, working=(kept + sel) / tp)


def _micro_tokens(w: Workload, dp: int, minibatches: int) -> tuple[int, int]:
    """(tokens per micro-batch, micro-batches per mini-batch on a DP rank); a CP rank holds 1/cp of them."""
    rows = max(1, -(-w.sequences // (minibatches * dp)))
    if w.max_tokens_per_micro_batch:
        tok = max(w.max_tokens_per_micro_batch, w.seq_len)
        return tok, max(1, -(-rows * w.seq_len // tok))
    mbs = w.micro_batch_size or rows
    return mbs * w.seq_len, max(1, -(-rows // mbs))


@dataclass
class StageEstimate:
    stage: int
    layers: range
    params: StageParams
    critic_params: StageParams | None
    actor: States
    critic: States | None
    act_actor: float = 0.0  # bytes of saved activations at the 1F1B peak (micro-batches in flight)
    act_critic: float = 0.0
    working: float = 0.0
    logits_train: float = 0.0
    logits_forward: float = 0.0
    phases: dict = field(default_factory=dict)  # phase -> bytes
    resident: dict = field(default_factory=dict)  # phase -> {"actor" | "critic": {kind: bytes}} (residency())


@dataclass
class Engine:
    tp: int = 0
    ep: int = 0
    attn_dp: int = 1
    engines: int = 0
    gpus: int = 0
    weights: float = 0.0  # bytes per GPU
    staging: float = 0.0  # bytes per GPU: the second copy of the weights (rollout.sync.overlap), else 0
    kv_per_token: float = 0.0  # bytes per GPU
    state_per_seq: float = 0.0  # GDN recurrent + conv state, bytes per GPU
    mem_fraction: float = 0.0
    capacity: int = 0  # concurrent sequences at max length per engine
    needed: int = 0  # concurrent sequences per engine for the whole rollout batch at once
    peak: float = 0.0  # bytes per engine GPU (static pool + CUDA graphs)


@dataclass
class Estimate:
    layout: object
    critic_layout: object
    cluster: Cluster
    workload: Workload
    knobs: Knobs
    train_gpus: int
    stages: list[StageEstimate]
    engine: Engine | None
    n_micro: int
    tokens_per_micro: int
    phases: dict  # phase -> (bytes, worst stage)
    peak: float
    host_per_node: float
    fits: bool
    problems: list[str]
    throughput: float  # tokens / s / GPU (proxy)

    @property
    def headroom(self) -> float:
        return self.cluster.gpu_mem_gib * C.GIB - self.peak


def activation_bytes(info: ModelInfo, layers: range, layout, knobs: Knobs, tokens: int, in_flight: int,
                     kinds) -> tuple[float, float, float]:
    """(held, rebuild, working) bytes of one stage at its 1F1B peak: ``held`` = what the micro-batches in
    flight keep between their forward and backward; ``rebuild`` = the one layer recomputed during a
    backward (full: all of it; selective: its recomputed part); ``working`` = the biggest layer's
    transient gradients."""
    acts = [layer_activation(info, *kinds[i], layout, knobs) for i in layers]
    if not acts:
        return 0.0, 0.0, 0.0
    b = C.DTYPE_BYTES[knobs.dtype]
    working = max(a.working for a in acts) * tokens
    if knobs.recompute == "full":
        # each layer keeps only its input (sequence-sharded); one layer is rebuilt during its backward
        held = len(acts) * info.hidden_size * b / layout.tp * tokens * in_flight
        return held, max(a.saved for a in acts) * tokens, working
    if knobs.recompute == "selective":
        return sum(a.kept for a in acts) * tokens * in_flight, max(a.selective for a in acts) * tokens, working
    return sum(a.saved for a in acts) * tokens * in_flight, 0.0, working


def logits_bytes(tokens: int, vocab_local: float, knobs: Knobs, chunk: int) -> tuple[float, float, float]:
    """(held after the forward, training peak, forward-only peak) of the last stage's logits [tokens, V/TP]:
    the model-dtype logits, the fp32 copies of models/logprobs.py (bounded by a chunk when chunked), and
    in the backward the logits' gradient."""
    b = C.DTYPE_BYTES[knobs.dtype]
    fp32 = chunk * vocab_local * 4
    held = tokens * vocab_local * b + fp32 * C.LOGIT_FP32_COPIES_TRAIN
    return held, held + tokens * vocab_local * b, tokens * vocab_local * b + fp32 * C.LOGIT_FP32_COPIES_FORWARD


def engine_estimate(info: ModelInfo, cluster: Cluster, w: Workload, knobs: Knobs, train_gpus: int,
                    resident: float) -> Engine | None:
    """The rollout engine per GPU: bf16 weights, KV of the attention layers, GDN state per request."""
    if knobs.placement == "none":
        return None
    gpu = cluster.gpu_mem_gib * C.GIB
    total, expert = total_params(info)
    dense = total - expert
    vision = vision_params(info.hf)
    kinds = layer_kinds(info)
    n_attn = sum(1 for m, _ in kinds if m != "gdn")
    n_gdn = len(kinds) - n_attn
    # without a configured mem_fraction_static the engine may grow its pool up to (1 - SAFE_HEADROOM) of the GPU
    usable = (1 - C.SAFE_HEADROOM) * gpu
    if knobs.placement == "separate":
        gpus = knobs.engine_gpus or train_gpus
        avail = usable - (C.CUDA_CONTEXT_GIB + C.ENGINE_CUDA_GRAPH_GIB) * C.GIB
    else:
        gpus = train_gpus
        avail = usable - resident - (C.ENGINE_CUDA_GRAPH_GIB * C.GIB)
    # capacity at the configured mem_fraction_static, or at the most the GPU leaves (at most 0.9 of it)
    frac_cap = knobs.engine_mem_fraction * gpu if knobs.engine_mem_fraction else min(avail, 0.9 * gpu)

    def build(tp: int) -> Engine:
        ep = knobs.engine_ep or (tp if info.is_moe else 1)
        a = knobs.engine_attn_dp
        shard = max(1, tp // a)
        weights = (dense / shard + expert / ep + vision) * 2  # the vision tower counted whole on every GPU
        kv_heads = max(1, info.num_kv_heads // shard)
        kv_tok = n_attn * 2 * kv_heads * info.head_dim * C.ENGINE_KV_BYTES
        state = 0.0
        if n_gdn:
            g = _gdn_dims(info)
            nv_loc = max(1, g["nv"] // shard)
            conv_loc = (2 * g["qk"] + g["v"]) / shard
            state = n_gdn * (nv_loc * g["dk"] * g["dv"] * C.ENGINE_SSM_STATE_BYTES + (g["K"] - 1) * conv_loc * 2)
        per_seq = w.seq_len * kv_tok + state
        staging = weights if knobs.sync_overlap else 0.0  # the next version's copy, beside the live one
        pool = frac_cap - weights - staging
        cap = int(a * max(0, pool) // per_seq) if pool > 0 else 0
        engines = max(1, gpus // tp)
        needed = -(-w.sequences // engines)
        # the pool the rollout uses: the whole batch at once when it fits, else what the fraction allows
        used = weights + staging + min(max(0.0, pool), -(-needed // a) * per_seq)
        frac = knobs.engine_mem_fraction * gpu if knobs.engine_mem_fraction else used
        return Engine(tp=tp, ep=ep, attn_dp=a, engines=engines, gpus=gpus, weights=weights, staging=staging,
                      kv_per_token=kv_tok,
                      state_per_seq=state, mem_fraction=frac / gpu, capacity=cap, needed=needed,
                      peak=frac + C.ENGINE_CUDA_GRAPH_GIB * C.GIB)

    if knobs.engine_tp:
        return build(knobs.engine_tp)
    tp = 1
    while tp < gpus and gpus % (tp * 2) == 0 and build(tp).capacity < 1:
        tp *= 2
    return build(tp)


def throughput_proxy(info: ModelInfo, layout, cluster: Cluster, w: Workload, knobs: Knobs, train_gpus: int,
                     n_micro: int) -> float:
    """Tokens per second per GPU of the training passes (a ranking proxy, not a prediction): GEMM FLOPs at
    ``GPU_TFLOPS`` x (1 + pipeline bubble) + TP (SP all-gather / reduce-scatter) and EP all-to-all bytes at
    NVLink or IB bandwidth."""
    total, expert = total_params(info)
    active = total - expert + (expert * info.top_k / info.num_experts if info.is_moe else 0)
    tokens = w.sequences * w.seq_len
    models = 2 if knobs.critic else 1
    passes = 3 * (w.actor_epochs + (w.critic_epochs if knobs.critic else 0)) + models  # fwd+bwd = 3 fwd
    if knobs.recompute == "full":
        passes += w.actor_epochs + (w.critic_epochs if knobs.critic else 0)
    flops = 2 * active * tokens * passes / train_gpus
    bubble = (layout.pp - 1) / (n_micro + layout.pp - 1)
    t = flops / (C.GPU_TFLOPS * 1e12) / (1 - bubble)
    b = C.DTYPE_BYTES[knobs.dtype]
    tok_rank = tokens / (train_gpus // layout.tp) * passes / 3 * 3  # tokens each TP group moves, fwd+bwd
    L = info.num_layers / layout.pp
    if layout.tp > 1:
        bw = C.NVLINK_GBPS if layout.tp <= cluster.gpus_per_node else C.IB_GBPS
        t += 4 * L * tok_rank * info.hidden_size * b * (layout.tp - 1) / layout.tp / layout.tp / (bw * 1e9)
    if info.is_moe and layout.ep > 1:
        bw = C.NVLINK_GBPS if layout.ep * layout.etp * layout.tp <= cluster.gpus_per_node else C.IB_GBPS
        n_moe = len(info.moe_layers) / layout.pp
        t += 2 * n_moe * tok_rank / layout.tp * info.top_k * info.hidden_size * b * (layout.ep - 1) / layout.ep / (bw * 1e9)
    if layout.cp > 1:
        t += cp_comm_bytes(info, layout, tok_rank, b) / (cp_bandwidth(layout, cluster) * 1e9)
    return tokens / t / train_gpus if t > 0 else 0.0


def _kinds(s: States | None, *which: str) -> dict:
    """{params, grads, optimizer} bytes of ``s`` on the GPU, 0 for the kinds not in ``which``."""
    full = {"params": s.params, "grads": s.grads, "optimizer": s.optimizer - s.optimizer_host} if s else {}
    return {k: (full.get(k, 0) if k in which else 0) for k in ("params", "grads", "optimizer")}


ALL_KINDS = ("params", "grads", "optimizer")


def residency(st: StageEstimate, knobs: Knobs, colocated: bool) -> dict:
    """{phase: {"actor" | "critic": {params, grads, optimizer: bytes}}} of model states on one GPU of the stage in
    each phase, as the trainer keeps them (trainer.step.trainer.step, trainer.step.engine_side). Without train.offload_idle
    everything stays. With it: nothing in the rollout (the engine generates); the critic's values, the actor's old
    log-probs and each update: their own model only; the weight sync, colocated: the actor's params only (the critic
    and the actor's grads and optimizer states leave before the engine wakes, the params before its KV cache does),
    separate: both (they stay between steps). docs/trainer.md "GPU residency"."""
    a, c = st.actor, st.critic
    both = {"actor": _kinds(a, *ALL_KINDS), "critic": _kinds(c, *ALL_KINDS)}
    if not knobs.offload_idle:
        return {ph: both for ph in RESIDENCY_PHASES}
    actor = {"actor": _kinds(a, *ALL_KINDS), "critic": _kinds(c)}
    critic = {"actor": _kinds(a), "critic": _kinds(c, *ALL_KINDS)}
    return {"rollout": {"actor": _kinds(a), "critic": _kinds(c)}, "values": critic, "old_logprobs": actor,
            "actor_update": actor, "critic_update": critic,
            "weight_sync": {"actor": _kinds(a, "params"), "critic": _kinds(c)} if colocated else both}


def pinned_bytes(nbytes: float) -> int:
    """Host bytes the offload of a model of ``nbytes`` pins: its one arena (models.offload.HostOffload), which torch's
    pinned allocator rounds up to a power of two (ATen/core/CachingHostAllocator.h:300-309 in torch 2.13)."""
    n = int(math.ceil(nbytes))
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def cp_bandwidth(layout, cluster: Cluster) -> float:
    """GB/s of the CP group: NVLink when the TP x CP ranks fit a node, else IB."""
    return C.NVLINK_GBPS if layout.tp * layout.cp <= cluster.gpus_per_node else C.IB_GBPS


def cp_comm_bytes(info: ModelInfo, layout, tok_rank: float, b: int) -> float:
    """Bytes one rank receives for context parallelism over ``tok_rank`` token-passes (forward = 1,
    forward + backward = 3, like the TP and EP terms; backward moves what forward did, so 2/3 of the
    token-passes are forward-and-backward volume per forward token). Per attention layer and local
    token: the other cp-1 ranks' K / V, 2 x kv_heads/tp x head_dim (forward all-gather; backward
    reduce-scatter of dK / dV; TE's p2p ring moves the same volume). Per GDN layer and local token:
    the two head-parallel all-to-alls send (cp-1)/cp of the in_proj output (2 qk + 2 v + 2 nv) / tp
    and of the core output v / tp (the same back in backward). docs/context_parallel.md."""
    cp, tp = layout.cp, layout.tp
    kinds = layer_kinds(info)
    n_attn = sum(1 for m, _ in kinds if m != "gdn") / layout.pp
    n_gdn = sum(1 for m, _ in kinds if m == "gdn") / layout.pp
    per_tok = n_attn * (cp - 1) * 2 * info.num_kv_heads * info.head_dim / tp
    if n_gdn:
        g = _gdn_dims(info)
        per_tok += n_gdn * (cp - 1) / cp * (2 * g["qk"] + 3 * g["v"] + 2 * g["nv"]) / tp
    return per_tok * b * tok_rank * 2 / 3


def estimate(info: ModelInfo, layout, cluster: Cluster, w: Workload, knobs: Knobs, critic_layout=None) -> Estimate:
    """The whole estimate for one layout (``layout`` validated by the caller)."""
    critic_layout = critic_layout or layout
    gib = C.GIB
    train_gpus = cluster.gpus
    if knobs.placement == "separate":
        train_gpus = cluster.gpus - (knobs.engine_gpus or cluster.gpus // 2)
    b = C.DTYPE_BYTES[knobs.dtype]
    kinds = layer_kinds(info)
    a_params = rank_params(info, layout)
    c_params = rank_params(info, critic_layout, critic=True) if knobs.critic else None
    dp = train_gpus // (layout.tp * layout.cp * layout.pp)
    tokens, n_micro = _micro_tokens(w, dp, w.actor_minibatches)
    c_dp = train_gpus // (critic_layout.tp * critic_layout.cp * critic_layout.pp)
    cw = replace(w, prompt_len=w.prompt_len + w.critic_extra_tokens)  # the critic reads its block too
    c_tokens, c_micro = _micro_tokens(cw, c_dp, w.critic_minibatches)
    # context parallel: each CP rank holds 1/cp of every micro-batch's tokens (its activations, logits and
    # log-prob / entropy buffers); the per-token outputs gathered over CP are a few bytes per token
    tokens_micro, c_tokens_micro = tokens, c_tokens
    tokens, c_tokens = -(-tokens // layout.cp), -(-c_tokens // critic_layout.cp)
    vis = vision_activation(info.hf, knobs) if w.image_tokens else None

    def patches(micro_tokens: int, seq_len: int = w.seq_len) -> int:  # the tower's patches in a micro-batch
        return (micro_tokens // seq_len) * w.image_tokens * vis.patches_per_token if vis is not None else 0

    fixed = (C.CUDA_CONTEXT_GIB + C.NCCL_GIB) * gib
    vocab_local = info.padded_vocab_size / layout.tp
    chunk = min(knobs.logprob_chunk, tokens) if knobs.logprob_chunk else tokens
    stages = []
    for p, sp in enumerate(a_params):
        st = StageEstimate(stage=p, layers=sp.layers, params=sp, critic_params=None,
                           actor=model_states(sp, layout, train_gpus, knobs), critic=None)
        if p == 0:  # the vision tower feeds the decoder's input: first stage
            add_vision(st.actor, vision_params(info.hf), layout, train_gpus, knobs, knobs.vision_trainable)
        in_flight = min(layout.pp - p, n_micro)
        held, rebuild, work_a = activation_bytes(info, sp.layers, layout, knobs, tokens, in_flight, kinds)
        st.act_actor = held + rebuild
        if p == 0:  # the tower's own activations (its patches, before the merger)
            v_held, v_work = vision_activation_bytes(vis, knobs, knobs.vision_trainable, patches(tokens_micro),
                                                     in_flight)
            st.act_actor += v_held
            work_a = max(work_a, v_work)
        work_c = 0.0
        if c_params is not None:
            # the critic's stage p on the same GPU (same PP size assumed when layouts differ: worst stage used)
            cp = c_params[min(p, len(c_params) - 1)]
            st.critic_params = cp
            st.critic = model_states(cp, critic_layout, train_gpus, knobs)
            if p == 0:  # the critic's tower is the actor's, always frozen (trainer/step/build.py build_critic)
                add_vision(st.critic, vision_params(info.hf), critic_layout, train_gpus, knobs, False)
            c_in = min(critic_layout.pp - min(p, critic_layout.pp - 1), c_micro)
            held, rebuild, work_c = activation_bytes(info, cp.layers, critic_layout, knobs, c_tokens, c_in, kinds)
            st.act_critic = held + rebuild
            if p == 0:
                work_c = max(work_c, vision_activation_bytes(vis, knobs, False, patches(c_tokens_micro, cw.seq_len),
                                                                     c_in)[1])
        st.working = max(work_a, work_c) + C.WORKSPACE_GIB * gib
        if p == len(a_params) - 1:
            _, st.logits_train, st.logits_forward = logits_bytes(tokens, vocab_local, knobs, chunk)
        stages.append(st)

    def dyn(x: float) -> float:  # dynamic allocations pay the fragmentation overhead
        return x * (1 + C.FRAGMENTATION)

    # rollout-phase residue of training on each GPU (what stays while the engine runs)
    def resident(st: StageEstimate, idle: bool) -> float:
        r = 0.0
        for s in (st.actor, st.critic):
            if s is not None and not idle:
                r += s.gpu
        return r

    worst_resident = max(resident(st, knobs.offload_idle) for st in stages) + fixed
    eng = engine_estimate(info, cluster, w, knobs, train_gpus, worst_resident)
    problems = []
    colo = eng is not None and knobs.placement == "colocated"
    for st in stages:
        st.resident = residency(st, knobs, colo)
        held = {ph: sum(b for kinds in r.values() for b in kinds.values()) for ph, r in st.resident.items()}
        ph = {}
        ph["rollout"] = held["rollout"] + fixed + (eng.peak if colo else 0.0)
        # the critic's values, then the actor's old log-probs (with logits)
        ph["forward"] = max(held["values"] + dyn(st.working),
                            held["old_logprobs"] + dyn(st.working + st.logits_forward)) + fixed
        ph["actor_update"] = held["actor_update"] + dyn(st.act_actor + st.working + st.logits_train) + fixed
        ph["critic_update"] = (held["critic_update"] + dyn(st.act_critic + st.working) + fixed) if st.critic else 0.0
        ph["weight_sync"] = (held["weight_sync"] + (eng.weights if colo else 0.0) + fixed
                             + C.WEIGHT_SYNC_BUCKET_GIB * gib)
        st.phases = ph
    phases = {}
    for name in PHASES:
        vals = [(st.phases[name], st.stage) for st in stages]
        phases[name] = max(vals)
    peak = max(v for v, _ in phases.values())
    gpu = cluster.gpu_mem_gib * gib
    for name, (v, s) in phases.items():
        if v > gpu:
            problems.append(f"{name} needs {v / gib:.1f} GiB on pipeline stage {s} > {cluster.gpu_mem_gib:g} GiB")
    if eng is not None:
        if eng.capacity < 1:
            problems.append(
                f"rollout engine (tp={eng.tp}) has no room for one {w.seq_len}-token sequence "
                f"(weights {eng.weights / gib:.1f} GiB/GPU, mem fraction {eng.mem_fraction:.2f})")
        if knobs.placement == "separate" and eng.peak + fixed > gpu:
            problems.append(f"engine GPUs need {(eng.peak + fixed) / gib:.1f} GiB > {cluster.gpu_mem_gib:g} GiB")
    # host memory per node: process RSS + offloaded optimizer share + idle-offloaded states (rollout: both)
    host_gpu = C.HOST_PROCESS_GIB_PER_GPU * gib
    worst = 0.0
    for st in stages:
        h = sum(s.optimizer_host for s in (st.actor, st.critic) if s is not None)
        if knobs.offload_idle:  # one pinned arena per model, rounded up to a power of two
            h += sum(pinned_bytes(s.gpu) for s in (st.actor, st.critic) if s is not None)
        worst = max(worst, h)
    per_node_gpus = min(cluster.gpus_per_node, train_gpus)
    host = per_node_gpus * (host_gpu + worst)
    if host > cluster.host_mem_gib * gib:
        problems.append(f"host memory {host / gib:.0f} GiB per node > {cluster.host_mem_gib:g} GiB")
    thr = throughput_proxy(info, layout, cluster, w, knobs, train_gpus, n_micro)
    return Estimate(layout=layout, critic_layout=critic_layout, cluster=cluster, workload=w, knobs=knobs,
                    train_gpus=train_gpus, stages=stages, engine=eng, n_micro=n_micro, tokens_per_micro=tokens_micro,
                    phases=phases, peak=peak, host_per_node=host, fits=not problems, problems=problems,
                    throughput=thr)

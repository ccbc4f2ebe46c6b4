"""Qwen3.5-MoE (the Intern-S2 397B / 35B architecture) on megatron-core 0.19.2.

HF model_types: ``qwen3_5_moe`` (``Qwen3_5MoeForConditionalGeneration`` checkpoints; the language model
is the ``text_config``, HF tensors under ``model.language_model.``) and ``qwen3_5_moe_text``
(``Qwen3_5MoeForCausalLM``, tensors under ``model.``). The language model is megatron's; the vision tower
(transformers' module, models/vision.py) is built from the tensors the checkpoint carries
(convert/carried.py) and feeds the decoder input at the image tokens; the MTP head is carried as is, and
asking for MTP layers raises.

What the architecture needs from megatron-core, and where it comes from:
  * hybrid layers from ``layer_types`` (or ``full_attention_interval``): ``linear_attention`` ->
    megatron's Gated DeltaNet (the package ``megatron/core/ssm/gated_delta_net/``), ``full_attention`` ->
    SelfAttention with ``attention_output_gate`` (per-head sigmoid gate, HF's [q, gate] per head);
    megatron's config fields ``experimental_attention_variant='gated_delta_net'`` and
    ``linear_attention_freq`` (a 1/0 list) record the pattern (and make checkpoints per-layer);
  * zero-centred RMSNorm ``x * (1 + w)`` for the input / pre-MLP / q / k / final norms:
    ``layernorm_zero_centered_gamma`` (checkpoint weights equal HF's); the GDN output norm is a plain
    gated RMSNorm ``w * x`` in HF and is kept plain here (checkpoint ``out_norm.weight`` == HF
    ``linear_attn.norm.weight``, no +-1: our converter copies bytes. NB Megatron-Bridge's checkpoints
    store ``w - 1`` for it, because TE's norm is zero-centred there);
  * MoE on every layer: softmax top-k router with renormalised top-k, shared expert with a sigmoid
    gate (``moe_shared_expert_gate``);
  * partial RoPE (``rotary_percent``) as Qwen3.5's interleaved mRoPE (``mrope_section``, models/vision.py:
    ``InterleavedMRoPE`` replaces megatron's rotary module in ``finish_model``): 3-D positions for image
    tokens, and for text (all three axes the text position) exactly 1-D RoPE.

Kernels: without flash-linear-attention (CPU, or a GPU without fla) the GDN runs megatron's own torch
``torch_chunk_gated_delta_rule`` (``cpu_compat.patch_missing_fla``). Under bf16 the GDN core (q/k
l2norm, decay ``-exp(A_log) * softplus(.)``, chunked recurrence) is computed in fp32 and only its output
is cast back, as in transformers and fla (bit-identical to before in fp32). megatron-core's GDN
(0.19.2, ``gated_delta_net/gdn.py:64-278``) ignores the attention mask, so packed sequences and left
padding are refused (``TorchGatedDeltaNet``).
Context parallel: the gated attention all-gathers K/V like every attention layer here, the GDN runs a
head-parallel all-to-all, megatron's own (``gated_delta_net/gdn.py:134-164``; docs/context_parallel.md).
The megatron modules and layer specs are in ``qwen3_5_spec.py`` (imported when a model is built).
"""
from __future__ import annotations

from typing import Any

from megatron_s3ac.models.registry import Arch, ModelInfo, UnsupportedModelError, _rope, pad_vocab, register

HF_PREFIX = {"qwen3_5_moe": "model.language_model.", "qwen3_5_moe_text": "model."}
# HF expert layout the converter reads/writes: published Qwen3.5 / Intern-S2 checkpoints store fused
# experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]); transformers 5.x
# ``save_pretrained`` writes one tensor per expert and projection. Read from the checkpoint's tensor
# names when a config is loaded from its directory (``Qwen35Moe.from_checkpoint``); this config key
# overrides, and chooses the layout mcore-to-hf writes.
EXPERT_LAYOUT_KEY = "s3ac_hf_experts"
EXPERT_LAYOUTS = ("fused", "per_expert")


def text_config(cfg: dict) -> dict:
    """The language-model part of an HF config dict (``text_config`` of a ConditionalGeneration one)."""
    if cfg.get("model_type") == "qwen3_5_moe":
        if not isinstance(cfg.get("text_config"), dict):
            raise UnsupportedModelError("qwen3_5_moe config has no text_config")
        return cfg["text_config"]
    return cfg


def layer_types(tc: dict) -> list[str]:
    n = tc["num_hidden_layers"]
    types = tc.get("layer_types")
    if types is None:
        interval = tc.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if len(types) != n:
        raise UnsupportedModelError(f"layer_types has {len(types)} entries for {n} layers")
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    if bad:
        raise UnsupportedModelError(f"layer type(s) {bad} are not supported (only linear_attention, full_attention)")
    return list(types)


def rope(tc: dict) -> tuple[float, float]:
    """(theta, rotary_percent) as transformers derives them: Qwen3.5 defaults partial_rotary_factor
    to 0.25 when a config does not give it."""
    rp = dict(tc.get("rope_parameters") or {})
    if "partial_rotary_factor" not in rp and "partial_rotary_factor" not in tc:
        tc = {**tc, "partial_rotary_factor": 0.25}
    for key in ("mrope_section", "mrope_interleaved"):
        rp.pop(key, None)  # text positions: mRoPE == 1-D RoPE
    return _rope({**tc, "rope_parameters": rp})


def mrope_section(tc: dict, n_freq: int) -> list[int]:
    """The interleaved mRoPE sections (T, H, W frequencies; transformers' default [11, 11, 10]). A config
    without one whose rotary frequencies differ from 32 (a text-only model) uses T for every frequency,
    which is 1-D RoPE."""
    rp = tc.get("rope_parameters") or {}
    sec = rp.get("mrope_section", tc.get("mrope_section"))
    if sec is None:
        sec = [11, 11, 10] if n_freq == 32 else [n_freq, 0, 0]
    sec = [int(x) for x in sec]
    # transformers reads only H and W (frequencies 1, 4, .. < 3 * H and 2, 5, .. < 3 * W; T elsewhere:
    # Qwen3_5MoeTextRotaryEmbedding.recomposition_frequencies), so sections need not sum to n_freq
    if len(sec) != 3 or min(sec) < 0:
        raise UnsupportedModelError(f"mrope_section {sec} must be 3 non-negative sections (T, H, W) of the {n_freq} "
                                    "rotary frequencies (head_dim * partial_rotary_factor / 2)")
    return sec


def expert_layout(cfg: dict) -> str:
    lay = cfg.get(EXPERT_LAYOUT_KEY, "fused")
    if lay not in EXPERT_LAYOUTS:
        raise UnsupportedModelError(f"{EXPERT_LAYOUT_KEY}={lay!r}: must be one of {EXPERT_LAYOUTS}")
    return lay


@register
class Qwen35Moe(Arch):
    """Qwen3.5-MoE language model: GDN + gated attention hybrid, MoE with a gated shared expert."""

    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")
    required_keys = ()  # every size has a default (the released model's)
    qk_norm = True

    def from_checkpoint(self, cfg: dict, hf_dir: str) -> dict:
        """The expert layout from the tensor names (``mlp.experts.0.`` = per expert), unless set."""
        if EXPERT_LAYOUT_KEY in cfg:
            return cfg
        from megatron_s3ac.models.registry import checkpoint_tensor_names

        if any(".mlp.experts.0." in n for n in checkpoint_tensor_names(hf_dir)):
            cfg = dict(cfg, **{EXPERT_LAYOUT_KEY: "per_expert"})
        return cfg

    def check(self, cfg: dict) -> None:
        tc = text_config(cfg)
        super().check(tc)
        if tc.get("attention_bias"):
            raise UnsupportedModelError("qwen3_5_moe with attention_bias=true is not supported")
        layer_types(tc)
        expert_layout(cfg)
        nk, nv = tc.get("linear_num_key_heads", 16), tc.get("linear_num_value_heads", 32)
        if nv % nk:
            raise UnsupportedModelError(f"linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}")

    def info(self, cfg: dict) -> ModelInfo:
        self.check(cfg)
        tc = text_config(cfg)
        heads = tc.get("num_attention_heads", 16)
        theta, partial = rope(tc)
        n = tc.get("num_hidden_layers", 40)
        return ModelInfo(
            model_type=cfg["model_type"], hf=cfg, num_layers=n, hidden_size=tc.get("hidden_size", 2048),
            ffn_hidden_size=0, num_heads=heads, num_kv_heads=tc.get("num_key_value_heads", 2),
            head_dim=tc.get("head_dim", 256), vocab_size=tc.get("vocab_size", 248320),
            padded_vocab_size=pad_vocab(tc.get("vocab_size", 248320)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))),
            rms_eps=tc.get("rms_norm_eps", 1e-6), rope_theta=theta, rotary_percent=partial,
            max_position_embeddings=tc.get("max_position_embeddings", 32768), qkv_bias=False, qk_norm=True,
            init_std=tc.get("initializer_range", 0.02),
            num_experts=tc.get("num_experts", 256), top_k=tc.get("num_experts_per_tok", 8),
            moe_ffn_hidden_size=tc.get("moe_intermediate_size", 512), norm_topk_prob=True,
            shared_expert_size=tc.get("shared_expert_intermediate_size", 512) or 0,
            moe_layers=list(range(n)))

    def transformer_config_kwargs(self, info: ModelInfo) -> dict[str, Any]:
        tc = text_config(info.hf)
        kw = super().transformer_config_kwargs(info)
        kw.update(
            layernorm_zero_centered_gamma=True,
            attention_output_gate=True,
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=[1 if t == "linear_attention" else 0 for t in layer_types(tc)],
            linear_conv_kernel_dim=tc.get("linear_conv_kernel_dim", 4),
            linear_key_head_dim=tc.get("linear_key_head_dim", 128),
            linear_value_head_dim=tc.get("linear_value_head_dim", 128),
            linear_num_key_heads=tc.get("linear_num_key_heads", 16),
            linear_num_value_heads=tc.get("linear_num_value_heads", 32),
        )
        return kw

    def finish_model(self, gpt, info: ModelInfo) -> None:
        """Interleaved mRoPE in place of megatron's 1-D rotary module (same frequencies); GPTModel's
        ``mrope`` branch then passes it the position ids ([b, s] text or [3, b, s], models.pipeline)."""
        from megatron_s3ac.models.vision import InterleavedMRoPE

        old = getattr(gpt, "rotary_pos_emb", None)
        if old is None:
            return
        sec = mrope_section(text_config(info.hf), old.inv_freq.numel())
        gpt.rotary_pos_emb = InterleavedMRoPE(old.inv_freq, sec)
        gpt.position_embedding_type = "mrope"
        gpt.mrope_section = sec

    def context_parallel_error(self, info: ModelInfo, layout) -> str | None:
        """The GDN's head-parallel all-to-all gives every CP rank 1/cp of each TP rank's heads."""
        tc = text_config(info.hf)
        for name, default in (("linear_num_key_heads", 16), ("linear_num_value_heads", 32)):
            n = tc.get(name, default)
            if n % (layout.tp * layout.cp):
                return (f"{name} {n} is not divisible by tp*cp = {layout.tp}*{layout.cp} (the Gated DeltaNet "
                        "splits its heads over CP ranks)")
        return None

    def block_spec(self, config, info: ModelInfo, use_te: bool | None, pp_rank: int | None = None):
        if getattr(config, "mtp_num_layers", None):
            raise UnsupportedModelError(
                "qwen3_5_moe MTP layers are not supported (mtp_num_layers must be unset): the converter "
                "drops the mtp.* tensors and the model is built without the MTP head")
        from megatron_s3ac.models.qwen3_5_spec import qwen3_5_block_spec
        from megatron_s3ac.models.specs import have_transformer_engine

        if use_te is None:  # as every other architecture: TE's kernels wherever TE and CUDA are (what s3ac-plan costs)
            use_te = have_transformer_engine()
        return qwen3_5_block_spec(config, use_te=bool(use_te), pp_rank=pp_rank)

"""Model registry: an HF ``config.json`` -> megatron-core ``TransformerConfig`` + layer spec.

Each architecture is one ``Arch`` subclass registered under its HF ``model_type``. Adding an
architecture (e.g. ``qwen3_5_moe``) means adding a class; the others are untouched. An unsupported
model_type or feature raises ``UnsupportedModelError`` naming it.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar


class UnsupportedModelError(ValueError):
    """The HF config names an architecture or a feature this project does not implement."""


class HFConfigError(UnsupportedModelError):
    """config.json is not a readable JSON object, or a field the architecture reads is missing or of the wrong
    type; the message names the file and the key. A subclass so that every caller refusing an unusable config
    (``except UnsupportedModelError``) refuses this one too."""


VOCAB_DIVISOR = 128  # padded vocab is a multiple of this, independent of TP, so checkpoints reshard freely


@dataclass
class ModelInfo:
    """Architecture facts read once from the HF config; everything downstream uses these."""

    model_type: str
    hf: dict  # the (text) config.json as a dict
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tie_embeddings: bool
    rms_eps: float
    rope_theta: float
    rotary_percent: float
    max_position_embeddings: int
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    top_k: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_size: int = 0
    moe_layers: list[int] = field(default_factory=list)  # global indices of MoE layers
    init_std: float = 0.02

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


_REGISTRY: dict[str, "Arch"] = {}


def register(cls):
    """Class decorator: register an Arch under each of its ``model_types``."""
    inst = cls()
    for mt in cls.model_types:
        _REGISTRY[mt] = inst
    return cls


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def get_arch(model_type: str) -> "Arch":
    if model_type not in _REGISTRY:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}")
    return _REGISTRY[model_type]


def read_config_json(path: str) -> dict:
    """config.json as a dict: FileNotFoundError if absent, HFConfigError naming ``path`` if it is not a JSON object."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no HF config at {path}")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise HFConfigError(f"{path}: not a JSON config ({e})") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{path}: the config must be a JSON object, got a {type(cfg).__name__}")
    return cfg


def load_hf_config(src: str | os.PathLike | dict) -> dict:
    """Read an HF config (directory, config.json path or dict). Multimodal configs yield their text part."""
    if isinstance(src, dict):
        cfg = dict(src)
    else:
        path = os.path.join(src, "config.json") if os.path.isdir(src) else str(src)
        cfg = read_config_json(path)
    check_config_types(cfg, path if not isinstance(src, dict) else "config")
    if not isinstance(src, dict) and os.path.isdir(src):
        cfg = get_arch(cfg["model_type"]).from_checkpoint(cfg, str(src))
    return cfg


# JSON types of the config keys the architectures read; a value of another type (e.g. "hidden_size": "64") would
# fail deep inside with a TypeError, or build another model. None is accepted only where the reader means "absent".
_POSITIVE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_INTS = _POSITIVE + ("intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts",
                     "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                     "shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads")
_FLOATS = ("rms_norm_eps", "rope_theta", "partial_rotary_factor", "initializer_range")
_BOOLS = ("tie_word_embeddings", "attention_bias", "norm_topk_prob", "use_sliding_window")
_DICTS = ("rope_parameters", "rope_scaling")
_NULLABLE = frozenset(("head_dim", "decoder_sparse_step", "shared_expert_intermediate_size", "mlp_only_layers",
                       "tie_word_embeddings", "attention_bias", "use_sliding_window") + _DICTS)


def check_config_types(cfg: dict, where: str) -> None:
    """HFConfigError naming ``where`` (the file) and the key: ``model_type`` missing or not a string, a key the
    architecture requires (``Arch.required_keys``) missing, or a size / flag of the wrong JSON type (also in a
    ``text_config``), or the model_type is not supported."""
    mt = cfg.get("model_type")
    if mt is None:
        raise HFConfigError(f"{where}: the config has no model_type")
    if not isinstance(mt, str):
        raise HFConfigError(f"{where}: model_type must be a string, got {mt!r}")
    try:
        arch = get_arch(mt)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{where}: {e}") from None
    missing = [k for k in arch.required_keys if k not in cfg]
    if missing:
        raise HFConfigError(f"{where}: the {mt} config has no {', '.join(missing)}")
    tc = cfg.get("text_config")
    for prefix, c in [("", cfg)] + ([("text_config.", tc)] if isinstance(tc, dict) else []):
        for key, v in c.items():
            if v is None and key in _NULLABLE:
                continue
            want = ("a positive integer" if key in _POSITIVE and not (type(v) is int and v > 0) else
                    "a non-negative integer" if key in _INTS and not (type(v) is int and v >= 0) else
                    "a number" if key in _FLOATS and type(v) not in (int, float) else
                    "true or false" if key in _BOOLS and type(v) is not bool else
                    "an object" if key in _DICTS and not isinstance(v, dict) else
                    "a list of layer indices" if key == "mlp_only_layers" and not (
                        isinstance(v, list) and all(type(i) is int for i in v)) else None)
            if want:
                raise HFConfigError(f"{where}: {prefix}{key} must be {want}, got {v!r} ({type(v).__name__})")


def checkpoint_tensor_names(hf_dir: str) -> list[str]:
    """Tensor names of an HF safetensors checkpoint, from its index or the files' headers (no data read)."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                return list(json.load(f).get("weight_map", {}))
        except (ValueError, UnicodeDecodeError, AttributeError):
            return []  # a broken index is reported by the reader that needs it (convert.safetensors_io)
    names = []
    for fn in sorted(os.listdir(hf_dir)):
        if fn.endswith(".safetensors"):
            with open(os.path.join(hf_dir, fn), "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n > 100 << 20:  # a corrupted header is reported by the reader that needs the data
                    continue
                try:
                    names += [k for k in json.loads(f.read(n)) if k != "__metadata__"]
                except ValueError:
                    continue
    return names


_POSITIVE_INTS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")


def model_info(src: str | os.PathLike | dict) -> ModelInfo:
    """UnsupportedModelError naming ``src`` (and the key) for a config of the wrong shape: missing or non-integer
    sizes would otherwise die deep in ``Arch.info`` (TypeError, ZeroDivisionError)."""
    cfg = load_hf_config(src)
    where = "config" if isinstance(src, dict) else os.fspath(src)
    try:
        arch = get_arch(cfg["model_type"])
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{where}: {err}") from None
    text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg  # a VL config's text part
    for key in _POSITIVE_INTS + _OPTIONAL_INTS:
        v = text.get(key)
        if v is None and key in _OPTIONAL_INTS:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if key == "intermediate_size" else 1):
            raise UnsupportedModelError(f"{where}: {key}={v!r} must be a positive integer")
    return arch.info(cfg)


def pad_vocab(vocab_size: int, divisor: int = VOCAB_DIVISOR) -> int:
    return int(math.ceil(vocab_size / divisor) * divisor)


def _rope(cfg: dict) -> tuple[float, float]:
    """(theta, rotary_percent) from transformers-5 ``rope_parameters`` or legacy top-level keys."""
    rp = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    rope_type = rp.get("rope_type") or rp.get("type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedModelError(f"RoPE scaling type {rope_type!r} is not supported (only 'default')")
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return float(theta), float(partial)


class Arch:
    """One HF architecture. Subclasses set the class flags and may override any step."""

    model_types: ClassVar[tuple[str, ...]] = ()
    # config keys ``info`` reads without a default (checked by ``check_config_types``, naming the file)
    required_keys: ClassVar[tuple[str, ...]] = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                "vocab_size")
    qk_norm: ClassVar[bool] = False

    def qkv_bias(self, cfg: dict) -> bool:
        return bool(cfg.get("attention_bias", False))

    def check(self, cfg: dict) -> None:
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention (use_sliding_window=true) is not supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu / SwiGLU)")

    def moe_fields(self, cfg: dict) -> dict:
        return {}

    def from_checkpoint(self, cfg: dict, hf_dir: str) -> dict:
        """Complete a config read from a checkpoint directory with facts only its files tell."""
        return cfg

    def info(self, cfg: dict) -> ModelInfo:
        self.check(cfg)
        heads = cfg["num_attention_heads"]
        theta, partial = _rope(cfg)
        vocab = cfg["vocab_size"]
        return ModelInfo(
            model_type=cfg["model_type"], hf=cfg,
            num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg.get("intermediate_size", 0), num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=vocab, padded_vocab_size=pad_vocab(vocab),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rms_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta, rotary_percent=partial,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            qkv_bias=self.qkv_bias(cfg), qk_norm=self.qk_norm,
            init_std=cfg.get("initializer_range", 0.02), **self.moe_fields(cfg))

    # ---- megatron side -------------------------------------------------------------------------
    def transformer_config_kwargs(self, info: ModelInfo) -> dict[str, Any]:
        import torch.nn.functional as F  # lazily: config reading (the converter CLI) needs no torch

        kw = dict(
            num_layers=info.num_layers, hidden_size=info.hidden_size,
            ffn_hidden_size=info.ffn_hidden_size or None,
            num_attention_heads=info.num_heads, num_query_groups=info.num_kv_heads,
            kv_channels=info.head_dim, normalization="RMSNorm", layernorm_epsilon=info.rms_eps,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            add_qkv_bias=info.qkv_bias, qk_layernorm=info.qk_norm,
            hidden_dropout=0.0, attention_dropout=0.0, init_method_std=info.init_std,
            bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        )
        if info.is_moe:
            pattern = [1 if i in set(info.moe_layers) else 0 for i in range(info.num_layers)]
            kw.update(
                num_moe_experts=info.num_experts, moe_router_topk=info.top_k,
                moe_ffn_hidden_size=info.moe_ffn_hidden_size, moe_layer_freq=pattern,
                # norm_topk_prob: softmax over the top-k logits == renormalised top-k of the full softmax
                moe_router_pre_softmax=not info.norm_topk_prob,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32",
                moe_permute_fusion=False,
            )
            if info.ffn_hidden_size == 0:
                kw["ffn_hidden_size"] = info.moe_ffn_hidden_size
            if info.shared_expert_size:
                kw.update(moe_shared_expert_intermediate_size=info.shared_expert_size,
                          moe_shared_expert_gate=True)
        return kw

    def context_parallel_error(self, info: ModelInfo, layout) -> str | None:
        """Why ``layout`` (cp > 1) cannot split this architecture's sequences, or None. Attention-only
        models take any cp (the core attention all-gathers K/V, models/context_parallel.py)."""
        return None

    def block_spec(self, config, info: ModelInfo, use_te: bool | None, pp_rank: int | None = None):
        from megatron_s3ac.models.specs import decoder_block_spec

        return decoder_block_spec(config, qk_layernorm=info.qk_norm, use_te=use_te, pp_rank=pp_rank)

    def finish_model(self, gpt, info: ModelInfo) -> None:
        """Adjust a freshly built GPTModel (actor, or critic backbone) for the architecture; default: nothing."""

    def gpt_model_kwargs(self, info: ModelInfo) -> dict[str, Any]:
        return dict(
            vocab_size=info.padded_vocab_size, max_sequence_length=info.max_position_embeddings,
            position_embedding_type="rope", rotary_base=int(info.rope_theta),
            rotary_percent=info.rotary_percent,
        )


@register
class Qwen2(Arch):
    """Qwen2 / Qwen2.5 / DeepSeek-R1-Distill-Qwen: q/k/v bias, no qk-norm."""

    model_types = ("qwen2",)

    def qkv_bias(self, cfg: dict) -> bool:
        return True  # Qwen2 always has q/k/v projection biases (no config flag)


@register
class Qwen3(Arch):
    """Qwen3 dense: per-head RMSNorm on q and k, no biases."""

    model_types = ("qwen3",)
    qk_norm = True


@register
class Qwen3Moe(Qwen3):
    """Qwen3-MoE: Qwen3 attention, top-k softmax router, no shared expert, optional dense layers."""

    model_types = ("qwen3_moe",)
    required_keys = Arch.required_keys + ("num_experts_per_tok", "moe_intermediate_size")

    def moe_fields(self, cfg: dict) -> dict:
        n = cfg.get("num_experts", cfg.get("num_local_experts", 0))
        if not n:
            raise UnsupportedModelError("qwen3_moe config has no num_experts")
        step = cfg.get("decoder_sparse_step", 1) or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        layers = [i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0]
        return dict(num_experts=n, top_k=cfg["num_experts_per_tok"],
                    moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                    shared_expert_size=cfg.get("shared_expert_intermediate_size", 0) or 0,
                    moe_layers=layers)


def dtype_flags(dtype) -> dict[str, Any]:
    import torch

    if dtype == torch.float32:
        return dict(params_dtype=torch.float32)
    if dtype == torch.bfloat16:
        return dict(params_dtype=torch.bfloat16, bf16=True)
    if dtype == torch.float16:
        return dict(params_dtype=torch.float16, fp16=True)
    raise ValueError(f"unsupported dtype {dtype}")

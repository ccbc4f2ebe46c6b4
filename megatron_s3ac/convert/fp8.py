"""Block-scaled FP8 (e4m3) weights as SGLang 0.5.23 serves them: quantize, dequantize, name rules.

Format (SGLang ``Fp8Config`` with ``weight_block_size: [128, 128]``, see docs/fp8.md for file:line):
a weight ``W`` [N, K] (or [E, N, K] for a fused expert tensor) is stored as ``name`` in
``float8_e4m3fn`` plus ``name + "_scale_inv"`` in float32 [ceil(N/128), ceil(K/128)] (leading axes
kept), and ``W ~= q * scale_inv`` block by block (SGLang ``block_quant_dequant``). ``scale_inv`` is
the block's amax / 448 (448 = largest e4m3fn value), so the largest element of a block maps to ±448;
an all-zero block gets ``scale_inv`` 1 (its values are 0 whatever the scale). Edge blocks of shapes
that are not multiples of 128 are partial (zero-padded for the amax only).

Which tensors are quantized: floating-point matrices named ``*.weight`` (2-D) and the fused expert
tensors ``*.experts.gate_up_proj`` / ``*.experts.down_proj`` (3-D, Qwen3.5-MoE's HF layout), unless a
``keep`` pattern names their module. Everything else (1-D norms, biases, A_log, dt_bias, the GDN
conv1d [C, 1, K], integer buffers) passes through unchanged. Patterns match module paths on dotted
boundaries, as SGLang's ``_module_path_match`` does: ``mlp.gate`` keeps ``model.layers.3.mlp.gate``
(the router) but not ``mlp.gate_proj``.

Why torch's float8 dtype and not nvidia-modelopt: modelopt 0.39's ``FP8QTensor.quantize`` is the same
amax/448 arithmetic in plain torch, but it divides by a zero scale on an all-zero block (NaN) and
importing it brings ninja/pulp/scipy/nvidia-ml-py into the CPU environment (docs/fp8.md).
"""
from __future__ import annotations

import math
import re
from typing import Iterable, Iterator, Sequence

import torch

BLOCK = (128, 128)
E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
SCALE_SUFFIX = "_scale_inv"

# Module-path patterns kept in bf16 by default, and why:
DEFAULT_KEEP: tuple[str, ...] = (
    "embed_tokens",        # an embedding lookup, not a GEMM (SGLang: VocabParallelEmbedding, never fp8)
    "lm_head",             # log-probs are read off it; SGLang's Fp8Config has no LM-head method
    "mlp.gate",            # MoE router: SGLang builds it with quant_config=None (qwen3_moe, qwen2_moe)
    "shared_expert_gate",  # [1, H] sigmoid gate of the shared expert (quant_config=None in SGLang)
    "in_proj_b",           # GDN beta/alpha gates: [num_v_heads, H], rows not a multiple of 128 and
    "in_proj_a",           #   kept bf16 by the official Qwen3.5 FP8 checkpoints (in_proj_ba bf16 path)
    "conv1d",              # GDN short convolution (quant_config=None in SGLang's qwen3_5)
    "visual",              # vision tower (outside the weight sync; never quantized here)
    "mtp",                 # multi-token-prediction head (SGLang loads it separately)
)

# SGLang loads these HF modules into one fused linear; all shards must share one precision
# (``is_layer_skipped`` raises otherwise) and each shard's rows must be a multiple of block_n.
FUSED_SHARDS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("in_proj_qkv", "in_proj_z"),
    ("in_proj_b", "in_proj_a"),
)
_FUSED_EXPERTS = re.compile(r"(^|\.)experts\.(gate_up_proj|down_proj)$")


class Fp8Error(ValueError):
    """A tensor that cannot be quantized / dequantized (non-finite values, bad scale shape, ...)."""


# ----------------------------------------------------------------------------------------------
# Which tensors
# ----------------------------------------------------------------------------------------------
def module_path_match(pattern: str, module: str) -> bool:
    """SGLang's ``_module_path_match``: ``pattern`` equals ``module``, prefixes it or appears inside
    it, always on dotted boundaries."""
    pattern, module = pattern.rstrip("."), module.rstrip(".")
    return module == pattern or module.startswith(pattern + ".") or f".{pattern}." in f".{module}."


def check_keep(keep: Sequence[str]) -> tuple[str, ...]:
    """Validate a keep list: a fused shard named alone would split one SGLang linear in two precisions."""
    keep = tuple(keep)
    for p in keep:
        if not isinstance(p, str) or not p.strip("."):
            raise Fp8Error(f"keep pattern {p!r} is not a module path")
        last = p.rstrip(".").split(".")[-1]
        for group in FUSED_SHARDS:
            if last in group:
                base = p.rstrip(".")[: -len(last)]
                missing = [s for s in group if base + s not in keep]
                if missing:
                    raise Fp8Error(f"keep pattern {p!r} names one shard of a fused SGLang linear "
                                   f"{'/'.join(group)}; also keep {[base + s for s in missing]}")
    return keep


def module_of(name: str) -> str:
    """The module path of a tensor name: ``a.b.weight`` -> ``a.b``; a fused expert tensor is its own."""
    return name[: -len(".weight")] if name.endswith(".weight") else name


def kept_by(name: str, keep: Sequence[str]) -> str | None:
    """The first keep pattern matching ``name``'s module, or None."""
    mod = module_of(name)
    return next((p for p in keep if module_path_match(p, mod)), None)


def quantizable(name: str, shape: Sequence[int], dtype) -> bool:
    """A floating matrix SGLang would serve through an fp8 linear / MoE method (before the keep list)."""
    is_float = dtype.is_floating_point if isinstance(dtype, torch.dtype) else str(dtype).startswith(("float", "bfloat"))
    if not is_float or "float8" in str(dtype):
        return False
    if len(shape) == 2 and name.endswith(".weight"):
        return True
    return len(shape) == 3 and bool(_FUSED_EXPERTS.search(name))


def will_quantize(name: str, shape: Sequence[int], dtype, keep: Sequence[str] = DEFAULT_KEEP) -> bool:
    return quantizable(name, shape, dtype) and kept_by(name, keep) is None


def scale_shape(shape: Sequence[int], block: Sequence[int] = BLOCK) -> tuple[int, ...]:
    """[..., N, K] -> [..., ceil(N/bn), ceil(K/bk)] (SGLang's BlockQuantScaleParameter shape)."""
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


# ----------------------------------------------------------------------------------------------
# Numbers
# ----------------------------------------------------------------------------------------------
def _blocks(x: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """[..., N, K] -> zero-padded [..., nb, bn, kb, bk] view."""
    *lead, n, k = x.shape
    bn, bk = block
    pn, pk = -n % bn, -k % bk
    if pn or pk:
        x = torch.nn.functional.pad(x, (0, pk, 0, pn))
    return x.reshape(*lead, (n + pn) // bn, bn, (k + pk) // bk, bk)


def _expand(scale: torch.Tensor, n: int, k: int, block: Sequence[int]) -> torch.Tensor:
    return scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :n, :k]


@torch.no_grad()
def quantize_blockwise(w: torch.Tensor, block: Sequence[int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (q float8_e4m3fn [..., N, K], scale_inv float32 [..., ceil(N/bn), ceil(K/bk)]).

    Per block: scale_inv = amax / 448 (1 for an all-zero block), q = round_to_nearest_e4m3(w / scale_inv).
    Raises ``Fp8Error`` if ``w`` holds inf or NaN (a scale computed from them would be meaningless)."""
    if w.dim() < 2:
        raise Fp8Error(f"block quantization needs a matrix, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise Fp8Error(f"cannot quantize a {w.dtype} tensor")
    x = w.detach().float()
    bad = ~torch.isfinite(x)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise Fp8Error(f"tensor holds {int(bad.sum())} non-finite value(s) (first at index {first}: "
                       f"{float(x[first])}); refusing to quantize")
    *_, n, k = x.shape
    amax = _blocks(x.abs(), block).amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    # clamp: amax / 448 * 448 may round a hair above 448 in fp32; e4m3fn has no inf to overflow into
    q = (x / _expand(scale, n, k, block)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


@torch.no_grad()
def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int] = BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., N, K] float8 and scale_inv [..., ceil(N/bn), ceil(K/bk)] -> q * scale_inv, in ``dtype``
    (the arithmetic of SGLang's ``block_quant_dequant``: fp32 product, then cast)."""
    if q.dtype != torch.float8_e4m3fn:
        raise Fp8Error(f"expected a float8_e4m3fn tensor, got {q.dtype}")
    want = scale_shape(q.shape, block)
    if tuple(scale_inv.shape) != want:
        raise Fp8Error(f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(q.shape)} "
                       f"with block {list(block)} (expected {list(want)})")
    s = scale_inv.float()
    if not torch.isfinite(s).all():
        raise Fp8Error("scale_inv holds non-finite values")
    *_, n, k = q.shape
    return (q.float() * _expand(s, n, k, block)).to(dtype)


# ----------------------------------------------------------------------------------------------
# Streams
# ----------------------------------------------------------------------------------------------
def quantize_stream(named_tensors: Iterable[tuple[str, torch.Tensor]], keep: Sequence[str] = DEFAULT_KEEP,
                    block: Sequence[int] = BLOCK) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) -> the same stream with every quantizable, not-kept tensor replaced by
    (name, fp8) followed by (name + "_scale_inv", fp32). Other tensors pass through untouched.
    Names are unchanged (one name mapping: the converter's); tensors stay on their device."""
    keep = check_keep(keep)
    for name, t in named_tensors:
        if will_quantize(name, t.shape, t.dtype, keep):
            try:
                q, s = quantize_blockwise(t, block)
            except Fp8Error as e:
                raise Fp8Error(f"{name}: {e}") from None
            yield name, q
            yield name + SCALE_SUFFIX, s
        else:
            yield name, t


class Fp8Pairs:
    """Joins (name, fp8) with (name + "_scale_inv", fp32) arriving in either order, possibly in
    different calls (weight-sync buckets), and hands back (name, dequantized)."""

    def __init__(self, block: Sequence[int] = BLOCK, dtype: torch.dtype = torch.float32):
        self.block, self.dtype = tuple(block), dtype
        self.weights: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}

    def feed(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """[] while one half is missing; [(name, tensor)] for a plain tensor or a completed pair."""
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base in self.weights:
                return [(base, self._deq(base, self.weights.pop(base), t))]
            self.scales[base] = t
            return []
        if t.dtype == torch.float8_e4m3fn:
            if name in self.scales:
                return [(name, self._deq(name, t, self.scales.pop(name)))]
            self.weights[name] = t
            return []
        if "float8" in str(t.dtype):
            raise Fp8Error(f"{name}: unsupported fp8 dtype {t.dtype} (only float8_e4m3fn with block scales)")
        return [(name, t)]

    def _deq(self, name: str, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        try:
            return dequantize_blockwise(q, s, self.block, self.dtype)
        except Fp8Error as e:
            raise Fp8Error(f"{name}: {e}") from None

    def unpaired(self) -> list[str]:
        return sorted([f"{n} (no {n}{SCALE_SUFFIX})" for n in self.weights] +
                      [f"{n}{SCALE_SUFFIX} (no {n})" for n in self.scales])

    def check_complete(self) -> None:
        if self.weights or self.scales:
            bad = self.unpaired()
            raise Fp8Error(f"{len(bad)} fp8 tensor(s) without their pair: {bad[:4]}{' ...' if len(bad) > 4 else ''}")


def dequantize_stream(named_tensors: Iterable[tuple[str, torch.Tensor]], block: Sequence[int] = BLOCK,
                      dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Inverse of ``quantize_stream``: fp8 + scale pairs -> (name, q * scale_inv in ``dtype``); a pair
    left incomplete at the end raises ``Fp8Error``."""
    pairs = Fp8Pairs(block, dtype)
    for name, t in named_tensors:
        yield from pairs.feed(name, t)
    pairs.check_complete()


# ----------------------------------------------------------------------------------------------
# Checkpoint metadata
# ----------------------------------------------------------------------------------------------
def quantization_config(names: Iterable[tuple[str, Sequence[int], object]], keep: Sequence[str] = DEFAULT_KEEP,
                        block: Sequence[int] = BLOCK) -> dict:
    """``quantization_config`` for config.json (what SGLang's ``Fp8Config.from_config`` and
    transformers' FineGrainedFP8Config read). ``modules_to_not_convert`` lists the keep patterns that
    matched a matrix of the checkpoint: both loaders match them on module boundaries / as suffixes."""
    used = sorted({p for n, s, d in names if quantizable(n, s, d) and (p := kept_by(n, keep)) is not None})
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [int(b) for b in block], "modules_to_not_convert": used}


def sglang_block_problems(names: Iterable[tuple[str, Sequence[int], object]], keep: Sequence[str] = DEFAULT_KEEP,
                          block: Sequence[int] = BLOCK) -> list[str]:
    """Quantized tensors SGLang 0.5.23 would refuse to load (validate_block_quant_shapes /
    Fp8MoEMethod.create_weights): a shard of a fused linear, or an expert's intermediate size, whose
    rows are not a multiple of block_n. (Tiny test models hit this; transformers and the CPU engine
    load them anyway.) For in_proj_qkv only the total row count is checked."""
    shards = {s for g in FUSED_SHARDS for s in g}
    out = []
    for name, shape, dtype in names:
        if not will_quantize(name, shape, dtype, keep):
            continue
        mod = module_of(name)
        last = mod.split(".")[-1]
        rows = shape[-2]
        if _FUSED_EXPERTS.search(name) and last == "gate_up_proj":
            rows = shape[-2] // 2
            last = "gate_proj"
        if last in shards and rows % block[0]:
            out.append(f"{name}: {rows} rows per fused shard, not a multiple of block_n={block[0]}")
    return out


def fp8_nbytes(shape: Sequence[int], block: Sequence[int] = BLOCK) -> int:
    """Bytes of an fp8 weight plus its float32 scales."""
    return math.prod(shape) + 4 * math.prod(scale_shape(shape, block))


class Fp8WeightUpdates:
    """An engine whose ``update_weights`` receives the block-FP8 form of what it is sent.

    ``Fp8WeightUpdates(engine, keep)`` wraps any rollout engine (duck-typed: ``update_weights``); every
    other attribute is the engine's: the export stream is quantized bucket by bucket on the engine rank,
    right before the engine loads it (after any transfer). The trainer's weight sync instead quantizes on
    the stage leaders, before the transfer (``rollout.sync.weight_sync.sync_weights(quantize=quantize_stream)``)."""

    # the export must reach the engine through update_weights to be quantized: hide a colocated engine's
    # in-place assembly (CPUEngine.weight_buffer, used by rollout.sync.weight_sync when present)
    weight_buffer = None

    def __init__(self, engine, keep: Sequence[str] = DEFAULT_KEEP, block: Sequence[int] = BLOCK):
        self.engine, self.keep, self.block = engine, check_keep(keep), tuple(block)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(quantize_stream(named_tensors, self.keep, self.block))

    def __getattr__(self, name):
        return getattr(self.engine, name)

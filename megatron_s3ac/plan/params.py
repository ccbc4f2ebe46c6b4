"""Exact parameter counts per rank, summed from the converter plan's global tensor shapes.

``convert.plan.build_plan(info)`` lists every megatron-core checkpoint tensor with its global shape
(layout-independent). How each one shards follows megatron-core 0.19.2's modules (checked against the built
models by tests/plan/test_calibration_states.py):
  * experts (``mlp.experts.experts.*``): the expert axis over EP, the FFN dim over ETP -> numel/(EP*ETP);
  * norms, q/k layernorms, the GDN ``out_norm``, the router and the shared-expert gate are replicated
    over TP;
  * everything else (QKV / proj / fc1 / fc2 / shared expert, GDN ``in_proj`` / ``conv1d`` / ``A_log`` /
    ``dt_bias`` / ``out_proj``, embedding and output layer rows) is split over TP -> numel/TP.
Layers go to pipeline stages as megatron splits them (``stage_layers``); the embedding lives on the
first stage, the final norm and the output layer on the last (a tied model keeps a copy of the
embedding on the last stage when PP > 1). The critic's output layer is the value head: H + 1
parameters, replicated over TP, and the critic never ties embeddings.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from megatron_s3ac.models.registry import ModelInfo

_REPLICATED = re.compile(r"(layer_norm_weight|layernorm\.weight|out_norm\.weight|router\.weight|"
                         r"shared_experts\.gate_weight)$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_GDN_PIECE = re.compile(r"\.(in_proj|conv1d)\.weight\.(query|key|value|z|beta|alpha)$")


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor: key, global numel, which layer (None = not a decoder layer), kind."""

    key: str
    numel: int
    layer: int | None  # global layer index; -1 = a stacked [L, ...] tensor (numel is per layer)
    expert: bool
    replicated: bool
    pieces: int = 1  # megatron parameters this checkpoint tensor is made of (experts: one per expert)


_CACHE: dict[str, tuple[Tensor, ...]] = {}


def _build_tensors(info: ModelInfo) -> tuple[Tensor, ...]:
    from megatron_s3ac.convert.plan import build_plan

    plan = build_plan(info)
    shapes: dict[str, tuple[int, ...]] = {}
    for ch in plan.chunks:  # aliases are the same tensor under another name: count the key once
        shapes[ch.key] = ch.global_shape
    # megatron keeps GDN in_proj / conv1d as one parameter each; the checkpoint splits them in pieces
    merged: dict[str, tuple[int, ...]] = {}
    for key, shape in shapes.items():
        m = _GDN_PIECE.search(key)
        if m:
            parent = key[:m.start()] + f".{m.group(1)}.weight"
            prev = merged.get(parent)
            merged[parent] = (shape[0] + (prev[0] if prev else 0), *shape[1:])
        else:
            merged[key] = shape
    out = []
    for key, shape in merged.items():
        numel = math.prod(shape)
        m = _LAYER.match(key)
        if m:
            layer = int(m.group(1))
        elif key.startswith("decoder.layers."):
            layer, numel = -1, numel // shape[0]  # stacked: leading layer axis
        else:
            layer = None
        expert = ".mlp.experts.experts." in key
        out.append(Tensor(key, numel, layer, expert, bool(_REPLICATED.search(key)),
                          pieces=shape[1 if layer == -1 else 0] if expert else 1))
    return tuple(out)


def tensors(info: ModelInfo) -> tuple[Tensor, ...]:
    """Every checkpoint tensor of the model (cached per HF config)."""
    key = json.dumps(info.hf, sort_keys=True, default=str)
    if key not in _CACHE:
        _CACHE[key] = _build_tensors(info)
    return _CACHE[key]


def stage_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[range]:
    """Global layer indices of each pipeline stage, as megatron-core splits them (uneven first/last)."""
    if pp == 1:
        return [range(num_layers)]
    sizes = [None] * pp
    rest, middle = num_layers, pp
    if first is not None:
        sizes[0], rest, middle = first, rest - first, middle - 1
    if last is not None:
        sizes[-1], rest, middle = last, rest - last, middle - 1
    each = rest // middle if middle else 0
    sizes = [s if s is not None else each for s in sizes]
    out, start = [], 0
    for s in sizes:
        out.append(range(start, start + s))
        start += s
    return out


@dataclass
class StageParams:
    """Parameters held by one rank of one pipeline stage (elements, not bytes)."""

    stage: int
    layers: range
    dense: int = 0  # reduced over the data-parallel group (DP = W / (TP*PP))
    expert: int = 0  # reduced over the expert-data-parallel group (EDP = W / (EP*ETP*PP))
    embedding: int = 0  # part of ``dense``: embedding / output-layer rows on this rank
    dense_numels: list = field(default_factory=list)  # numel of each local megatron parameter
    expert_numels: list = field(default_factory=list)
    shared_embedding: int = 0  # numel of a tied embedding kept in its own DDP bucket (PP > 1)
    counts: dict = field(default_factory=dict)  # per-layer-kind breakdown (for docs / debugging)

    @property
    def total(self) -> int:
        return self.dense + self.expert


def rank_params(info: ModelInfo, layout, critic: bool = False, keep=None, layers=None) -> list[StageParams]:
    """Parameters per rank on each pipeline stage for ``layout`` (a ``ParallelLayout``); ``keep(tensor)``: count
    only the checkpoint tensors it accepts, ``layers``: only these global layers' (the rehearsal's groups phase: one
    layer's MLP; no value head with either).

    TP ranks of a stage hold equal counts when the layout is valid (every split dim divides)."""
    tp, ep, etp = layout.tp, layout.ep, layout.etp
    stages = stage_layers(info.num_layers, layout.pp, layout.first_stage_layers, layout.last_stage_layers)
    out = [StageParams(stage=i, layers=r) for i, r in enumerate(stages)]
    h = info.hidden_size
    for t in tensors(info):
        if keep is not None and not keep(t):
            continue
        if t.expert:
            share = t.numel // (ep * etp)
        elif t.replicated:
            share = t.numel
        else:
            share = t.numel // tp
        if t.layer is None:
            if t.key.startswith("embedding."):
                targets = [out[0]]
                if info.tie_embeddings and not critic and layout.pp > 1:
                    targets.append(out[-1])  # megatron's copy of the tied embedding on the last stage
            elif t.key.startswith("output_layer."):
                if critic:
                    continue  # replaced by the value head below
                targets = [out[-1]]
            else:  # final norm
                targets = [out[-1]]
            for st in targets:
                st.dense += share
                st.dense_numels.append(share)
                if not t.key.startswith("decoder."):
                    st.embedding += share
                    if info.tie_embeddings and not critic and layout.pp > 1:
                        st.shared_embedding = share
            continue
        for st in out:
            mine = st.layers if layers is None else [x for x in st.layers if x in layers]
            n = len(mine) if t.layer == -1 else int(t.layer in mine)
            if not n:
                continue
            if t.expert:
                st.expert += share * n
                local = t.pieces // ep  # this rank's experts, one parameter each
                st.expert_numels += [share // local] * (local * n)
            else:
                st.dense += share * n
                st.dense_numels += [share] * n
    if critic and keep is None and layers is None:
        out[-1].dense += h + 1  # value head: weight [1, H] + bias [1], replicated over TP
        out[-1].dense_numels += [h, 1]
    return out


def total_params(info: ModelInfo) -> tuple[int, int]:
    """(all parameters, expert parameters) of the model, unsharded (actor; embedding counted once)."""
    ts = tensors(info)
    per = {t.key: t.numel * (info.num_layers if t.layer == -1 else 1) for t in ts}
    return sum(per.values()), sum(per[t.key] for t in ts if t.expert)


def vision_params(hf: dict) -> int:
    """Parameters of a Qwen3.5 / Qwen3-VL style vision tower from the checkpoint's ``vision_config`` (0 without
    one): patch embedding (Conv3d C x t x p x p -> h, with bias), learned position embeddings (P x h), ``depth``
    blocks (two LayerNorms, qkv h -> 3h and proj h -> h with biases, MLP h -> I -> h with biases) and the patch
    merger (LayerNorm(h), (h m^2) -> (h m^2) -> out_hidden with biases)."""
    v = vision_config(hf)
    if not v:
        return 0
    h, inter, depth = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["depth"])
    c, p, t = int(v.get("in_channels", 3)), int(v["patch_size"]), int(v.get("temporal_patch_size", 2))
    m, out, npos = int(v.get("spatial_merge_size", 2)), int(v["out_hidden_size"]), int(v.get("num_position_embeddings", 0))
    patch = h * c * t * p * p + h
    block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (inter * h + inter) + (h * inter + h)
    hm = h * m * m
    merger = 2 * h + (hm * hm + hm) + (out * hm + out)
    return patch + npos * h + depth * block + merger


def vision_config(hf: dict) -> dict:
    """The checkpoint's ``vision_config`` with the architecture's defaults filled in ({} without one)."""
    v = dict(hf.get("vision_config") or {})
    if not v:
        return {}
    missing = {"intermediate_size", "patch_size", "out_hidden_size", "depth", "hidden_size", "num_heads"} - set(v)
    if missing:  # a partial vision_config (e.g. examples/hf_configs): the architecture's defaults fill it
        v = {**_vision_defaults(hf), **v}
        if "out_hidden_size" in missing:  # the merger projects onto the language model's width
            v["out_hidden_size"] = (hf.get("text_config") or hf).get("hidden_size", v.get("out_hidden_size"))
    return v


def _vision_defaults(hf: dict) -> dict:
    """transformers' default vision_config of the checkpoint's model type ({} when it has none)."""
    try:
        from transformers import CONFIG_MAPPING

        sub = CONFIG_MAPPING[hf["model_type"]].sub_configs.get("vision_config")
        return sub().to_dict() if sub is not None else {}
    except (KeyError, ImportError, AttributeError, TypeError):
        return {}

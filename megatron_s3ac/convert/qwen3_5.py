"""Qwen3.5-MoE (``qwen3_5_moe`` / ``qwen3_5_moe_text``) <-> megatron-core checkpoint mapping.

Checkpoint keys are those megatron-core 0.19.2 writes (as 0.16.1 did) for the hybrid model of
``models/qwen3_5_spec.py`` (per-layer keys ``decoder.layers.<i>.``: ``linear_attention_freq`` and
``moe_layer_freq`` are lists). Every region is a row range of one HF tensor, so the converter copies
bytes only:

  * GDN layers (HF ``linear_attn.*``): megatron's sharded_state_dict splits ``in_proj.weight`` into
    ``.query/.key/.value/.z/.beta/.alpha`` and ``conv1d.weight`` into ``.query/.key/.value`` global
    tensors (TP-independent), which are row slices of HF ``in_proj_qkv`` (flat [Q; K; V]),
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` and ``conv1d.weight``; ``A_log``, ``dt_bias``,
    ``out_proj`` as is; ``out_norm.weight`` == ``linear_attn.norm.weight`` (a plain norm on our side,
    no -1: see models/qwen3_5.py); the input norm under TE's fused name ``in_proj.layer_norm_weight``;
  * gated attention: ``linear_qkv.weight`` per query group g = [q heads of g; gate heads of g; k_g; v_g]
    where HF ``q_proj`` rows are per head [q (d); gate (d)];
  * MoE: ``pre_mlp_layernorm.weight``, ``router.weight`` (HF ``mlp.gate``), experts
    ``experts.experts.linear_fc1.weight`` [E, 2I, H] / ``linear_fc2.weight`` [E, H, I] which are
    byte-identical to HF's fused ``experts.gate_up_proj`` / ``experts.down_proj`` (one chunk per
    expert), or the per-expert HF layout (``s3ac_hf_experts: per_expert``); shared expert
    ``shared_experts.linear_fc1`` = [gate; up], ``linear_fc2``, ``gate_weight`` (HF
    ``shared_expert_gate``);
  * all zero-centred norms (input, post-attention, q/k, final) are copied as is (megatron's
    ``layernorm_zero_centered_gamma`` computes (1 + w) like HF).

The vision tower (``model.visual.*``) and the MTP head (``mtp.*``) have no counterpart in the megatron
decoder: they are *carried* (plan.py): stored as is under ``s3ac_carried.<HF name>`` (row blocks), so a
checkpoint converted back is the complete ``Qwen3_5MoeForConditionalGeneration``; the live export
(weight sync) never sends them (they stay in ``ignorable_hf``: ``plan.not_exported``). A text-only
``qwen3_5_moe_text`` checkpoint carries its ``mtp.*`` tensors and drops a stray ``model.visual.*``.
"""
from __future__ import annotations

from megatron_s3ac.convert.plan import Chunk, Part, Plan, register_plan
from megatron_s3ac.convert.qwen import _Builder, _swiglu
from megatron_s3ac.models.qwen3_5 import HF_PREFIX, expert_layout, layer_types, text_config
from megatron_s3ac.models.registry import ModelInfo

IGNORED_PREFIXES = ("model.visual.", "mtp.")
CARRIED_PREFIXES = {"qwen3_5_moe": ("model.visual.", "mtp."), "qwen3_5_moe_text": ("mtp.",)}


class IgnoreByPrefix:
    """``Plan.ignorable_hf`` for whole sub-models: exact names plus name prefixes. Supports what the
    converter does with it (``set_of_names - ignorable`` and ``in``)."""

    def __init__(self, names=(), prefixes=()):
        self.names, self.prefixes = set(names), tuple(prefixes)

    def __contains__(self, name: str) -> bool:
        return name in self.names or name.startswith(self.prefixes)

    def __rsub__(self, other):
        return {n for n in other if n not in self}

    def __iter__(self):
        return iter(self.names)

    def add(self, name: str) -> None:
        self.names.add(name)


def _dims(info: ModelInfo) -> dict:
    tc = text_config(info.hf)
    nk, nv = tc.get("linear_num_key_heads", 16), tc.get("linear_num_value_heads", 32)
    dk, dv = tc.get("linear_key_head_dim", 128), tc.get("linear_value_head_dim", 128)
    return dict(nk=nk, nv=nv, dk=dk, dv=dv, qk=nk * dk, v=nv * dv, K=tc.get("linear_conv_kernel_dim", 4))


def gdn_mixer(b: _Builder, pre: str, src: str) -> None:
    """GDN token mixer of one layer: ``pre`` = 'decoder.layers.<i>.', ``src`` = HF '<prefix>layers.<i>.'."""
    H = b.info.hidden_size
    g = _dims(b.info)
    qk, v, nv, K = g["qk"], g["v"], g["nv"], g["K"]
    a, la = pre + "self_attention.", src + "linear_attn."
    b.whole(a + "in_proj.layer_norm_weight", (), (), src + "input_layernorm.weight", (H,))
    qkv = b.hf(la + "in_proj_qkv.weight", (2 * qk + v, H))
    for name, start, rows in (("query", 0, qk), ("key", qk, qk), ("value", 2 * qk, v)):
        b.add(a + f"in_proj.weight.{name}", (), (), (rows, H), [Part(qkv, start, start + rows)])
    b.whole(a + "in_proj.weight.z", (), (), la + "in_proj_z.weight", (v, H))
    b.whole(a + "in_proj.weight.beta", (), (), la + "in_proj_b.weight", (nv, H))
    b.whole(a + "in_proj.weight.alpha", (), (), la + "in_proj_a.weight", (nv, H))
    b.obj(a + "in_proj._extra_state", (), ())
    conv = b.hf(la + "conv1d.weight", (2 * qk + v, 1, K))
    for name, start, rows in (("query", 0, qk), ("key", qk, qk), ("value", 2 * qk, v)):
        b.add(a + f"conv1d.weight.{name}", (), (), (rows, 1, K), [Part(conv, start, start + rows)])
    b.whole(a + "A_log", (), (), la + "A_log", (nv,))
    b.whole(a + "dt_bias", (), (), la + "dt_bias", (nv,))
    b.whole(a + "out_norm.weight", (), (), la + "norm.weight", (g["dv"],))
    b.whole(a + "out_proj.weight", (), (), la + "out_proj.weight", (H, v))
    b.obj(a + "out_proj._extra_state", (), ())


def gated_attention(b: _Builder, pre: str, src: str) -> None:
    info = b.info
    H, d, nh, ng = info.hidden_size, info.head_dim, info.num_heads, info.num_kv_heads
    hpg = nh // ng
    a, sa = pre + "self_attention.", src + "self_attn."
    b.whole(a + "linear_qkv.layer_norm_weight", (), (), src + "input_layernorm.weight", (H,))
    q = b.hf(sa + "q_proj.weight", (2 * nh * d, H))  # per head: [query (d); gate (d)]
    k = b.hf(sa + "k_proj.weight", (ng * d, H))
    v = b.hf(sa + "v_proj.weight", (ng * d, H))
    parts = []
    for grp in range(ng):
        heads = range(grp * hpg, (grp + 1) * hpg)
        parts += [Part(q, 2 * h * d, 2 * h * d + d) for h in heads]          # queries of the group
        parts += [Part(q, 2 * h * d + d, 2 * (h + 1) * d) for h in heads]    # their gates
        parts += [Part(k, grp * d, (grp + 1) * d), Part(v, grp * d, (grp + 1) * d)]
    b.add(a + "linear_qkv.weight", (), (), ((2 * nh + 2 * ng) * d, H), parts)
    b.obj(a + "linear_qkv._extra_state", (), ())
    b.whole(a + "q_layernorm.weight", (), (), sa + "q_norm.weight", (d,))
    b.whole(a + "k_layernorm.weight", (), (), sa + "k_norm.weight", (d,))
    b.whole(a + "linear_proj.weight", (), (), sa + "o_proj.weight", (H, nh * d))
    b.obj(a + "linear_proj._extra_state", (), ())


def moe_block(b: _Builder, pre: str, src: str, fused: bool) -> None:
    info = b.info
    H, E, F, S = info.hidden_size, info.num_experts, info.moe_ffn_hidden_size, info.shared_expert_size
    m, sm = pre + "mlp.", src + "mlp."
    b.whole(pre + "pre_mlp_layernorm.weight", (), (), src + "post_attention_layernorm.weight", (H,))
    b.whole(m + "router.weight", (), (), sm + "gate.weight", (E, H))
    if fused:
        gate_up = b.hf(sm + "experts.gate_up_proj", (E, 2 * F, H))
        down = b.hf(sm + "experts.down_proj", (E, H, F))
        for key, name, body in (("linear_fc1", gate_up, (2 * F, H)), ("linear_fc2", down, (H, F))):
            for e in range(E):  # one chunk per expert: any EP layout reads only its experts
                b.chunks.append(Chunk(key=m + f"experts.experts.{key}.weight", global_shape=(E, *body),
                                      offset=(e, 0, 0), shape=(1, *body), parts=(Part(name, e, e + 1),),
                                      body_ndim=3))
                b.obj(m + f"experts.experts.{key}._extra_state", (E,), (e,))
    else:
        for e in range(E):
            _swiglu(b, m + "experts.experts.", (E,), (e,), sm + f"experts.{e}.", F)
    if S:
        _swiglu(b, m + "shared_experts.", (), (), sm + "shared_expert.", S)
        b.whole(m + "shared_experts.gate_weight", (), (), sm + "shared_expert_gate.weight", (1, H))


@register_plan("qwen3_5_moe", "qwen3_5_moe_text")
def qwen3_5_plan(info: ModelInfo) -> Plan:
    b = _Builder(info)
    assert not b.stacked, "qwen3_5_moe checkpoints key layers individually"
    hp = HF_PREFIX[info.model_type]
    fused = expert_layout(info.hf) == "fused"
    b.vocab_rows("embedding.word_embeddings.weight", hp + "embed_tokens.weight")
    for i, kind in enumerate(layer_types(text_config(info.hf))):
        pre, src = f"decoder.layers.{i}.", f"{hp}layers.{i}."
        if kind == "linear_attention":
            gdn_mixer(b, pre, src)
        else:
            gated_attention(b, pre, src)
        moe_block(b, pre, src, fused)
    b.whole("decoder.final_layernorm.weight", (), (), hp + "norm.weight", (info.hidden_size,))
    ignorable = IgnoreByPrefix(prefixes=IGNORED_PREFIXES)
    if info.tie_embeddings:
        ignorable.add("lm_head.weight")
    else:
        b.vocab_rows("output_layer.weight", "lm_head.weight")
    return Plan(info=info, chunks=b.chunks, hf_shapes=b.hf_shapes, objects=b.objects, ignorable_hf=ignorable,
                carried_prefixes=CARRIED_PREFIXES[info.model_type])

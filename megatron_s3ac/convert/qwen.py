"""Qwen2 / Qwen3 / Qwen3-MoE <-> megatron-core GPTModel: the one name/layout mapping.

Checkpoint keys are those megatron-core 0.19.2 writes (as 0.16.1 did) for a TP1/PP1/EP1
``GPTModel.sharded_state_dict()`` (the torch_dist layout is the same at every TP/PP/EP/ETP):
  * dense models stack layers: ``decoder.layers.<name>`` with a prepended layer axis [L, ...];
    MoE models (``moe_layer_freq`` is a list) key layers individually: ``decoder.layers.<i>.<name>``;
  * ``linear_qkv.weight`` [(nh + 2*ng) * d, H]: per query group g, [q heads of g; k_g; v_g];
  * ``linear_fc1.weight`` [2F, H] = [gate; up] (megatron's swiglu factory undoes the TP interleave);
  * experts: ``mlp.experts.experts.linear_fc{1,2}.weight`` with a prepended expert axis [E, ...];
  * embedding / output layer padded to ``padded_vocab_size`` rows (zeros; megatron allows the mismatch);
  * norms under the names the specs map them to: ``linear_qkv.layer_norm_weight`` (input norm) and
    ``mlp.linear_fc1.layer_norm_weight`` (pre-MLP norm). The TE MoE spec keeps ``pre_mlp_layernorm.weight``
    for MoE layers, so that name is written too (an alias), and a checkpoint loads with either spec.
"""
from __future__ import annotations

from megatron_s3ac.convert.plan import Chunk, Part, Plan, register_plan
from megatron_s3ac.models.registry import ModelInfo, get_arch

# Embedding / output rows are split into blocks of at most this many bytes (assuming 4-byte
# elements), so neither direction ever holds a whole [vocab, hidden] matrix.
VOCAB_BLOCK_BYTES = 128 * 1024 * 1024


def layers_are_stacked(info: ModelInfo) -> bool:
    """Mirror of ``TransformerBlock.sharded_state_dict``: a list ``moe_layer_freq`` (or int > 1)
    makes megatron key layers individually; otherwise they are stacked on a layer axis.

    The registry's ``transformer_config_kwargs`` sets ``moe_layer_freq`` to a per-layer list for every
    MoE model and leaves it unset otherwise, so this is ``not info.is_moe``, computed without calling
    it (it imports torch, which the converter's hf-to-mcore path avoids);
    ``tests/convert/test_torch_free.py`` checks the two agree for every registered model_type."""
    return not info.is_moe


def layers_are_stacked_by_config(info: ModelInfo) -> bool:
    """The same from the megatron config kwargs themselves (imports torch)."""
    freq = get_arch(info.model_type).transformer_config_kwargs(info).get("moe_layer_freq", 1)
    return not (isinstance(freq, list) or (isinstance(freq, int) and freq > 1))


class _Builder:
    def __init__(self, info: ModelInfo):
        self.info = info
        self.stacked = layers_are_stacked(info)
        self.chunks: list[Chunk] = []
        self.hf_shapes: dict[str, tuple[int, ...]] = {}
        self.objects: list[str] = []

    def hf(self, name: str, shape: tuple[int, ...]) -> str:
        self.hf_shapes[name] = tuple(shape)
        return name

    def add(self, key, index_shape, index, body_shape, parts, aliases=()):
        """Chunk at ``index`` (prefix axes of global size ``index_shape``) whose body is ``body_shape``."""
        body_ndim = len(body_shape)
        self.chunks.append(Chunk(
            key=key, global_shape=(*index_shape, *body_shape),
            offset=(*index, *([0] * body_ndim)), shape=(*([1] * len(index)), *body_shape),
            parts=tuple(parts), body_ndim=body_ndim, aliases=tuple(aliases)))

    def whole(self, key, index_shape, index, hf_name, shape, aliases=()):
        """Checkpoint region == one whole HF tensor."""
        self.hf(hf_name, shape)
        self.add(key, index_shape, index, shape, [Part(hf_name, 0, shape[0])], aliases)

    def obj(self, key: str, index_shape: tuple, index: tuple) -> None:
        """An ``_extra_state`` ShardedObject; unique key as ``ShardedObject.unique_key`` spells it."""
        if not index_shape:
            index_shape, index = (1,), (0,)
        self.objects.append(f"{key}/shard_{'.'.join(map(str, index))}_{'.'.join(map(str, index_shape))}")

    def vocab_rows(self, key: str, hf_name: str) -> None:
        """[V, H] HF matrix -> [Vp, H] checkpoint tensor, in row blocks; the last block carries the padding."""
        info = self.info
        v, vp, h = info.vocab_size, info.padded_vocab_size, info.hidden_size
        self.hf(hf_name, (v, h))
        block = max(1, VOCAB_BLOCK_BYTES // (4 * h))
        for start in range(0, vp, block):
            stop = min(start + block, vp)
            parts = [Part(hf_name, start, min(stop, v))] if start < v else []
            self.chunks.append(Chunk(key=key, global_shape=(vp, h), offset=(start, 0), shape=(stop - start, h),
                                     parts=tuple(parts), body_ndim=2))


def gpt_layer(b: _Builder, i: int) -> None:
    """One decoder layer: attention (+ qk-norm, qkv bias) and a dense SwiGLU MLP or an MoE block."""
    info = b.info
    L, H, d = info.num_layers, info.hidden_size, info.head_dim
    nh, ng = info.num_heads, info.num_kv_heads
    hpg = nh // ng
    src = f"model.layers.{i}."
    if b.stacked:
        pre, ish, idx = "decoder.layers.", (L,), (i,)
    else:
        pre, ish, idx = f"decoder.layers.{i}.", (), ()

    b.whole(pre + "self_attention.linear_qkv.layer_norm_weight", ish, idx, src + "input_layernorm.weight", (H,))

    def qkv_parts(suffix: str) -> list[Part]:
        q, k, v = (src + f"self_attn.{n}_proj.{suffix}" for n in "qkv")
        parts = []
        for g in range(ng):
            parts += [Part(q, g * hpg * d, (g + 1) * hpg * d), Part(k, g * d, (g + 1) * d), Part(v, g * d, (g + 1) * d)]
        return parts

    qkv_rows = (nh + 2 * ng) * d
    for suffix, tail in (("weight", (H,)),) + ((("bias", ()),) if info.qkv_bias else ()):
        b.hf(src + f"self_attn.q_proj.{suffix}", (nh * d, *tail))
        b.hf(src + f"self_attn.k_proj.{suffix}", (ng * d, *tail))
        b.hf(src + f"self_attn.v_proj.{suffix}", (ng * d, *tail))
        b.add(pre + f"self_attention.linear_qkv.{suffix}", ish, idx, (qkv_rows, *tail), qkv_parts(suffix))
    b.obj(pre + "self_attention.linear_qkv._extra_state", ish, idx)
    if info.qk_norm:
        b.whole(pre + "self_attention.q_layernorm.weight", ish, idx, src + "self_attn.q_norm.weight", (d,))
        b.whole(pre + "self_attention.k_layernorm.weight", ish, idx, src + "self_attn.k_norm.weight", (d,))
    b.whole(pre + "self_attention.linear_proj.weight", ish, idx, src + "self_attn.o_proj.weight", (H, nh * d))
    b.obj(pre + "self_attention.linear_proj._extra_state", ish, idx)

    moe = i in set(info.moe_layers)
    b.whole(pre + "mlp.linear_fc1.layer_norm_weight", ish, idx, src + "post_attention_layernorm.weight", (H,),
            aliases=(pre + "pre_mlp_layernorm.weight",) if moe else ())
    if not moe:
        _swiglu(b, pre + "mlp.", ish, idx, src + "mlp.", info.ffn_hidden_size)
        return
    E, F = info.num_experts, info.moe_ffn_hidden_size
    b.whole(pre + "mlp.router.weight", ish, idx, src + "mlp.gate.weight", (E, H))
    for e in range(E):
        _swiglu(b, pre + "mlp.experts.experts.", (*ish, E), (*idx, e), src + f"mlp.experts.{e}.", F)


def _swiglu(b: _Builder, pre: str, ish: tuple, idx: tuple, src: str, F: int) -> None:
    """linear_fc1 [2F, H] = [gate_proj; up_proj] (two chunks), linear_fc2 = down_proj."""
    H = b.info.hidden_size
    gate, up = b.hf(src + "gate_proj.weight", (F, H)), b.hf(src + "up_proj.weight", (F, H))
    key = pre + "linear_fc1.weight"
    for half, name in enumerate((gate, up)):
        b.chunks.append(Chunk(key=key, global_shape=(*ish, 2 * F, H), offset=(*idx, half * F, 0),
                              shape=(*([1] * len(idx)), F, H), parts=(Part(name, 0, F),), body_ndim=2))
    b.obj(pre + "linear_fc1._extra_state", ish, idx)
    b.whole(pre + "linear_fc2.weight", ish, idx, src + "down_proj.weight", (H, F))
    b.obj(pre + "linear_fc2._extra_state", ish, idx)


@register_plan("qwen2", "qwen3", "qwen3_moe")
def qwen_plan(info: ModelInfo) -> Plan:
    b = _Builder(info)
    b.vocab_rows("embedding.word_embeddings.weight", "model.embed_tokens.weight")
    for i in range(info.num_layers):
        gpt_layer(b, i)
    b.whole("decoder.final_layernorm.weight", (), (), "model.norm.weight", (info.hidden_size,))
    # rotary buffers of old checkpoints are recomputed, never loaded
    ignorable = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(info.num_layers)}
    if info.tie_embeddings:
        ignorable.add("lm_head.weight")  # some tied checkpoints still ship a copy; megatron has none
    else:
        b.vocab_rows("output_layer.weight", "lm_head.weight")
    return Plan(info=info, chunks=b.chunks, hf_shapes=b.hf_shapes, objects=b.objects, ignorable_hf=ignorable)

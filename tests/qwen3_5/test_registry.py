"""qwen3_5_moe in the registry: facts read from both config variants, megatron config, clean errors."""
import pytest

from megatron_s3ac.models.registry import UnsupportedModelError, model_info
from megatron_s3ac.models.tiny_qwen3_5 import tiny_qwen3_5_config

PATTERN = [1, 1, 1, 0, 1, 1, 1, 0]


@pytest.mark.parametrize("variant", ["vl", "text"])
def test_info_and_transformer_config(variant):
    from megatron_s3ac.models.registry import get_arch

    cfg = tiny_qwen3_5_config(variant).to_dict()
    info = model_info(cfg)
    assert info.model_type == ("qwen3_5_moe" if variant == "vl" else "qwen3_5_moe_text")
    assert (info.num_layers, info.hidden_size, info.num_heads, info.num_kv_heads, info.head_dim) == (8, 64, 4, 2, 16)
    assert (info.num_experts, info.top_k, info.moe_ffn_hidden_size, info.shared_expert_size) == (8, 2, 32, 48)
    assert info.moe_layers == list(range(8)) and info.rotary_percent == 0.25 and info.qk_norm
    assert info.hf == cfg  # the whole config (round-trips through the converter's metadata)
    kw = get_arch(info.model_type).transformer_config_kwargs(info)
    assert kw["linear_attention_freq"] == PATTERN
    assert kw["experimental_attention_variant"] == "gated_delta_net"
    assert kw["attention_output_gate"] and kw["layernorm_zero_centered_gamma"] and kw["moe_shared_expert_gate"]
    assert (kw["linear_num_key_heads"], kw["linear_num_value_heads"], kw["linear_key_head_dim"]) == (2, 4, 8)
    assert kw["moe_layer_freq"] == [1] * 8 and kw["ffn_hidden_size"] == 32


def test_layer_pattern_from_interval_and_defaults():
    cfg = tiny_qwen3_5_config("text").to_dict()
    del cfg["layer_types"]
    cfg["full_attention_interval"] = 2
    from megatron_s3ac.models.qwen3_5 import layer_types, rope

    assert layer_types(cfg) == ["linear_attention", "full_attention"] * 4
    cfg.pop("rope_parameters")
    assert rope(cfg)[1] == 0.25  # Qwen3.5's default partial rotary factor


@pytest.mark.parametrize("change,match", [
    (dict(layer_types=["linear_attention"] * 7 + ["sliding_attention"]), "sliding_attention"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "gelu"),
])
def test_unsupported_configs(change, match):
    cfg = tiny_qwen3_5_config("text").to_dict()
    cfg.update(change)
    with pytest.raises(UnsupportedModelError, match=match):
        model_info(cfg)


def test_bad_expert_layout_key():
    cfg = tiny_qwen3_5_config("vl").to_dict()
    cfg["s3ac_hf_experts"] = "stacked"
    with pytest.raises(UnsupportedModelError, match="s3ac_hf_experts"):
        model_info(cfg)


def test_mtp_is_refused_and_cp_checks_gdn_heads():
    from megatron_s3ac.models.parallel import LayoutError, ParallelLayout
    from megatron_s3ac.models.registry import get_arch

    info = model_info(tiny_qwen3_5_config("vl").to_dict())

    class Cfg:
        mtp_num_layers, context_parallel_size = 1, 1

    with pytest.raises(UnsupportedModelError, match="MTP"):
        get_arch(info.model_type).block_spec(Cfg(), info, None)
    # CP splits the GDN heads over CP ranks: 2 key heads go over tp*cp = 2, not 4
    ParallelLayout(cp=2).validate(info, 2)
    with pytest.raises(LayoutError, match="linear_num_key_heads 2 is not divisible by tp\\*cp = 2\\*2"):
        ParallelLayout(cp=2, tp=2).validate(info, 4)

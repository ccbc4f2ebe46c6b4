"""Second review, finding 5 (issue 41): Qwen3.5 always built the torch spec, on GPU too.

At ec9434d ``Qwen3_5Arch.block_spec`` turned the builders' ``use_te=None`` ("TE where it is") into ``False``
(``bool(None)``), so a GPU run with Transformer Engine got the torch modules: a Python loop over the local experts,
SDPA, all-gather context parallelism, while ``s3ac-plan`` costs TE's grouped GEMM and ring attention. Every other
architecture resolves ``None`` through ``have_transformer_engine()`` (models/specs.py). TE cannot be imported
here, so the choice is checked on the real megatron config with TE's presence patched in and TE's block builder
recorded; without TE (this machine) the torch spec stays, layer by layer as ``linear_attention_freq`` says.
"""
import pytest

from megatron_s3ac.models.actor_critic import build_transformer_config
from megatron_s3ac.models.parallel import ParallelLayout
from megatron_s3ac.models.registry import get_arch, model_info
from megatron_s3ac.models.tiny_qwen3_5 import tiny_qwen3_5_config


@pytest.fixture()
def arch_cfg_info():
    info = model_info(tiny_qwen3_5_config("vl").to_dict())
    return get_arch(info.model_type), build_transformer_config(info, ParallelLayout()), info


def test_te_spec_is_chosen_where_te_is(monkeypatch, arch_cfg_info):
    import megatron_s3ac.models.qwen3_5_spec as spec_mod
    import megatron_s3ac.models.specs as specs

    arch, cfg, info = arch_cfg_info
    built = []
    monkeypatch.setattr(specs, "have_transformer_engine", lambda: True)
    monkeypatch.setattr(spec_mod, "_te_block_spec", lambda config, pp_rank: built.append(pp_rank) or "te-block")
    assert arch.block_spec(cfg, info, None, pp_rank=0) == "te-block" and built == [0]
    assert arch.block_spec(cfg, info, False, pp_rank=0) != "te-block"  # an explicit False still means torch


def test_torch_spec_without_te(monkeypatch, arch_cfg_info):
    import megatron_s3ac.models.qwen3_5_spec as spec_mod
    import megatron_s3ac.models.specs as specs

    arch, cfg, info = arch_cfg_info
    monkeypatch.setattr(specs, "have_transformer_engine", lambda: False)
    monkeypatch.setattr(spec_mod, "_te_block_spec", lambda *a, **k: pytest.fail("TE spec built without TE"))
    block = arch.block_spec(cfg, info, None, pp_rank=0)
    gdn = spec_mod.gated_delta_net_class()
    kinds = [s.submodules.self_attention.module is gdn for s in block.layer_specs]
    assert kinds == [bool(x) for x in cfg.linear_attention_freq]

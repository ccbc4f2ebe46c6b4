"""The R3 switch (on by default for MoE only) and the refusal of settings that skip replay."""
import pytest

from megatron_s3ac.models.actor_critic import build_transformer_config
from megatron_s3ac.models.parallel import ParallelLayout
from megatron_s3ac.models.registry import model_info
from megatron_s3ac.r3.config import R3Config, R3ConfigError, check_replay_config
from megatron_s3ac.models.tiny_models import tiny_config


def _info(model_type="qwen3_moe"):
    return model_info(tiny_config(model_type).to_dict())


def _config(**overrides):
    info = _info()
    kw = R3Config().transformer_config_overrides(info)
    kw.update(overrides)
    return build_transformer_config(info, ParallelLayout(), **kw)


def test_switch_defaults():
    assert R3Config().is_on(_info()) and not R3Config().is_on(_info("qwen3"))
    assert R3Config().transformer_config_overrides(_info()) == dict(moe_enable_routing_replay=True,
                                                                    moe_router_fusion=False)
    assert R3Config(enabled=False).transformer_config_overrides(_info()) == {}
    with pytest.raises(R3ConfigError, match="no MoE"):
        R3Config(enabled=True).is_on(_info("qwen3"))


def test_default_config_passes():
    check_replay_config(_config())


@pytest.mark.parametrize("overrides,match", [
    (dict(moe_enable_routing_replay=False), "moe_enable_routing_replay"),
    (dict(moe_router_fusion=True), "moe_router_fusion"),
    (dict(moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="aux_loss"), "capacity"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "sinkhorn"),
    (dict(moe_router_load_balancing_type="quantile_balancing"), "quantile_balancing"),
    (dict(moe_router_force_load_balancing=True), "force_load_balancing"),
    (dict(moe_router_force_biased=0.1), "force_biased"),
])
def test_refusals(overrides, match):
    try:
        config = _config(**overrides)
    except (AssertionError, ValueError) as e:  # megatron itself refused the combination
        pytest.skip(f"megatron-core rejects {overrides}: {e}")
    with pytest.raises(R3ConfigError, match=match):
        check_replay_config(config)

"""Freezing for value pretraining; layout/config validation errors; registry mapping."""
import pytest
import torch

from megatron_s3ac.models.parallel import LayoutError, ParallelLayout
from megatron_s3ac.models.registry import UnsupportedModelError, model_info
from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.models.tiny_models import tiny_config


def _freeze_step(cfg_dict, tp):
    from functools import partial

    from megatron_s3ac.models.actor_critic import build_critic, build_transformer_config, freeze_attention_and_router
    from megatron_s3ac.models.optim import build_optimizer, wrap_ddp
    from megatron_s3ac.models.parallel import initialize_model_parallel
    from megatron_s3ac.models.pipeline import forward_backward

    info = model_info(cfg_dict)
    layout = ParallelLayout(tp=tp)
    initialize_model_parallel(layout, seed=5)
    config = build_transformer_config(info, layout)
    critic = build_critic(info, config)
    frozen = set(freeze_attention_and_router(critic))
    ddp = wrap_ddp(critic, config, distributed_optimizer=True)
    opt = build_optimizer([ddp], lr=1e-2, clip_grad=10.0)
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    ids = torch.randint(0, info.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))

    def loss_fn(batch, out):
        return ((out - 1.0) ** 2).sum(), torch.tensor(out.numel()), {}

    ddp.zero_grad_buffer()
    opt.zero_grad()
    forward_backward([ddp], [{"input_ids": ids}], loss_fn)
    ok, grad_norm, _ = opt.step()
    state_params = {id(p) for g in opt.optimizer.param_groups for p in g["params"]}
    frozen_has_grad = [n for n, p in critic.named_parameters() if n in frozen and
                       (p.grad is not None or getattr(p, "main_grad", None) is not None)]
    changed = {n: not torch.equal(before[n], p.detach()) for n, p in critic.named_parameters()}
    n_state_for_frozen = sum(1 for n, p in critic.named_parameters() if n in frozen and id(p) in state_params)
    return sorted(frozen), changed, frozen_has_grad, n_state_for_frozen, ok


@pytest.mark.parametrize("tp", [1, 2])
def test_freezing_only_attention_and_router(tp):
    cfg = tiny_config("qwen3_moe").to_dict()
    frozen, changed, frozen_has_grad, n_state, ok = run_distributed(_freeze_step, tp, cfg, tp)[0]
    assert ok
    assert frozen, "nothing was frozen"
    assert all(".self_attention." in n or ".input_layernorm." in n or ".mlp.router." in n for n in frozen)
    # every attention / router parameter is frozen, nothing else is
    for n, did_change in changed.items():
        is_frozen_kind = ".self_attention." in n or ".input_layernorm." in n or ".mlp.router." in n
        assert (n in frozen) == is_frozen_kind, n
        if n in frozen:
            assert not did_change, f"frozen {n} changed"
    trainable_changed = [n for n, c in changed.items() if n not in frozen and c]
    assert "module.output_layer.weight" in trainable_changed  # the value head trained
    assert any(".experts." in n for n in trainable_changed)
    assert frozen_has_grad == []
    assert n_state == 0


def test_value_head_init_std():
    """Value head weight ~ N(0, 1/(H+1)): check the empirical std of a wide head."""
    from megatron_s3ac.models.actor_critic import ValueHead, ValueHeadConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    h = 4095
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=1)
    torch.manual_seed(0)
    head = ValueHead(cfg, ValueHeadConfig())
    assert abs(head.weight.std().item() - 1.0 / (h + 1)) < 0.05 / (h + 1)
    assert torch.all(head.bias == 0)


def test_bounded_head_range():
    from megatron_s3ac.models.actor_critic import ValueHead, ValueHeadConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    head = ValueHead(cfg, ValueHeadConfig(kind="bounded", r_min=-1, r_max=1))
    with torch.no_grad():
        head.weight.fill_(100.0)
    h = torch.linspace(-1, 1, 11).reshape(11, 1, 1).expand(11, 1, 8)
    v, _ = head(h)
    z = 800 * torch.linspace(-1, 1, 11)
    expected = -1 + 2 * (0.5 + torch.atan(z) / torch.pi)
    torch.testing.assert_close(v.squeeze(), expected)
    assert v.min() > -1 and v.max() < 1
    with pytest.raises(ValueError, match="r_max > r_min"):
        ValueHeadConfig(kind="bounded", r_min=1, r_max=1)


MOE = tiny_config("qwen3_moe").to_dict()
DENSE = tiny_config("qwen2").to_dict()


@pytest.mark.parametrize("cfg,layout,world,msg", [
    (MOE, dict(tp=3), 3, "num_attention_heads 4 is not divisible by tp 3"),
    (dict(MOE, num_attention_heads=8), dict(tp=4), 4, "num_query_groups .* 2 is not divisible by tp 4"),
    (MOE, dict(ep=3), 3, "num_experts 4 is not divisible by ep 3"),
    (MOE, dict(pp=3, first_stage_layers=1), 3, "num_layers 4 .* not divisible by the 2 remaining pipeline stages"),
    (MOE, dict(pp=5), 5, "num_layers 4 is fewer than pp=5 stages"),
    (MOE, dict(pp=2, first_stage_layers=4), 2, "cannot fill pp=2 stages"),
    (MOE, dict(tp=2), 3, "world size 3 is not divisible by tp\\*cp\\*pp"),
    (MOE, dict(tp=2, ep=4, etp=1), 2, "world size 2 is not divisible by etp\\*ep\\*pp"),
    (MOE, dict(tp=2, etp=1), 2, "with ep=1, etp must equal tp"),
    (DENSE, dict(ep=2), 2, "ep=2 > 1 needs an MoE model"),
    (MOE, dict(tp=0), 1, "tp=0 must be >= 1"),
    (MOE, dict(cp=0), 1, "cp=0 must be >= 1"),
    (MOE, dict(tp=2, cp=2), 2, "world size 2 is not divisible by tp\\*cp\\*pp = 2\\*2\\*1"),
])
def test_invalid_layouts(cfg, layout, world, msg):
    with pytest.raises(LayoutError, match=msg):
        ParallelLayout(**layout).validate(model_info(cfg), world)


def test_valid_layouts_pass():
    for lay, world in [(dict(tp=2), 2), (dict(ep=2), 2), (dict(tp=2, ep=2, etp=1), 4), (dict(pp=2), 2),
                       (dict(pp=2, first_stage_layers=1), 2), (dict(tp=2, ep=2, etp=1), 2 * 2 * 2)]:
        ParallelLayout(**lay).validate(model_info(MOE), world)


@pytest.mark.parametrize("cfg,msg", [
    (dict(DENSE, model_type="llama"), "unsupported model_type 'llama'"),
    (dict(DENSE, use_sliding_window=True), "sliding-window"),
    (dict(DENSE, hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(DENSE, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "RoPE scaling type 'yarn'"),
    ({"hidden_size": 8}, "no model_type"),
])
def test_unsupported_configs(cfg, msg):
    with pytest.raises(UnsupportedModelError, match=msg):
        model_info(cfg)


def test_registry_mapping():
    """The HF fields land where megatron expects them (read from the config, not hard-coded)."""
    from megatron_s3ac.models.actor_critic import build_transformer_config

    info = model_info(dict(MOE, mlp_only_layers=[1], norm_topk_prob=False, vocab_size=130))
    assert info.moe_layers == [0, 2, 3]
    assert info.padded_vocab_size == 256 and info.vocab_size == 130
    cfg = build_transformer_config(info, ParallelLayout(tp=2))
    assert cfg.moe_layer_freq == [1, 0, 1, 1]
    assert cfg.moe_router_pre_softmax is True  # norm_topk_prob=False: softmax over all experts, no renorm
    assert cfg.num_query_groups == 2 and cfg.kv_channels == 16 and cfg.qk_layernorm
    assert cfg.sequence_parallel and cfg.expert_tensor_parallel_size == 2
    q2 = model_info(DENSE)
    assert q2.qkv_bias and not q2.qk_norm and q2.tie_embeddings
    c2 = build_transformer_config(q2, ParallelLayout())
    assert c2.add_qkv_bias and not c2.qk_layernorm and c2.num_moe_experts is None


def test_auto_stage_layers_rule():
    """num_layers % pp != 0 without explicit sizes: middle stages get ceil(L / pp), the first and last
    share the rest (first >= last), never an empty stage; megatron-core accepts every split."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_s3ac.models.parallel import auto_stage_layers

    assert ParallelLayout(pp=2).stage_layers(3) == [2, 1]
    assert ParallelLayout(pp=3).stage_layers(4) == [1, 2, 1]
    assert ParallelLayout(pp=8).stage_layers(60) == [6, 8, 8, 8, 8, 8, 8, 6]  # Qwen3.5-397B at PP=8
    assert ParallelLayout(pp=4).stage_layers(8) == [2, 2, 2, 2]  # even: untouched
    assert ParallelLayout(pp=4).resolve(8) == ParallelLayout(pp=4)
    assert ParallelLayout(pp=2, first_stage_layers=1).stage_layers(3) == [1, 2]  # explicit wins
    for L in range(2, 40):
        for pp in range(2, min(L, 9) + 1):
            stages = ParallelLayout(pp=pp).stage_layers(L)
            assert len(stages) == pp and sum(stages) == L and min(stages) >= 1, (L, pp, stages)
            if L % pp:
                first, last = auto_stage_layers(L, pp)
                assert (stages[0], stages[-1]) == (first, last) and first >= last
                TransformerConfig(num_layers=L, hidden_size=8, num_attention_heads=1, pipeline_model_parallel_size=pp,
                                  num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                                  pipeline_dtype=torch.float32)

"""bf16 actor and critic (model.dtype=bf16): forward close to fp32, fp32 main grads and main params.

Tolerance is not a guess: transformers' own bf16 forward of the same checkpoint is the yardstick.
Its error against transformers' fp32 logits, e_hf, is what bf16 costs in a correct implementation;
megatron's bf16 logits must be within 2 e_hf of the fp32 reference (and visibly bf16: error > 0),
and megatron's fp32 logits equal transformers' fp32 ones (1e-4, as in verify). The critic shares the
backbone, so its values' bf16 error, relative to their scale, must be within the actor logits'
relative bf16 error (x2). A backward + optimizer step in bf16 leaves fp32 ``main_grad`` buffers and
fp32 main params in megatron's distributed optimizer, and the bf16 gradient points the same way as
the fp32 one (cosine > 0.99).
"""
import pytest
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.models.tiny_models import save_tiny_hf


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from megatron_s3ac.convert import hf_to_mcore

    root = tmp_path_factory.mktemp("prec")
    hf = save_tiny_hf("qwen3_moe", str(root / "hf"), seed=2)
    hf_to_mcore(hf, str(root / "mcore"), progress=False)
    return hf, str(root / "mcore")


def _tokens():
    return torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))


def run_models(hf_dir, mcore_dir):
    from megatron.core import dist_checkpointing

    from megatron_s3ac.models.actor_critic import build_actor, build_critic, build_transformer_config
    from megatron_s3ac.models.logprobs import vocab_parallel_log_probs
    from megatron_s3ac.models.optim import build_optimizer, wrap_ddp
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.models.pipeline import forward_backward
    from megatron_s3ac.models.registry import load_hf_config, model_info

    info = model_info(load_hf_config(hf_dir))
    lay = ParallelLayout()
    initialize_model_parallel(lay, seed=1)
    ids = _tokens()
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        cfg = build_transformer_config(info, lay, dt)
        actor = build_actor(info, cfg)
        actor.load_state_dict(dist_checkpointing.load(actor.sharded_state_dict(), mcore_dir))
        assert next(actor.parameters()).dtype == dt
        critic = build_critic(info, build_transformer_config(info, lay, dt))
        sd = {k: v for k, v in actor.state_dict().items() if not k.startswith("output_layer")}
        critic.module.load_state_dict(sd, strict=False)
        torch.manual_seed(5)
        with torch.no_grad():
            critic.module.output_layer.weight.normal_(0, 0.1)  # same head in both dtypes
            out[(dt, "logits")] = actor(ids, pos, None)[..., :info.vocab_size].float()
            out[(dt, "values")] = critic(ids, pos, None).float()
        ddp = wrap_ddp(actor, cfg)
        opt = build_optimizer([ddp], lr=1e-3)

        def loss(b, o):
            lp = vocab_parallel_log_probs(o, b["labels"], info.vocab_size)
            assert lp.dtype == torch.float32  # the loss maths is fp32 under bf16
            return -lp.sum(), torch.tensor(lp.numel()), {}

        ddp.zero_grad_buffer()
        forward_backward([ddp], [{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}], loss)
        out[(dt, "grad_dtypes")] = {p.main_grad.dtype for p in actor.parameters()}
        out[(dt, "grad")] = torch.cat([p.main_grad.flatten() for p in actor.parameters()]).clone()
        ok, _, _ = opt.step()
        assert ok
        inner = opt.chained_optimizers[0]
        out[(dt, "main_param_dtypes")] = {p.dtype for g in inner.optimizer.param_groups for p in g["params"]}
        out[(dt, "state_dtypes")] = {v.dtype for s in inner.optimizer.state.values() for v in s.values()
                                     if torch.is_tensor(v) and v.numel() > 1}
    return out


def test_bf16_close_to_fp32(ckpt):
    from transformers import AutoModelForCausalLM

    hf_dir, mcore_dir = ckpt
    ids = _tokens()
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(input_ids=ids).logits
        hf16 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()(input_ids=ids).logits.float()
    out = run_distributed(run_models, 1, hf_dir, mcore_dir)[0]
    f32, b16 = out[(torch.float32, "logits")], out[(torch.bfloat16, "logits")]
    assert (f32 - ref).abs().max() < 1e-4
    e_hf = (hf16 - ref).abs().max().item()
    e_mc = (b16 - ref).abs().max().item()
    assert 0 < e_mc <= 2 * e_hf, (e_mc, e_hf)
    rel_logits = e_mc / ref.abs().max().item()
    v32, v16 = out[(torch.float32, "values")], out[(torch.bfloat16, "values")]
    rel_values = ((v16 - v32).abs().max() / v32.abs().max()).item()
    assert 0 < rel_values <= 2 * rel_logits, (rel_values, rel_logits)
    for dt in (torch.float32, torch.bfloat16):
        assert out[(dt, "grad_dtypes")] == {torch.float32}
        assert out[(dt, "main_param_dtypes")] == {torch.float32}
        assert out[(dt, "state_dtypes")] == {torch.float32}  # Adam moments in fp32
    g32, g16 = out[(torch.float32, "grad")], out[(torch.bfloat16, "grad")]
    assert torch.nn.functional.cosine_similarity(g32, g16, dim=0) > 0.99


def test_optimizer_refusals_are_clear():
    """What megatron-core 0.19.2 cannot do on this CPU machine is refused by name (models/optim.py)."""
    from megatron_s3ac.models.gloo_ranks import DistributedTestError

    with pytest.raises(DistributedTestError, match="OptimizerUnavailable: optim.cpu_offload needs the model on a CUDA"):
        run_distributed(_refuse, 1, dict(cpu_offload=True))
    with pytest.raises(DistributedTestError, match=r"OptimizerUnavailable: optim.precision_aware \(bf16 Adam moments\) needs Transformer Engine"):
        run_distributed(_refuse, 1, dict(precision_aware=True))


def _refuse(kw):
    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.optim import build_optimizer, wrap_ddp
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.models.tiny_models import tiny_config

    info = model_info(tiny_config("qwen2").to_dict())
    initialize_model_parallel(ParallelLayout())
    cfg = build_transformer_config(info, ParallelLayout(), torch.bfloat16)
    build_optimizer([wrap_ddp(build_actor(info, cfg), cfg)], lr=1e-3, **kw)

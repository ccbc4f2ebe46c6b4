"""The GPU-scale switches in the trainer (issue 15): config keys validated by name; the first steps of
the tiny demo model (EP=2, 2 gloo ranks, S3AC with critic and R3) give the same fp32 metrics with
train.recompute=full (rel 1e-5), with algo.logprob_chunk_tokens (rel 1e-5) and, bit for bit, with
train.offload_idle=true (the models really leave and come back: bytes are logged)."""
import math

import pytest

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.config import ConfigError, load_config
from tests.trainer.test_trainer import SMALL


@pytest.mark.parametrize("overrides,msg", [
    (["train.recompute=selective", "train.recompute_modules=[core_attn,layernorm]"],
     r"train.recompute: train.recompute_modules \['layernorm'\] need Transformer Engine"),
    (["train.recompute=none", "train.recompute_num_layers=2"], "train.recompute: recompute_modules / recompute_num_layers need"),
    (["train.recompute=partial"], r"expected one of \[none, selective, full\]"),
    (["model.dtype=fp16"], r"expected one of \[fp32, bf16\]"),
    (["optim.actor.offload_fraction=1.5"], r"optim.actor.offload_fraction=1.5 must be in \[0, 1\]"),
    (["algo.logprob_chunk_tokens=-1"], "algo.logprob_chunk_tokens must be >= 0"),
    (["rollout.engine=trtllm"], r"rollout\.engine: 'trtllm' is not one of \('cpu', 'hf', 'sglang', 'vllm'"),
])
def test_config_errors(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, SMALL + overrides)


def test_config_keys_reach_the_builders():
    from megatron_s3ac.trainer.step.build import _config_kw, _optim_kw, model_dtype
    from megatron_s3ac.config import layout_of

    cfg = load_config(None, SMALL + ["model.dtype=bf16", "train.recompute=full", "train.recompute_num_layers=2",
                                     "optim.critic.cpu_offload=true", "optim.critic.offload_fraction=0.5",
                                     "actor_layout.pp=2", "actor_layout.first_stage_layers=1"])
    import torch

    assert model_dtype(cfg) == torch.bfloat16
    assert _config_kw(cfg) == dict(dtype=torch.bfloat16, recompute="full", recompute_modules=None, recompute_num_layers=2)
    assert _optim_kw(cfg.optim.critic) == dict(cpu_offload=True, offload_fraction=0.5, precision_aware=False)
    assert _optim_kw(cfg.optim.actor)["cpu_offload"] is False
    assert layout_of(cfg.actor_layout).first_stage_layers == 1


def _same(a, b) -> bool:
    """Equal, NaN included (e.g. critic/explained_variance of a constant return)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _runs(out_dir):
    from megatron_s3ac.trainer.step.trainer import Trainer

    common = SMALL + ["actor_layout.ep=2", "algo.dynamic_sampling=false"]
    res = {}
    for name, extra in (("base", []), ("recompute", ["train.recompute=full"]),
                        ("chunked", ["algo.logprob_chunk_tokens=8"]), ("offload", ["train.offload_idle=true"])):
        tr = Trainer(load_config(None, common + extra + [f"train.out_dir={out_dir}/{name}"]))
        res[name] = [tr.step() for _ in range(3)]
        tr.close()
    return res


@pytest.mark.slow
def test_recompute_chunking_offload_keep_metrics(tmp_path):
    res = run_distributed(_runs, 2, str(tmp_path))[0]
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith(("time/", "mem/"))}  # noqa: E731
    base = [strip(m) for m in res["base"]]
    assert all(m["actor/opt_steps"] >= 1 and m["critic/opt_steps"] >= 1 for m in base)
    for name in ("recompute", "chunked"):
        for b, m in zip(base, (strip(x) for x in res[name])):
            assert b.keys() == m.keys()
            for k in b:
                if isinstance(b[k], float) and math.isfinite(b[k]):
                    assert m[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (name, k)
                else:
                    assert _same(m[k], b[k]), (name, k)
    for b, m in zip(base, (strip(x) for x in res["offload"])):  # bit-exact round trips
        assert b.keys() == m.keys() and all(_same(m[k], b[k]) for k in b), [k for k in b if not _same(m[k], b[k])]
    assert all(m["mem/offload_gb"] > 0 and m["time/offload"] > 0 for m in res["offload"])
    assert all("mem/actor_optimizer_gb" in m and "mem/critic_grads_gb" in m for m in res["offload"])

"""rollout.weights_dtype=fp8 in the trainer: config, the weight sync quantizes, the mismatch metrics and
the corrections switch (Trainer methods run on a stand-in ``self`` holding only what they read)."""
from types import SimpleNamespace

import pytest
import torch

from megatron_s3ac.algorithms.registry import get_algo
from megatron_s3ac.convert.fp8 import DEFAULT_KEEP, SCALE_SUFFIX
from megatron_s3ac.config import ConfigError, load_config
from megatron_s3ac.trainer.step.trainer import Trainer


def _cfg(*overrides):
    return load_config(None, ["model.tiny=arithmetic_moe", *overrides])


def test_config():
    cfg = _cfg("rollout.weights_dtype=fp8")
    assert cfg.rollout.weights_dtype == "fp8" and cfg.rollout.fp8_keep is None
    assert _cfg().rollout.weights_dtype == "bf16" and _cfg().algo.mismatch_corrections
    with pytest.raises(ConfigError, match="weights_dtype"):
        _cfg("rollout.weights_dtype=int4")
    with pytest.raises(ConfigError, match="rollout.fp8_keep: .*fused SGLang linear"):
        _cfg("rollout.weights_dtype=fp8", "rollout.fp8_keep=[q_proj]")
    assert _cfg("rollout.fp8_keep=[lm_head,mlp.gate]").rollout.fp8_keep == ["lm_head", "mlp.gate"]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_sync_weights_quantizes_for_fp8(monkeypatch, dtype):
    """fp8: the trainer hands the weight sync the plain engine and a quantizer (applied by the stage
    leaders before the transfer, rollout.sync.weight_sync); bf16: no quantizer."""
    import megatron_s3ac.rollout.sync.weight_sync as ws

    got = {}

    def fake_sync(chunks, info, engine, quantize=None):
        got["engine"], got["quantize"] = engine, quantize
        bucket = [("model.layers.0.mlp.down_proj.weight", torch.randn(8, 16))]
        engine.update_weights(list(quantize(bucket)) if quantize else bucket)

    class Engine:
        def __init__(self):
            self.names = []

        def update_weights(self, named):
            self.names += [n for n, _ in named]

    monkeypatch.setattr(ws, "sync_weights", fake_sync)
    eng = Engine()
    fake = SimpleNamespace(actor=[object()], info=None, engine=eng, _engine_asleep=False,
                           cfg=_cfg(f"rollout.weights_dtype={dtype}"))
    Trainer.sync_weights(fake)
    assert got["engine"] is eng
    if dtype == "fp8":
        assert got["quantize"].keywords == {"keep": DEFAULT_KEEP}
        assert eng.names == ["model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight" + SCALE_SUFFIX]
    else:
        assert got["quantize"] is None and eng.names == ["model.layers.0.mlp.down_proj.weight"]


@pytest.mark.parametrize("enabled", [True, False])
def test_mismatch_metrics_and_switch(enabled):
    cfg = _cfg("algo.name=grpo_x", f"algo.mismatch_corrections={enabled}")
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    old = torch.zeros(4, 4)
    beh = torch.zeros(4, 4)
    beh[0, 1] = -2.5  # log(pi_train / pi_rollout) = 2.5 > log 5 (IcePoP) and > 2 nats (MIS: row 0)
    beh[2, 0] = 1.0  # ratio e^-1 = 0.37 < 0.5: IcePoP masks this token; MIS (one-sided) keeps the row
    batch = SimpleNamespace(scores=torch.tensor([1.0, -1.0, 1.0, -1.0]), mask=mask, old_logp=old, rollout_logp=beh,
                            is_w=None, keep=None)
    fake = SimpleNamespace(cfg=cfg, spec=get_algo("grpo_x"), uses_critic=False, entropy_control=None)
    m = Trainer.advantages(fake, batch)
    n = float(mask.sum())
    assert m["mismatch/icepop_masked_frac"] == pytest.approx(2 / n)
    assert m["mismatch/mis_masked_frac"] == pytest.approx(1 / 4)
    assert m["mismatch/keep_frac"] == pytest.approx((n - 3 - 1) / n)  # row 0 (3 tokens) + token (2, 0)
    w = torch.tensor([2.0, 1.0, 1.0, 1.0, 1.0, 1.0, float(torch.exp(torch.tensor(-1.0))), 1.0, 1.0, 1.0])
    assert m["mismatch/is_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-6)  # capped at tis_cap=2
    if enabled:
        assert batch.keep is not None and float(batch.keep[0].sum()) == 0 and float(batch.is_w[0, 1]) == 2.0
    else:
        assert batch.is_w is None and batch.keep is None


def test_gap_metrics_without_r3():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    beh = torch.tensor([[-1.2, -1.9, 5.0], [-0.5, 9.0, 0.0]])
    batch = SimpleNamespace(mask=mask, rollout_logp=beh, old_logp=None)
    fake = SimpleNamespace(r3_on=False, _forward_only=lambda which, b, what: {"logp": old, "entropy": torch.zeros(2, 3)})
    m = Trainer.old_logprobs(fake, batch)
    assert m["mismatch/logprob_abs_diff"] == pytest.approx((0.2 + 0.1 + 0.0) / 3)
    d = (beh - old).double()  # log q - log p, q = rollout (approx_kl sums in float64)
    k3 = (torch.exp(-d) - 1 + d)[mask.bool()].mean()
    assert m["mismatch/kl_k3"] == pytest.approx(float(k3), rel=1e-6)


def _fp8_step(out_dir):
    from tests.trainer.test_trainer import SMALL

    from megatron_s3ac.trainer.step.trainer import Trainer as T

    cfg = load_config(None, SMALL + ["algo.dynamic_sampling=false", "actor_layout.ep=2", "rollout.weights_dtype=fp8",
                                     f"train.out_dir={out_dir}"])
    tr = T(cfg)
    m = tr.step()
    stats = tr.sync_weights()  # the real sync: stage leaders quantize, the engine rank dequantizes
    return {"m": m, "bytes": stats.bytes, "engine": tr.engine is not None,
            "fp32_bytes": sum(p.numel() * 4 for p in tr.engine.model.parameters()) if tr.engine is not None else 0}


def test_fp8_rollout_weights_end_to_end_world2(tmp_path):
    """Trainer with rollout.weights_dtype=fp8 on 2 gloo ranks (EP=2): the engine serves the quantized weights
    (train/rollout KL nonzero, where bf16 gives ~0: tests/trainer/test_trainer.py) and the sync sends fp8-sized
    bytes (well under the fp32 weights' bytes; the LM head, embeddings, router and norms stay fp32)."""
    from megatron_s3ac.models.gloo_ranks import run_distributed

    res = run_distributed(_fp8_step, 2, str(tmp_path))
    m = res[0]["m"]
    assert m["mismatch/train_rollout_kl"] != 0 and m["mismatch/kl_k3"] > 0
    eng = next(r for r in res if r["engine"])
    assert 0 < eng["bytes"] < 0.75 * eng["fp32_bytes"]

"""A new engine kind plugs in by registering, in ONE place (this module): its settings, construction (wrapping the
CPU engine), capabilities and weight-sync strategy; the trainer runs an RL step with ``rollout.engine`` set to it and
no other edit (issue 38: engines registered like weight syncs)."""
import dataclasses

import pytest

from megatron_s3ac.rollout.engines.registry import EngineRequest, EngineSpec, register_engine
from megatron_s3ac.rollout.errors import ConfigError, EngineSettings
from megatron_s3ac.rollout.sync.strategy import register_weight_sync
from megatron_s3ac.rollout.sync.weight_sync import ColocatedRankZeroSync
from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.config import ConfigError as TrainerConfigError, load_config

SMALL = ["model.tiny=arithmetic_moe", "rollout.prompts_per_step=8", "rollout.k=4", "rollout.max_new_tokens=4",
         "data.num_prompts=200", "data.eval_prompts=16", "algo.actor_minibatches=4", "algo.critic_minibatches=4",
         "daps.warmup_steps=0", "daps.rampup_steps=1", "train.progress=false", "train.tensorboard=false",
         "algo.dynamic_sampling=false"]


# ---- the new kind, everything it brings ------------------------------------------------------------------------
@dataclasses.dataclass
class ToySettings(EngineSettings):
    """The kind's own section (defaults: the trainer's config has no ``rollout.toy_cpu`` key)."""
    threads: int = 1
    section = "rollout.toy_cpu"


class ToyEngineSync(ColocatedRankZeroSync):
    """Its colocated weight path: the rank-0 path, counting syncs on the engine."""

    def sync(self, chunks, info, weights_loaded=None):
        if self.engine is not None:
            self.engine.toy_syncs = getattr(self.engine, "toy_syncs", 0) + 1
        return super().sync(chunks, info, weights_loaded)


class ToySpec(EngineSpec):
    kind = "toy_cpu"
    settings_cls = ToySettings
    section = "toy_cpu"
    needs_model_dir = False  # an HF config suffices: weights come from the first sync
    partial_rollout = False

    def check_settings(self, settings):
        if settings.threads < 1:
            raise ConfigError(f"rollout.toy_cpu.threads: must be >= 1, got {settings.threads}")

    def local_device(self):
        return "cpu"

    def factory(self, req: EngineRequest):
        from megatron_s3ac.rollout.factory import make_engine_factory

        return make_engine_factory(self.kind, model_dir=req.weights_dir, settings=req.settings,
                                   hf_config=None if req.weights_dir else req.hf_config(), dtype=req.dtype,
                                   device=req.device, torch_threads=req.torch_threads)

    def build(self, factory, slot=None):
        from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine

        dev = {k: v for k, v in (("dtype", factory.dtype), ("device", factory.device)) if v is not None}
        engine = (CPUEngine.from_pretrained(factory.model_dir, **dev) if factory.model_dir else
                  CPUEngine.from_config(factory.hf_config, seed=factory.seed, **dev))
        engine.toy_kind = self.kind  # what the test checks: this spec built the trainer's engine
        return engine


register_engine(ToySpec())
register_weight_sync("toy_cpu", "colocated", ToyEngineSync)
# -------------------------------------------------------------------------------------------------------------------


def _one_step(out_dir):
    from megatron_s3ac.trainer.step.trainer import Trainer

    cfg = load_config(None, SMALL + ["rollout.engine=toy_cpu", f"train.out_dir={out_dir}"])
    tr = Trainer(cfg)
    metrics = tr.step()
    res = {"kind": getattr(tr.engine, "toy_kind", None), "syncs": getattr(tr.engine, "toy_syncs", 0),
           "strategy": type(tr.sync_strategy).__name__, "metrics": sorted(metrics)}
    tr.close()
    return res


def test_a_registered_engine_kind_runs_an_rl_step(tmp_path):
    r = run_distributed(_one_step, 1, str(tmp_path))[0]
    assert r["kind"] == "toy_cpu" and r["strategy"] == "ToyEngineSync" and r["syncs"] >= 1
    assert any(m.startswith("rollout/") for m in r["metrics"]), r["metrics"]


def test_registered_kind_is_validated_by_its_spec():
    """The kind's capabilities and settings drive the config checks; an unknown kind names the known ones."""
    cfg = load_config(None, SMALL + ["rollout.engine=toy_cpu"])
    assert cfg.rollout.engine == "toy_cpu"
    with pytest.raises(TrainerConfigError, match=r"rollout.partial_rollout=true: rollout.engine=toy_cpu cannot pause "
                                                 r"generation \(only cpu / hf / sglang / vllm can\)"):
        load_config(None, SMALL + ["rollout.engine=toy_cpu", "rollout.partial_rollout=true", "train.max_staleness=1",
                                   "rollout.placement=separate"])
    with pytest.raises(TrainerConfigError, match=r"rollout.engine: 'trtllm' is not one of \('cpu', 'hf', 'sglang', "
                                                 r"'vllm', .*'toy_cpu'"):
        load_config(None, SMALL + ["rollout.engine=trtllm"])
    for kind in ("cpu", "hf"):  # the YAML values of before, unchanged
        assert load_config(None, SMALL + [f"rollout.engine={kind}"]).rollout.engine == kind

"""rollout.engine=vllm and the rollout.vllm section, validated when the config loads (no engine started): the
dotted key named on every refusal, the model checks (built-in tiny model, head_dim on CPU), and the factory's
defaults (the environment `make vllm-env` builds)."""
import os

import pytest

from megatron_s3ac.rollout.factory import ConfigError as EngineConfigError
from megatron_s3ac.rollout.factory import make_engine_factory, validate_rollout_engine
from megatron_s3ac.rollout.engines.vllm.settings import DEFAULT_VENV, VLLMSettings, engine_python, validate_vllm_settings
from megatron_s3ac.config import ConfigError, load_config
from vllm_fixtures import save_tiny_qwen3, tiny_qwen3_config


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("q3")))


def _cfg(path, *extra):
    return load_config(None, [f"model.hf_config={path}", f"model.engine_hf_dir={path}", "rollout.engine=vllm",
                              *extra])


def test_vllm_section_loads_and_refuses_naming_the_key(qwen3_dir):
    cfg = _cfg(qwen3_dir, "rollout.vllm.tp_size=2", "rollout.vllm.gpus_per_engine=2", "rollout.vllm.dtype=bfloat16",
               "rollout.vllm.max_model_len=128", "rollout.vllm.enforce_eager=true", "rollout.vllm.expert_parallel=true")
    assert cfg.rollout.vllm.tp_size == 2 and cfg.rollout.vllm.dtype == "bfloat16"
    for bad, key in [("rollout.vllm.tp_size=2", "rollout.vllm.gpus_per_engine: 1 GPUs per engine but tp_size x "
                                                "dp_size = 2 x 1"),
                     ("rollout.vllm.dtype=fp8", "rollout.vllm.dtype: 'fp8' is not one of"),
                     ("rollout.vllm.gpu_memory_utilization=1.5", "rollout.vllm.gpu_memory_utilization: must be in"),
                     ("rollout.vllm.max_model_len=1", "rollout.vllm.max_model_len: must be an integer >= 2"),
                     ("rollout.vllm.num_engines=0", "rollout.vllm.num_engines: must be a positive integer")]:
        with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace(")", r"\)")):
            _cfg(qwen3_dir, bad)
    with pytest.raises(ConfigError, match="rollout.vllm.no_such"):
        _cfg(qwen3_dir, "rollout.vllm.no_such=1")


def test_gpu_counts_against_the_trainer(qwen3_dir):
    s = VLLMSettings(num_engines=2, tp_size=2, gpus_per_engine=2)
    validate_vllm_settings(s, trainer_gpus=4, placement="colocated")
    with pytest.raises(EngineConfigError, match="rollout.vllm.num_engines: 2 engines x 2 GPUs = 4 GPUs, but "
                                                "colocated"):
        validate_vllm_settings(s, trainer_gpus=8, placement="colocated")
    with pytest.raises(EngineConfigError, match="the cluster has 8 GPUs and the trainer uses 6: 2 left"):
        validate_vllm_settings(s, cluster_gpus=8, trainer_gpus=6, placement="separate")


def test_models_vllm_cannot_serve(tmp_path):
    with pytest.raises(ConfigError, match="rollout.engine: vllm cannot serve the built-in tiny model"):
        load_config(None, ["model.tiny=arithmetic_moe", "rollout.engine=vllm"])
    small = save_tiny_qwen3(str(tmp_path / "hd16"), tiny_qwen3_config(head_dim=16))
    with pytest.raises(EngineConfigError, match=r"head_dim in \(32, 64.*head_dim=16"):
        validate_rollout_engine("vllm", model_dir=small)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(EngineConfigError, match="has no config.json"):
        validate_rollout_engine("vllm", model_dir=str(tmp_path / "empty"))


def test_factory_defaults_to_the_built_environment(qwen3_dir, monkeypatch):
    monkeypatch.delenv("S3AC_VLLM_PYTHON", raising=False)
    f = make_engine_factory("vllm", model_dir=qwen3_dir)
    assert f.kind == "vllm" and f.settings is None
    assert engine_python() == os.path.join(DEFAULT_VENV, "bin", "python")
    assert DEFAULT_VENV == os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), ".venv-vllm")  # the repository root's, where `make vllm-env` builds it
    with pytest.raises(EngineConfigError, match="vllm needs an HF checkpoint directory"):
        make_engine_factory("vllm")
    from megatron_s3ac.rollout.engines.vllm.engine import VLLMEngine, VLLMEngineError

    with pytest.raises(VLLMEngineError, match="run `make vllm-env`"):
        VLLMEngine(qwen3_dir, VLLMSettings(python="/nonexistent/python"))


@pytest.mark.parametrize("placement, cls_name", [("colocated", "VLLMSessionSync"), ("separate", "VLLMStageSync")])
def test_vllm_registers_its_weight_sync(placement, cls_name, qwen3_dir):
    """rollout.sync.strategy finds vLLM's strategies by (engine, placement); built on every rank from the config."""
    from megatron_s3ac.rollout.engines.vllm import sync as vllm_sync
    from megatron_s3ac.rollout.factory import make_sync_strategy
    from megatron_s3ac.trainer.step.engine_side import sync_strategy_for

    s = make_sync_strategy("vllm", placement)
    assert type(s) is getattr(vllm_sync, cls_name) and not s.sleeps  # no engine on this rank: nothing to sleep
    cfg = _cfg(qwen3_dir, f"rollout.placement={placement}")
    t = sync_strategy_for(cfg)
    assert type(t) is type(s) and isinstance(t.settings, VLLMSettings)  # rollout.vllm is its section
    # rollout.weights_dtype: fp8: the engine quantizes online (GPU), so the strategy sends the checkpoint's dtype
    assert make_sync_strategy("vllm", placement, quantize=lambda b: b).quantize is None

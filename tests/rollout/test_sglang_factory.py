"""rollout.engine / rollout.sglang: validation naming the dotted key, models sglang cannot serve refused naming
rollout.engine, and the factory building engines (SGLang through the 0.5.23 stand-in)."""
import pickle

import pytest

from megatron_s3ac.rollout.factory import (
    ConfigError, SGLangSettings, make_engine_factory, validate_rollout_engine,
    validate_sglang_settings,
)
from megatron_s3ac.rollout.engines.sglang.engine import SGLangEngine

from fake_sglang import FakeSGLangEngine, save_tiny_qwen3_moe
from rollout_fixtures import char_tokenizer


@pytest.fixture(scope="module")
def servable(tmp_path_factory):
    path = save_tiny_qwen3_moe(tmp_path_factory.mktemp("servable"))
    char_tokenizer().save_pretrained(path)
    return path


def test_consistent_settings_pass():
    s = SGLangSettings(num_engines=2, gpus_per_engine=8, tp_size=8, ep_size=8, attn_dp_size=8,
                       moe_a2a_backend="deepep")
    validate_sglang_settings(s, cluster_gpus=32, trainer_gpus=16, placement="separate")
    validate_sglang_settings(s, trainer_gpus=16, placement="colocated")
    validate_sglang_settings(SGLangSettings(num_engines=4, gpus_per_engine=16, tp_size=16, gpus_per_node=8),
                             cluster_gpus=64, placement="separate")


@pytest.mark.parametrize("kwargs,where,key", [
    (dict(gpus_per_engine=4, tp_size=2, attn_dp_size=2), {}, "rollout.sglang.gpus_per_engine"),
    (dict(gpus_per_engine=4, tp_size=4, attn_dp_size=3), {}, "rollout.sglang.attn_dp_size"),
    (dict(gpus_per_engine=4, tp_size=4, ep_size=3), {}, "rollout.sglang.ep_size"),
    (dict(gpus_per_engine=4, tp_size=4, ep_size=2, moe_a2a_backend="deepep"), {}, "rollout.sglang.ep_size"),
    (dict(moe_a2a_backend="nccl"), {}, "rollout.sglang.moe_a2a_backend"),
    (dict(mem_fraction_static=1.2), {}, "rollout.sglang.mem_fraction_static"),
    (dict(dtype="fp8"), {}, "rollout.sglang.dtype"),
    (dict(num_engines=0), {}, "rollout.sglang.num_engines"),
    (dict(gpus_per_engine=12, tp_size=12, gpus_per_node=8), {}, "rollout.sglang.gpus_per_engine"),
    (dict(num_engines=3, gpus_per_engine=8, tp_size=8), dict(cluster_gpus=32, trainer_gpus=16, placement="separate"),
     "rollout.sglang.num_engines"),
    (dict(num_engines=3, gpus_per_engine=8, tp_size=8), dict(trainer_gpus=16, placement="colocated"),
     "rollout.sglang.num_engines"),
    # colocated engines on fewer GPUs than the trainer: trainer GPUs without an engine shard
    (dict(num_engines=1, gpus_per_engine=8, tp_size=8), dict(trainer_gpus=16, placement="colocated"),
     "rollout.sglang.num_engines"),
    (dict(num_engines=1, gpus_per_engine=4, tp_size=4), dict(trainer_gpus=6, placement="colocated"),
     "rollout.sglang.num_engines"),
])
def test_inconsistent_settings_name_the_key(kwargs, where, key):
    with pytest.raises(ConfigError, match=f"^{key.replace('.', '[.]')}: "):
        validate_sglang_settings(SGLangSettings(**kwargs), **where)


def test_colocated_names_the_engine_count_that_fits():
    with pytest.raises(ConfigError, match="1 engines x 8 GPUs = 8 GPUs, but colocated engines must cover the "
                                          "trainer's 16 GPUs one-to-one .*: use num_engines: 2$"):
        validate_sglang_settings(SGLangSettings(num_engines=1, gpus_per_engine=8, tp_size=8), trainer_gpus=16)
    with pytest.raises(ConfigError, match="6 is not a multiple of gpus_per_engine=4"):
        validate_sglang_settings(SGLangSettings(num_engines=1, gpus_per_engine=4, tp_size=4), trainer_gpus=6)
    validate_sglang_settings(SGLangSettings(num_engines=4, gpus_per_engine=4, tp_size=4), trainer_gpus=16)


def test_unknown_key_named():
    with pytest.raises(ConfigError, match="^rollout.sglang.tp: unknown key"):
        SGLangSettings.from_dict({"tp": 2})


def test_models_sglang_cannot_serve_are_refused_naming_rollout_engine(tmp_path, servable):
    validate_rollout_engine("cpu", tiny="arithmetic_moe")  # the demo keeps working on the CPU engine
    validate_rollout_engine("sglang", model_dir=servable)
    with pytest.raises(ConfigError, match="^rollout.engine: sglang cannot serve the built-in tiny model"):
        validate_rollout_engine("sglang", tiny="arithmetic_moe")
    with pytest.raises(ConfigError, match="^rollout.engine: 'trtllm' is not one of"):
        validate_rollout_engine("trtllm", model_dir=servable)
    dense = save_tiny_qwen3_moe(tmp_path / "dense", mlp_only_layers=[1])
    char_tokenizer().save_pretrained(dense)
    with pytest.raises(ConfigError, match="^rollout.engine: .*Qwen3-MoE with dense layers"):
        validate_rollout_engine("sglang", model_dir=dense)
    no_tok = save_tiny_qwen3_moe(tmp_path / "no_tok")
    with pytest.raises(ConfigError, match="^rollout.engine: .*no tokenizer files"):
        validate_rollout_engine("sglang", model_dir=no_tok)
    with pytest.raises(ConfigError, match="^rollout.engine: sglang starts from an HF checkpoint directory"):
        validate_rollout_engine("sglang")


def test_factory_maps_settings_to_server_args(servable):
    s = SGLangSettings(tp_size=1, gpus_per_engine=1, mem_fraction_static=0.5, cuda_graphs=False, bucket_mb=3,
                       deterministic_inference=True, context_length=128)
    factory = make_engine_factory("sglang", model_dir=servable, settings=s, seed=7, engine_cls=FakeSGLangEngine)
    pickle.loads(pickle.dumps(factory))  # travels to Ray actors
    engine = factory()
    assert isinstance(engine, SGLangEngine) and engine.bucket_bytes == 3 << 20 and engine.context_length == 128
    args = engine.engine.server_args
    assert args["mem_fraction_static"] == 0.5 and args["disable_cuda_graph"] is True
    assert engine.engine.deterministic and engine.engine.return_routes and engine.engine.memory_saver
    cpu = make_engine_factory("cpu", model_dir=servable)()
    assert type(cpu).__name__ == "CPUEngine"
    with pytest.raises(ConfigError, match="^rollout.engine"):
        make_engine_factory("sglang")

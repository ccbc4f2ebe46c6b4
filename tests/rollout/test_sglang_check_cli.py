"""`s3ac-train check` (the CLI) on a Qwen3-MoE checkpoint with a dense layer (mlp_only_layers=[1]): sglang 0.5.23's
Qwen3-MoE makes every layer sparse (models/qwen3_moe.py:878) and would skip the dense MLP's weights silently, so
rollout.engine=sglang is refused naming `rollout.engine`; the same config with rollout.engine=cpu is accepted."""
import pytest

BASE = ["rollout.prompts_per_step=4", "rollout.k=4", "rollout.max_new_tokens=4", "data.num_prompts=200",
        "data.eval_prompts=8", "algo.actor_minibatches=4", "algo.critic_minibatches=4", "daps.warmup_steps=0",
        "daps.rampup_steps=1", "train.progress=false", "train.tensorboard=false", "train.eval_every=0",
        "algo.dynamic_sampling=false", "actor_layout.ep=2"]


@pytest.fixture(scope="module")
def dense_layer_dir(tmp_path_factory):
    """The demo's arithmetic Qwen3-MoE with layer 1 dense, as an HF directory (config, safetensors, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_s3ac.models.tiny_models import char_tokenizer
    from megatron_s3ac.data.prompts import ARITH_CHARS
    from megatron_s3ac.tasks.arithmetic import tiny_arithmetic_hf_config

    path = str(tmp_path_factory.mktemp("dense_layer_hf"))
    hf = tiny_arithmetic_hf_config()
    hf.mlp_only_layers = [1]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf)
    assert not hasattr(model.model.layers[1].mlp, "experts")  # transformers builds layer 1 as a dense MLP
    model.save_pretrained(path)
    char_tokenizer(ARITH_CHARS).save_pretrained(path)
    return path


def overrides(path, engine):
    return BASE + [f"model.hf_config={path}", f"model.engine_hf_dir={path}", f"rollout.engine={engine}",
                   "rollout.sglang.bucket_mb=1"]


def test_check_refuses_dense_layers_under_sglang_naming_rollout_engine(dense_layer_dir, capsys, monkeypatch):
    from megatron_s3ac.trainer.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["check"] + overrides(dense_layer_dir, "sglang")) != 0
    err = capsys.readouterr().err
    assert "rollout.engine" in err and "mlp_only_layers=[1]" in err, err
    assert main(["check"] + overrides(dense_layer_dir, "cpu")) == 0, capsys.readouterr().err

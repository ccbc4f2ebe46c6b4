"""preflight(cfg): layout rules without a world size, world-size rules with one, memory fit by phase/stage."""
import os

from megatron_s3ac.plan.memory import Knobs
from megatron_s3ac.plan.preflight import preflight

CFG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_configs")
TINY = {"model": {"tiny": "arithmetic_moe"}}


def test_ep3_with_4_experts_refused_without_world_size():
    rep = preflight({**TINY, "actor_layout": {"ep": 3}})
    assert not rep.ok
    assert any("actor_layout: num_experts 4 is not divisible by ep 3" in m for m in rep.errors)
    assert rep.checked_world is None


def test_critic_layout_checked_separately():
    rep = preflight({**TINY, "actor_layout": {"ep": 2}, "critic_layout": {"tp": 3}})
    assert [m for m in rep.errors if m.startswith("critic_layout:")] and \
        not [m for m in rep.errors if m.startswith("actor_layout:")]


def test_world_size_rules_only_with_a_world():
    cfg = {**TINY, "actor_layout": {"tp": 2, "ep": 2}}
    assert preflight(cfg).ok
    rep = preflight(cfg, world_size=3)
    assert not rep.ok and any("world size 3" in m for m in rep.errors)
    rep = preflight({**cfg, "cluster": {"gpus": 6}})  # world from the cluster section
    assert rep.ok and rep.checked_world == 6


def test_memory_warnings_name_phase_and_stage():
    cfg = {"model": {"hf_config": os.path.join(CFG, "qwen3_5_397b_a17b")},
           "actor_layout": {"tp": 2, "pp": 4, "ep": 32, "etp": 1},
           "rollout": {"prompts_per_step": 32, "k": 8, "max_new_tokens": 16384}, "data": {"max_prompt_tokens": 2048},
           "cluster": {"gpus": 128, "gpus_per_node": 8, "gpu_mem_gib": 141, "host_mem_gib": 2048}}
    rep = preflight(cfg)
    assert rep.ok and rep.fits is False
    assert any("actor_update" in m and "pipeline stage" in m for m in rep.warnings)
    ok = preflight(cfg, knobs=Knobs(recompute="full", optimizer_offload=1.0, offload_idle=True))
    assert ok.fits is True and not ok.warnings


def test_unreadable_model_is_an_error():
    rep = preflight({"model": {"hf_config": "/nonexistent"}, "actor_layout": {"tp": 1}})
    assert not rep.ok and "cannot read the model config" in rep.errors[0]


def test_knobs_come_from_the_trainer_config_keys():
    from megatron_s3ac.plan.preflight import trainer_knobs

    assert trainer_knobs(TINY) == Knobs(dtype="fp32")  # the trainer's defaults: fp32, nothing offloaded
    cfg = {**TINY, "model": {"tiny": "arithmetic_moe", "dtype": "bf16"},
           "train": {"recompute": "selective", "offload_idle": True}, "algo": {"logprob_chunk_tokens": 512},
           "optim": {"actor": {"cpu_offload": True, "offload_fraction": 0.25, "precision_aware": True}},
           "rollout": {"placement": "separate"}}
    assert trainer_knobs(cfg) == Knobs(dtype="bf16", recompute="selective", offload_idle=True, logprob_chunk=512,
                                       optimizer_offload=0.25, precision_aware=True, placement="separate")
    cfg["optim"]["actor"]["cpu_offload"] = False  # the fraction only counts with the host optimizer on
    assert trainer_knobs(cfg).optimizer_offload == 0.0


def test_trainer_dataclass_config_gives_the_same_knobs():
    from megatron_s3ac.plan.preflight import trainer_knobs
    from megatron_s3ac.config import load_config

    d = {"model": {"tiny": "arithmetic_moe", "dtype": "bf16"}, "train": {"recompute": "full", "offload_idle": True}}
    cfg = load_config(overrides=["model.tiny=arithmetic_moe", "model.dtype=bf16", "train.recompute=full",
                                 "train.offload_idle=true"], check=False)
    assert trainer_knobs(cfg) == trainer_knobs(d) == Knobs(recompute="full", offload_idle=True)


def test_memory_fit_follows_the_config_keys():
    cfg = {"model": {"hf_config": os.path.join(CFG, "qwen3_5_397b_a17b"), "dtype": "bf16"},
           "actor_layout": {"tp": 2, "pp": 4, "ep": 32, "etp": 1},
           "rollout": {"prompts_per_step": 32, "k": 8, "max_new_tokens": 16384}, "data": {"max_prompt_tokens": 2048},
           "cluster": {"gpus": 128, "gpus_per_node": 8, "gpu_mem_gib": 141, "host_mem_gib": 2048}}
    assert preflight(cfg).fits is False
    cfg["train"] = {"recompute": "full", "offload_idle": True}
    cfg["optim"] = {"actor": {"cpu_offload": True, "offload_fraction": 1.0}}
    assert preflight(cfg).fits is True

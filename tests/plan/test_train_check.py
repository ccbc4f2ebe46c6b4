"""``s3ac-train check CONFIG [--strict]`` runs the planner's pre-flight (megatron_s3ac.plan.preflight)."""
import os

from megatron_s3ac.trainer import cli as train_cli

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
Q397 = os.path.join(ROOT, "examples", "hf_configs", "qwen3_5_397b_a17b")


def _yaml(tmp_path, text):
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return str(p)


def test_check_refuses_ep3_with_4_experts_without_world_size(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = _yaml(tmp_path, "model: {tiny: arithmetic_moe}\nactor_layout: {ep: 3}\n")
    assert train_cli.main(["check", path]) == 2
    err = capsys.readouterr().err
    assert "actor_layout: num_experts 4 is not divisible by ep 3" in err


def test_check_passes_the_demo(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert train_cli.main(["check", os.path.join(ROOT, "examples", "cpu_demo.yaml")]) == 0
    assert "actor_layout" in capsys.readouterr().out


def test_check_warns_and_strict_refuses_a_misfit(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = _yaml(tmp_path, f"model: {{hf_config: {Q397}}}\nactor_layout: {{tp: 2, pp: 4, ep: 32, etp: 1}}\n"
                           "data: {max_prompt_tokens: 2048}\nrollout: {prompts_per_step: 32, k: 8, max_new_tokens: 16384}\n"
                           "algo: {micro_batch_size: 1}\ntrain: {r3: off}\n"
                           "cluster: {gpus: 128, gpus_per_node: 8, gpu_mem_gib: 141, host_mem_gib: 2048}\n")
    assert train_cli.main(["check", path]) == 0  # bf16, no recompute, no offload: warn only
    err = capsys.readouterr().err
    assert "warning: memory: actor_update needs" in err and "pipeline stage 0" in err
    assert train_cli.main(["check", path, "--strict"]) == 2


def test_check_world_size_rule_from_cluster(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = _yaml(tmp_path, "model: {tiny: arithmetic_moe}\nactor_layout: {tp: 2, ep: 2}\n"
                           "cluster: {gpus: 3, gpus_per_node: 3, gpu_mem_gib: 80, host_mem_gib: 64}\n")
    assert train_cli.main(["check", path]) == 2
    assert "world size 3" in capsys.readouterr().err


def test_check_context_parallel_rules(tmp_path, capsys, monkeypatch):
    """actor_layout.cp / critic_layout.cp: the world-size rule (tp*cp*pp) and Qwen3.5's GDN-head rule."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = _yaml(tmp_path, "model: {tiny: arithmetic_moe}\nactor_layout: {ep: 2, cp: 2}\ncritic_layout: {cp: 4}\n"
                           "cluster: {gpus: 2, gpus_per_node: 2, gpu_mem_gib: 80, host_mem_gib: 64}\n")
    assert train_cli.main(["check", path]) == 2
    err = capsys.readouterr().err
    assert "critic_layout: world size 2 is not divisible by tp*cp*pp = 1*4*1" in err
    assert "actor_layout" not in err  # cp=2 with ep=2 fits 2 ranks
    path = _yaml(tmp_path, f"model: {{hf_config: {Q397}}}\nactor_layout: {{tp: 2, cp: 16, pp: 4, ep: 32, etp: 1}}\n"
                           "train: {r3: off}\n")
    assert train_cli.main(["check", path]) == 2
    assert "linear_num_key_heads 16 is not divisible by tp*cp = 2*16" in capsys.readouterr().err

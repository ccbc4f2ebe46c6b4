"""s3ac-plan end to end: verdicts known from first principles, output formats, bad input (exit 2)."""
import json
import os

import pytest

from megatron_s3ac.plan import cli

CFG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_configs")
Q397 = os.path.join(CFG, "qwen3_5_397b_a17b")
# actor + critic + colocated engine on 128 H200 (16 nodes x 8, 141 GiB), 2K prompt + 16K response
BASE = [Q397, "--gpus", "128", "--gpus-per-node", "8", "--gpu-mem-gib", "141", "--host-mem-gib", "2048",
        "--prompt-len", "2048", "--response-len", "16384", "--critic", "--placement", "colocated",
        "--dtype", "bf16"]


def _json(capsys, argv):
    assert cli.run(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_397b_bf16_without_recompute_or_offload_does_not_fit(capsys):
    d = _json(capsys, BASE + ["--recompute", "none", "--optimizer-offload", "0"])
    assert d["fits"] is False
    # first principles: no layout keeps bf16 params + fp32 grads + Adam of ~396B x 2 models and full
    # activations of 18K-token micro-batches under 141 GiB; the update is what breaks
    assert d["phases"]["actor_update"] > 141
    assert all(not c["fits"] for c in d["candidates"])
    assert d["suggestions"]


def test_397b_full_recompute_offload_fits(capsys):
    d = _json(capsys, BASE + ["--recompute", "full", "--optimizer-offload", "1.0", "--offload-idle"])
    assert d["fits"] is True
    assert d["peak_gib"] <= 141 and d["host_gib_per_node"] <= 2048
    for key in ("layout", "phases", "params_per_rank", "host_gib_per_node"):
        assert key in d
    assert set(d["phases"]) == {"rollout", "forward", "actor_update", "critic_update", "weight_sync"}
    lay = d["layout"]
    assert 128 % (lay["tp"] * lay["pp"]) == 0 and 512 % lay["ep"] == 0


def test_fixed_layout_states_scale_with_expert_dp(capsys):
    """EP32 x PP4 on 128 GPUs: expert-DP = 1, so the expert Adam states are not sharded at all; EP16
    gives expert-DP 2 and exactly half the expert parameters per rank twice over."""
    a = _json(capsys, BASE + ["--tp", "2", "--pp", "4", "--ep", "32"])
    b = _json(capsys, BASE + ["--tp", "2", "--pp", "4", "--ep", "16"])
    assert (a["dp"], a["expert_dp"], b["expert_dp"]) == (16, 1, 2)
    ea = a["params_per_rank_by_stage"][1]["expert"]
    eb = b["params_per_rank_by_stage"][1]["expert"]
    assert eb == 2 * ea
    # 15 layers x 512/32 experts x 3 x 4096 x 1024 on a middle stage
    assert ea == 15 * 16 * 3 * 4096 * 1024


def test_yaml_snippet_is_a_trainer_layout(capsys):
    import yaml

    assert cli.run(BASE + ["--recompute", "full", "--optimizer-offload", "1", "--offload-idle", "--yaml"]) == 0
    d = yaml.safe_load(capsys.readouterr().out)
    assert set(d["actor_layout"]) <= {"tp", "cp", "pp", "ep", "etp"}
    assert d["cluster"] == {"gpus": 128, "gpus_per_node": 8, "gpu_mem_gib": 141, "host_mem_gib": 2048}


def test_table_output(capsys):
    assert cli.run([os.path.join(CFG, "qwen2_5_math_1_5b"), "--gpus", "8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "rollout" in out and "best:" in out and "tp1 pp1" in out


@pytest.mark.parametrize("argv,msg", [
    ([], "give an HF config"),
    (["/nonexistent/config.json", "--gpus", "8"], "no HF config"),
    ([os.path.join(CFG, "qwen3_30b_a3b")], "--gpus"),
    ([os.path.join(CFG, "qwen3_30b_a3b"), "--gpus", "8", "--ep", "3"], "num_experts 128 is not divisible by ep 3"),
    ([os.path.join(CFG, "qwen3_30b_a3b"), "--gpus", "12", "--tp", "8"], "not divisible by tp*cp*pp"),
    ([os.path.join(CFG, "qwen3_30b_a3b"), "--gpus", "8", "--optimizer-offload", "1.5"], "optimizer_offload"),
    ([os.path.join(CFG, "qwen3_30b_a3b"), "--gpus", "8", "--recompute", "some"], "invalid choice"),
    (["--config", "/nonexistent.yaml", "--gpus", "8"], "no such file"),
])
def test_bad_input_exits_2_without_stdout(capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert msg in cap.err


def test_unsupported_model_type(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(SystemExit) as e:
        cli.main([str(tmp_path), "--gpus", "8"])
    assert e.value.code == 2 and "unsupported model_type 'llama'" in capsys.readouterr().err


def test_trainer_yaml(tmp_path, capsys):
    p = tmp_path / "t.yaml"
    p.write_text("model: {tiny: arithmetic_moe}\nactor_layout: {tp: 2, ep: 2}\n"
                 "rollout: {prompts_per_step: 8, k: 2, max_new_tokens: 16}\ndata: {max_prompt_tokens: 16}\n"
                 "cluster: {gpus: 4, gpus_per_node: 4, gpu_mem_gib: 80, host_mem_gib: 256}\n")
    d = _json(capsys, ["--config", str(p)])
    assert d["layout"] == {"tp": 2, "cp": 1, "pp": 1, "ep": 2, "etp": 1} and d["fits"] is True
    assert d["train_gpus"] == 4


@pytest.mark.slow  # > 60 s under load; the fast suite's 20-minute budget (CI)
def test_context_parallel_layout_for_long_responses(capsys):
    """The 397B at 2K + 64K on 128 H200: no CP-free layout fits (forward on the last stage), a CP one does."""
    base = [os.path.join(CFG, "qwen3_5_397b_a17b"), "--gpus", "128", "--prompt-len", "2048", "--response-len",
            "65536", "--recompute", "full", "--optimizer-offload", "1", "--offload-idle", "--json"]
    assert cli.run(base + ["--cp", "1"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert not d["fits"] and d["layout"]["cp"] == 1
    assert cli.run(base) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["layout"]["cp"] > 1
    assert d["dp"] == 128 // (d["layout"]["tp"] * d["layout"]["cp"] * d["layout"]["pp"])


@pytest.mark.slow
def test_docs_cp_table_matches_planner(capsys):
    """docs/planner.md's context-parallel table (397B, 2K + 16K..128K on 128 H200) is what s3ac-plan answers:
    each row's best layout and peak (CP searched), and the CP-free verdict (layout and peak, or "none fits")."""
    import re

    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "planner.md")).read()

    def name(lay):
        return f"TP{lay['tp']}" + (f" CP{lay['cp']}" if lay["cp"] > 1 else "") + \
            f" PP{lay['pp']} EP{lay['ep']} ETP{lay['etp']}"

    for label, r in (("16K", 16384), ("32K", 32768), ("64K", 65536), ("128K", 131072)):
        row = next(line for line in doc.splitlines() if line.startswith(f"| {label} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        base = [Q397, "--gpus", "128", "--prompt-len", "2048", "--response-len", str(r), "--recompute", "full",
                "--optimizer-offload", "1", "--offload-idle", "--json"]
        assert cli.run(base) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["fits"] and cells[1].startswith(name(d["layout"]) + " (DP"), (label, cells[1], d["layout"])
        assert cells[2].startswith(f"{d['peak_gib']:.1f} "), (label, cells[2], d["peak_gib"])
        assert cli.run(base + ["--cp", "1"]) == 0
        d = json.loads(capsys.readouterr().out)
        if d["fits"]:
            assert cells[6].startswith(name(d["layout"])), (label, cells[6], d["layout"])
            assert cells[7].startswith(f"{d['peak_gib']:.1f} "), (label, cells[7], d["peak_gib"])
        else:
            assert "none fits" in cells[6] and re.search(rf"\b{d['peak_gib']:.1f} GiB", cells[6]), (label, cells[6])

"""Credit by response position (eval/credit.py) on hand-made credit.jsonl rows: the easy / hard split
(V(s0) with a critic, the group's mean reward without), the progress bins and the group means."""
import json

import pytest

from megatron_s3ac.eval.credit import credit_curves, plot_credit, read_credit


def _row(step, v0=None):
    # 2 prompts x K = 2: prompt 7 (V(s0) 0.5: easy) one right one wrong, prompt 9 (V(s0) -0.5: hard) two wrong
    return {"step": step, "k": 2, "pid": [7, 7, 9, 9], "reward": [1.0, -1.0, -1.0, -1.0],
            "v0": v0, "adv": [[1.0, 2.0], [-1.0, -3.0, -5.0, -7.0], [0.0, 0.5], [-0.5, -1.5]]}


def test_split_by_v0_and_bins_by_progress():
    c = credit_curves([_row(0, v0=[0.5, 0.5, -0.5, -0.5])], bins=2)
    assert c["estimate"] == "V(s0)"
    cur = c["curves"]
    assert cur["easy/correct"] == [1.0, 2.0]                 # t / T = 0, 0.5 -> bins 0, 1
    assert cur["easy/incorrect"] == [-2.0, -6.0]             # 4 tokens: (-1 - 3) / 2, (-5 - 7) / 2
    assert cur["hard/incorrect"] == [-0.25, -0.5]            # (0 - 0.5) / 2, (0.5 - 1.5) / 2
    assert cur["hard/correct"] == [None, None]
    assert c["responses"] == {"easy/correct": 1, "easy/incorrect": 1, "hard/correct": 0, "hard/incorrect": 2}
    assert c["mean"]["easy/incorrect"] == pytest.approx(-4.0) and c["mean"]["hard/incorrect"] == pytest.approx(-0.375)


def test_without_a_critic_the_group_mean_reward_splits():
    # group means: prompt 7 -> 0 (easy), prompt 9 -> -1 (hard): the same split as V(s0) above
    c = credit_curves([_row(0)], bins=2)
    assert c["estimate"] == "group mean reward"
    assert c["curves"]["easy/incorrect"] == [-2.0, -6.0] and c["curves"]["hard/incorrect"] == [-0.25, -0.5]


def test_step_window_and_reading(tmp_path):
    p = tmp_path / "credit.jsonl"
    p.write_text(json.dumps(_row(0)) + "\n" + json.dumps(_row(1)) + "\n" + '{"step": 2, "pid"')  # cut last line
    rows = read_credit(str(p))
    assert [r["step"] for r in rows] == [0, 1]
    assert credit_curves(rows, bins=2, steps=(1, 2))["responses"]["hard/incorrect"] == 2
    assert credit_curves(rows, bins=2)["responses"]["hard/incorrect"] == 4
    plot_credit({"S3AC": credit_curves(rows, 2), "GRPO-X": credit_curves(rows, 2)}, str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_group_split_ignores_v0():
    # V(s0) says prompt 9 is the easy one; the group mean reward says prompt 7
    rows = [_row(0, v0=[-0.5, -0.5, 0.5, 0.5])]
    assert credit_curves(rows, bins=2)["curves"]["hard/correct"] == [1.0, 2.0]
    g = credit_curves(rows, bins=2, by="group")
    assert g["estimate"] == "group mean reward" and g["curves"]["easy/correct"] == [1.0, 2.0]


def test_v0_calibration_against_hand_values():
    from megatron_s3ac.eval.credit import v0_calibration

    # two prompts x K = 2: prompt 7 predicted (0.6 + 1) / 2 = 0.8, passes 1 of 2; prompt 9 predicted 0.1, 0 of 2
    rows = [{"step": 0, "pid": [7, 7, 9, 9], "reward": [1, -1, -1, -1], "v0": [0.6, 0.6, -0.8, -0.8]},
            {"step": 1, "pid": [1, 1], "reward": [1, 1], "v0": None}]  # no critic: skipped
    c = v0_calibration(rows)
    assert c["prompts"] == 2 and c["corr"] == pytest.approx(1.0) and c["corr_per_step_mean"] == pytest.approx(1.0)
    assert c["pass_pred_mean"] == pytest.approx((0.8 + 0.1) / 2) and c["pass_emp_mean"] == pytest.approx(0.25)
    assert c["v0_std"] == pytest.approx(0.7)  # V(s0) 0.6 and -0.8 around -0.1
    # anti-correlated: the easier-looking prompt fails
    rows[0]["reward"] = [-1, -1, 1, -1]
    assert v0_calibration(rows)["corr"] == pytest.approx(-1.0)


def test_diagnose_critic_tool_on_a_hand_made_run_dir(tmp_path):
    """tools/diagnose_critic.py: the coverage pass rate pooled by trajectories, value pretraining's first / last
    10-step means and the online EV per window, from hand-written files."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("diagnose_critic", os.path.join(root, "tools", "diagnose_critic.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    run = tmp_path / "run"
    (run / "stages" / "coverage").mkdir(parents=True)
    (run / "stages" / "value_pretrain").mkdir(parents=True)
    (run / "stages" / "coverage" / "coverage_log.jsonl").write_text(
        json.dumps({"source": "a/step_1", "pass_rate": 0.0, "trajectories": 300}) + "\n"
        + json.dumps({"source": "a/step_2", "pass_rate": 0.5, "trajectories": 100}) + "\n")
    (run / "stages" / "value_pretrain" / "value_pretrain.jsonl").write_text("".join(
        json.dumps({"step": i, "vpt/value_loss": float(i), "vpt/explained_variance": 0.01 * i}) + "\n" for i in range(20)))
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "critic/explained_variance": float(i), "rollout/pass_rate": 0.5}) + "\n" for i in range(4)))
    d = mod.diagnose(str(run), window=2)
    assert d["coverage"]["pass_rate"] == pytest.approx(0.125)  # (0 x 300 + 0.5 x 100) / 400
    assert d["value_pretrain"]["value_loss_first10"] == pytest.approx(4.5)
    assert d["value_pretrain"]["value_loss_last10"] == pytest.approx(14.5)
    assert [w["ev"] for w in d["rl"]] == [0.5, 2.5] and [w["steps"] for w in d["rl"]] == ["0-1", "2-3"]
    assert "v0_vs_pass_rate" not in d  # no credit.jsonl
    assert mod.main([str(tmp_path / "missing")]) == 2

"""tools/compare_metrics.py's rules: exact by default, --rel for every number, and --logprob-diffs' fp32 floor
(2^-23 x the row's rollout/entropy) only for the log-prob difference metrics. Hand-built rows."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOOL = os.path.join(ROOT, "tools", "compare_metrics.py")
EPS = 2.0 ** -23


def _run(tmp_path, ra, rb, *flags):
    for name, rows in (("a", ra), ("b", rb)):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return subprocess.run([sys.executable, TOOL, str(tmp_path / "a"), str(tmp_path / "b"), *flags],
                          capture_output=True, text=True)


def test_logprob_floor_applies_to_logprob_differences_only(tmp_path):
    ent = 2.5
    floor = EPS * ent  # 2.98e-7
    base = {"step": 0, "rollout/entropy": ent, "actor/grad_norm": 5.0, "mismatch/logprob_abs_diff": 1.6e-7,
            "r3/native_kl_k3": 2e-14, "actor/approx_kl": 6e-4, "time/step": 1.0}
    # log-prob differences off by 0.9 floor (relative 0.56, 1.0 and 4.5e-4): pass with --logprob-diffs only
    near = dict(base, **{"mismatch/logprob_abs_diff": 1.6e-7 + 0.9 * floor, "r3/native_kl_k3": 0.0,
                         "actor/approx_kl": 6e-4 + 0.9 * floor, "time/step": 9.0})
    r = _run(tmp_path, [near], [base], "--rel", "1e-5")
    assert r.returncode == 1 and "3 differences" in r.stdout, r.stdout
    r = _run(tmp_path, [near], [base], "--rel", "1e-5", "--logprob-diffs")
    assert r.returncode == 0 and "3 log-prob difference values within the fp32 floor" in r.stdout, r.stdout
    # 1.1 floors apart: a real difference even for a log-prob metric
    far = dict(base, **{"mismatch/logprob_abs_diff": 1.6e-7 + 1.1 * floor})
    r = _run(tmp_path, [far], [base], "--rel", "1e-5", "--logprob-diffs")
    assert r.returncode == 1 and "mismatch/logprob_abs_diff" in r.stdout, r.stdout
    # any other metric keeps the relative rule: grad_norm 2e-5 relative off fails, 5e-6 passes
    for off, rc in ((2e-5, 1), (5e-6, 0)):
        r = _run(tmp_path, [dict(base, **{"actor/grad_norm": 5.0 * (1 + off)})], [base], "--rel", "1e-5",
                 "--logprob-diffs")
        assert r.returncode == rc, r.stdout
    # entropy below 1: the floor is 2^-23 itself
    small = dict(base, **{"rollout/entropy": 0.1})
    r = _run(tmp_path, [dict(small, **{"mismatch/logprob_abs_diff": 1.6e-7 + 1.5 * EPS})], [small], "--logprob-diffs")
    assert r.returncode == 1, r.stdout
    r = _run(tmp_path, [dict(small, **{"mismatch/logprob_abs_diff": 1.6e-7 + 0.5 * EPS})], [small], "--logprob-diffs")
    assert r.returncode == 0, r.stdout

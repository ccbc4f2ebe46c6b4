"""rollout.length_tail (rollout/lengths.py): the designed per-response budgets follow the design (fraction at the cap,
the short ones uniform, the mean p * cap + (1 - p) * (lo + hi) / 2, derived by hand), do not depend on the call's
seed or an engine pool's chunking, and the CPU engine really decodes each response to its budget (ignore_eos), also
through a pause and a continuation (continuation_requests gives what is left of the response's own budget)."""
import random

import numpy as np
import pytest

from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
from megatron_s3ac.rollout.lengths import expected_budget, response_budget, row_budgets
from megatron_s3ac.rollout.partial import continuation_requests, merge

from rollout_fixtures import tiny_moe_config

CAP, TAIL = 40, (0.1, 3, 9, 0)
TAIL_E = (0.25, 3, 9, 0)  # the engine tests: a quarter at the cap, so a dozen prompts hold several


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 30) for _ in range(rng.randrange(3, 12))] for _ in range(n)]


def test_budgets_follow_the_design():
    p, k = SamplingParams(max_new_tokens=CAP, length_tail=TAIL), 4
    prompts = _prompts(5000)
    rows = [q for q in prompts for _ in range(k)]
    b = np.array(row_budgets(p, rows, k))
    n = len(b)
    # by hand: P(cap) = 0.1; a short budget is uniform on 3..9 (7 values, each (1 - 0.1) / 7 = 0.1286)
    sd = (0.1 * 0.9 / n) ** 0.5
    assert abs((b == CAP).mean() - 0.1) < 4 * sd
    short = b[b < CAP]
    assert set(short.tolist()) == set(range(3, 10))
    for v in range(3, 10):
        assert abs((b == v).mean() - 0.9 / 7) < 4 * (0.1286 * 0.8714 / n) ** 0.5
    # the mean: 0.1 x 40 + 0.9 x 6 = 9.4 (the per-row sd is sqrt(0.1 x 34^2 x 0.9 + 0.9 x 4) ~ 10.4)
    assert expected_budget(TAIL, CAP) == pytest.approx(9.4)
    assert abs(b.mean() - 9.4) < 4 * 10.4 / n ** 0.5
    # off: every budget is the cap
    assert row_budgets(SamplingParams(max_new_tokens=CAP), rows[:8], k) == [CAP] * 8


def test_budgets_ignore_the_seed_and_the_chunking():
    rows = [q for q in _prompts(40) for _ in range(4)]
    a = row_budgets(SamplingParams(max_new_tokens=CAP, length_tail=TAIL, seed=1), rows, 4)
    assert a == row_budgets(SamplingParams(max_new_tokens=CAP, length_tail=TAIL, seed=99), rows, 4)
    # an engine pool's chunk (whole prompts, rows prompt-major) gets the same budgets as in the whole batch
    assert a[20:44] == row_budgets(SamplingParams(max_new_tokens=CAP, length_tail=TAIL), rows[20:44], 4)
    # another salt is another draw; each response of a group has its own budget
    assert a != row_budgets(SamplingParams(max_new_tokens=CAP, length_tail=(0.1, 3, 9, 1)), rows, 4)
    assert response_budget(TAIL, CAP, rows[0], 0) == a[0] and response_budget(TAIL, CAP, rows[0], 3) == a[3]


def test_bad_tails_are_refused():
    for tail in ((0.0, 3, 9, 0), (0.1, 0, 9, 0), (0.1, 9, 3, 0), (0.1, 3, CAP, 0), (0.1, 3)):
        with pytest.raises(ValueError):
            SamplingParams(max_new_tokens=CAP, length_tail=tail)


def test_cpu_engine_decodes_each_budget():
    eng = CPUEngine.from_config(tiny_moe_config(), seed=0)
    prompts = _prompts(12, seed=3)
    p = SamplingParams(max_new_tokens=CAP, length_tail=TAIL_E, ignore_eos=True, seed=7)
    want = row_budgets(p, [q for q in prompts for _ in range(2)], 2)
    assert CAP in want and min(want) < 10  # this draw has both kinds
    groups = eng.generate(prompts, p, n_samples=2)
    got = [len(s.response_ids) for g in groups for s in g]
    assert got == want
    assert all(s.finish_reason == "length" for g in groups for s in g)


def test_continuation_budget_is_what_is_left_of_the_response_budget():
    eng = CPUEngine.from_config(tiny_moe_config(), seed=0)
    prompts = _prompts(12, seed=3)
    p = SamplingParams(max_new_tokens=CAP, length_tail=TAIL_E, ignore_eos=True, seed=7)
    want = row_budgets(p, [q for q in prompts for _ in range(2)], 2)
    count = [0]

    def hook(*_):  # pause at the 12th forward: the short responses are done, the long ones cut
        count[0] += 1
        if count[0] == 12:
            eng.pause_generation()
    h = eng.model.register_forward_hook(hook)
    try:
        groups = eng.generate(prompts, p, n_samples=2)
    finally:
        h.remove()
    eng.continue_generation()
    cut = [s for g in groups for s in g if s.finish_reason == "abort"]
    assert cut and all(0 < len(s.response_ids) < CAP for s in cut)
    tagged, reqs, n = continuation_requests(groups, 0, 1, CAP, max_versions=2, length_tail=TAIL_E)
    assert n.resumed == len(cut)
    for gi, ki, pre, b in reqs:
        assert b == want[2 * gi + ki] - len(groups[gi][ki].response_ids)
    conts = eng.generate_continuations([(pre, b) for _, _, pre, b in reqs], SamplingParams(
        max_new_tokens=CAP, ignore_eos=True, seed=8))
    for (gi, ki, _, _), c in zip(reqs, conts):
        tagged[gi][ki] = merge(tagged[gi][ki], c, 1)
    assert [len(s.response_ids) for g in tagged for s in g] == want


def test_config_turns_the_tail_on_for_the_trainer_and_refuses_other_engines():
    from megatron_s3ac.config import load_config
    from megatron_s3ac.config.enums import ConfigError
    from megatron_s3ac.trainer.step.rollout_phases import sampling_params

    keys = ["model.tiny=arithmetic_moe", "rollout.max_new_tokens=40", "rollout.length_tail.long_frac=0.1",
            "rollout.length_tail.short_min=3", "rollout.length_tail.short_max=9"]
    p = sampling_params(load_config(None, keys), 2)
    assert p.length_tail == TAIL and p.ignore_eos and p.max_new_tokens == CAP
    off = sampling_params(load_config(None, keys[:2]), 2)
    assert off.length_tail == () and not off.ignore_eos
    with pytest.raises(ConfigError, match="length_tail"):
        load_config(None, keys + ["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match="short_max"):
        load_config(None, keys[:-1] + ["rollout.length_tail.short_max=40"])

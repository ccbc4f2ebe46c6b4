"""dynamic_sampling_refill: over-sampling until the batch holds the target number of informative
groups, bounded; every expected number below is worked out by hand from the draw sequence."""
import pytest
import torch

from megatron_s3ac.algorithms.filters import dynamic_sampling_refill

LIVE, DEAD = [1.0, -1.0], [-1.0, -1.0]  # K = 2: informative vs all wrong


class Source:
    """Hands out groups 0, 1, 2, ... with the given reward rows, and records each request size."""

    def __init__(self, rows):
        self.rows, self.pos, self.requests = rows, 0, []

    def __call__(self, n):
        self.requests.append(n)
        ids = list(range(self.pos, self.pos + n))
        self.pos += n
        return ids, torch.tensor([self.rows[i] for i in ids])


PATTERN = [LIVE, DEAD, LIVE, DEAD, DEAD, LIVE, LIVE, LIVE, LIVE, LIVE, LIVE, LIVE]


def test_adaptive_refill():
    # round 1 draws 4 -> keeps 0, 2 (rate 2/4); missing 2 -> draws ceil(2 * 4 / 2) = 4 -> keeps 5, 6, 7
    src = Source(PATTERN)
    kept, st = dynamic_sampling_refill(src, target_groups=4, max_groups=12)
    assert kept == [0, 2, 5, 6] and src.requests == [4, 4]
    assert st == {"rounds": 2, "drawn_groups": 8, "kept_groups": 4, "discarded_groups": 3, "surplus_groups": 1,
                  "reached_target": True, "keep_rate": 5 / 8}


def test_fixed_round_size():
    # round 1: 4 -> keeps 0, 2; round 2: 3 (groups 4, 5, 6) -> keeps 5, 6: exactly full
    src = Source(PATTERN)
    kept, st = dynamic_sampling_refill(src, target_groups=4, max_groups=12, round_size=3)
    assert kept == [0, 2, 5, 6] and src.requests == [4, 3]
    assert st["rounds"] == 2 and st["drawn_groups"] == 7 and st["surplus_groups"] == 0 and st["discarded_groups"] == 3


def test_bound_stops_short():
    # round 1: 4 -> keeps 0, 2; wants 4 more but only 6 - 4 = 2 remain: groups 4, 5 -> keeps 5; budget spent
    src = Source(PATTERN)
    kept, st = dynamic_sampling_refill(src, target_groups=4, max_groups=6)
    assert kept == [0, 2, 5] and src.requests == [4, 2]
    assert st["reached_target"] is False and st["kept_groups"] == 3 and st["drawn_groups"] == 6


def test_nothing_kept_in_first_round_draws_the_missing_count():
    src = Source([DEAD] * 3 + [LIVE] * 9)
    kept, st = dynamic_sampling_refill(src, target_groups=3, max_groups=9)
    assert src.requests == [3, 3] and kept == [3, 4, 5] and st["keep_rate"] == 0.5


def test_all_informative_is_one_round_and_max_equal_target_is_no_refill():
    src = Source([LIVE] * 4)
    kept, st = dynamic_sampling_refill(src, target_groups=4, max_groups=4)
    assert kept == [0, 1, 2, 3] and st["rounds"] == 1
    src = Source([DEAD] * 4)
    kept, st = dynamic_sampling_refill(src, target_groups=4, max_groups=4)  # refill off: today's behaviour
    assert kept == [] and st["rounds"] == 1 and not st["reached_target"] and st["discarded_groups"] == 4


def test_atol_and_bad_inputs():
    near = Source([[0.5, 0.5 + 1e-9]] * 2 + [[0.0, 1.0]] * 2)
    kept, _ = dynamic_sampling_refill(near, target_groups=2, max_groups=4, atol=1e-6)
    assert kept == [2, 3]
    with pytest.raises(ValueError):
        dynamic_sampling_refill(Source(PATTERN), target_groups=4, max_groups=3)
    with pytest.raises(ValueError):
        dynamic_sampling_refill(Source(PATTERN), target_groups=2, max_groups=4, round_size=0)
    with pytest.raises(ValueError, match="must return"):
        dynamic_sampling_refill(lambda n: ([0] * n, torch.zeros(n + 1, 2)), target_groups=2, max_groups=4)

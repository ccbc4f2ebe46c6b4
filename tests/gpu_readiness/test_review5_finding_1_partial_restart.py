"""Fifth GPU-path review, finding 1: partial rollout under an engine death lost the half-generated responses and
could take rank 0 out of the step alone.

At the sync of step s the engine is paused, every queued batch comes back with its unfinished responses aborted
("pieces"), and after the sync ``PartialRollout.resume`` sends them to the engine as continuations
(``PartialPending``: the pieces + the continuation call). Two faults, both on the separate engines that restart
(``RemoteEngine`` / SGLang's ``EnginePool`` / ``VLLMEngine``, whose deaths are ``engine_death_types``):

1. The engine dies while the continuations run. ``_await`` (next step, or the next sync's interrupt, or
   ``before_save``) restarts it and ``_restart`` resubmitted every batch it had not returned with ``_send``: the
   whole batch from its prompts. The pieces (tokens, the behaviour log-probs of the version that made them) and the
   batch's samples that had finished were thrown away and generated again, while the step's
   ``async/partial_kept_tokens`` / ``partial_resumes`` still counted them as kept. Fixed: such a batch sends the
   same continuations to the rebuilt engine (``PartialRollout.resubmit``); the pieces keep their versions, the new
   tokens get the rebuilt engine's.
2. The engine dies between the sync and the continuations (``continue_generation``, ``continue_async``): ``resume``
   runs on rank 0 only, outside any shared verdict, so the death left ``sync_weights`` on rank 0 alone (the other
   ranks went on into the next step's collectives). Fixed: ``AsyncSource._resume`` guards it as ``generate`` does
   (rank 0's verdict shared, ``recover``, then the rest resumed on the new engine, which is not paused).

Stand-ins for the trainer and the engines (the loop's own code runs), as in test_review4_finding_1.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch


def _sample(prompt, resp, reason, versions=None):
    from megatron_s3ac.rollout.base import Sample

    return Sample(prompt_ids=list(prompt), response_ids=list(resp),
                  logprobs=np.full(len(resp), -0.5, np.float32), finish_reason=reason,
                  token_versions=None if versions is None else np.asarray(versions, np.int64))


def _dead():
    from megatron_s3ac.rollout.engines.remote import RemoteEngineDied

    raise RemoteEngineDied("remote engine died during generate_continuations(): killed")


class _Engine:
    """A pausable separate engine: ``calls`` records what reached it; ``die`` names the call that finds it dead."""

    supports_pause = True

    def __init__(self, name, calls, die=()):
        self.name, self.calls, self.die = name, calls, set(die)

    def _call(self, what):
        self.calls.append(f"{self.name}.{what}")
        if what in self.die:
            _dead()

    def close(self):
        self.calls.append(f"{self.name}.close")

    shutdown = close

    def pause_generation(self):
        self._call("pause_generation")

    def continue_generation(self):
        self._call("continue_generation")

    def generate_async(self, prompts, params, **kw):
        from megatron_s3ac.rollout.base import PendingGeneration

        self._call("generate_async")
        return PendingGeneration(lambda: [[_sample(prompts[0], [9, 9, 9], "stop")]])

    def continue_async(self, requests, params, **kw):
        from megatron_s3ac.rollout.base import PendingGeneration

        self._call("continue_async")
        if "continuations" in self.die:
            return PendingGeneration(_dead)
        return PendingGeneration(lambda: [_sample(pre, [7], "stop") for pre, _ in requests])


def _source(engine, calls, monkeypatch, rebuilt):
    from megatron_s3ac.trainer.step import build
    from megatron_s3ac.config.rollout import RolloutLengthTailCfg
    from megatron_s3ac.trainer.step.async_loop import AsyncSource

    rollout = SimpleNamespace(stream_rewards=False, max_engine_restarts=3, k=1, temperature=1.0, top_p=1.0,
                              max_new_tokens=8, partial_rollout=True, partial_max_versions=4,
                              sync=SimpleNamespace(overlap=False), length_tail=RolloutLengthTailCfg())
    tr = SimpleNamespace(rank=0, world=1, step_idx=0, engine=engine, prompts=[SimpleNamespace(ids=[1, 2])],
                         r3_on=False, image_kwargs=lambda pids: {}, close_weight_sync=lambda: None,
                         sync_weights=lambda: calls.append("sync"),
                         sync_strategy=SimpleNamespace(attach=lambda e: None), info=None, multimodal=False,
                         cfg=SimpleNamespace(rollout=rollout, algo=SimpleNamespace(dynamic_sampling_refill=False),
                                             train=SimpleNamespace(seed=1, steps=5)))
    monkeypatch.setattr(build, "build_engine", lambda cfg, info, **kw: (rebuilt, False))
    return tr, AsyncSource(tr, 1)


def _queued_interrupted(ar):
    """Step 1's batch (version 0) as the pause returned it: one piece of 2 tokens, aborted."""
    from megatron_s3ac.rollout.base import PendingGeneration
    from megatron_s3ac.trainer.step.async_loop import Submitted

    piece = _sample([1, 2], [5, 6], "abort")
    e = Submitted(1, torch.tensor([0]), {}, 0, pending=PendingGeneration(lambda: [[piece]]), collected=True)
    ar.queue.append(e)
    return e


def test_a_death_mid_continuation_resends_the_continuations_keeping_the_pieces(monkeypatch):
    calls = []
    rebuilt = _Engine("B", calls)
    tr, ar = _source(_Engine("A", calls, die={"continuations"}), calls, monkeypatch, rebuilt)
    e = _queued_interrupted(ar)
    ar._trained = True
    (ar._resume if hasattr(ar, "_resume") else ar.partial.resume)(1)  # after step 0's sync: the piece continues on version 1 (engine A, which dies there)
    kept = ar.partial.step_counts["async/partial_kept_tokens"]
    assert kept == 2 and calls == ["A.continue_async"], calls
    # step 1: Trainer.step advanced; next_batch takes the batch and waits for it (AsyncSource.next_batch)
    ar.end_step({}, 0.0, SimpleNamespace(kept=[]))
    tr.step_idx = 1
    ar.queue.popleft()
    ar._await([e])
    assert ar.restarts == 1
    assert "B.generate_async" not in calls, (
        f"{calls}: the rebuilt engine generated the interrupted batch again from its prompt; its 2 kept tokens "
        f"(counted in async/partial_kept_tokens) were thrown away")
    assert calls == ["A.continue_async", "A.close", "sync", "B.continue_async"], calls
    (smp,), = ar._result(e)
    assert smp.response_ids == [5, 6, 7] and smp.finish_reason == "stop"
    # the piece keeps the version that generated it (0), the new token the rebuilt engine's (1, synced at step 1)
    assert smp.token_versions.tolist() == [0, 0, 1], smp.token_versions
    assert e.version == 0  # the batch's oldest token: what train.max_staleness bounds


def test_a_death_when_told_to_continue_is_recovered_not_raised_on_rank_0_alone(monkeypatch):
    calls = []
    rebuilt = _Engine("B", calls)
    tr, ar = _source(_Engine("A", calls, die={"continue_generation"}), calls, monkeypatch, rebuilt)
    e = _queued_interrupted(ar)
    ar.partial._paused = True  # interrupt paused engine A before the sync
    ar._trained = True
    from megatron_s3ac.trainer.step.async_loop import engine_death_types

    try:
        (ar._resume if hasattr(ar, "_resume") else ar.partial.resume)(1)
    except engine_death_types() as err:
        pytest.fail(f"the engine's death at continue_generation left resume on rank 0 alone: {err!r}")
    # rebuilt and re-synced with the weights after step 0 (version 1); the rebuilt engine is not paused, so it is
    # not told to continue (SGLang refuses continue_generation while a generate runs)
    assert calls == ["A.continue_generation", "A.close", "sync", "B.continue_async"], calls
    assert ar.restarts == 1 and not ar.partial._paused
    (smp,), = ar._result(e)
    assert smp.response_ids == [5, 6, 7] and smp.token_versions.tolist() == [0, 0, 1]

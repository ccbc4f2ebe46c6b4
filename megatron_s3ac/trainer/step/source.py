"""Where a step's batch comes from: the one thing that differs between the synchronous and the asynchronous loop.

``Trainer.step`` is the only step frame (trainer.step.trainer)::

    result = source.next_batch(m)      # select, generate, score, filter, distribute (RolloutResult)
    trainer.train_on(result.batch, m)  # critic values, old log-probs, advantages, actor + critic updates
    source.sync_weights(m)             # actor -> engine
    source.end_step(m, t0, result)     # the source's own metrics (time/step, async/*)

A source also guards every generation the rollout phases start (``generate``): the synchronous source calls the
engine (rank 0), the asynchronous one (trainer.step.async_loop.AsyncSource: submission, staleness, engine restart,
partial rollout) restarts an engine that died and generates again. ``state_dict`` is what a checkpoint keeps of it
(None: nothing); ``before_save`` runs on every rank before the checkpoint is written (the asynchronous source collects
its queue there, outside the save's collectives).
"""
from __future__ import annotations

import time
from typing import Protocol

from megatron_s3ac.trainer.step.rollout_phases import RolloutResult


class RolloutSource(Protocol):
    def next_batch(self, m: dict) -> RolloutResult: ...

    def generate(self, fn): ...

    def sync_weights(self, m: dict) -> None: ...

    def end_step(self, m: dict, t0: float, result: RolloutResult) -> None: ...

    def before_save(self) -> None: ...

    def state_dict(self) -> dict | None: ...

    def load_state_dict(self, state: dict) -> None: ...


class SyncSource:
    """Generate, score and train in turn (``train.max_staleness: 0``): the step's batch is rolled out now, with the
    weights the last step synced."""

    def __init__(self, tr):
        self.tr = tr

    def next_batch(self, m: dict) -> RolloutResult:
        tr = self.tr
        a = tr.cfg.algo
        if a.dynamic_sampling_refill:
            return tr.rollout_eager(m) if getattr(a, "refill_eager", False) else tr.rollout_refilled(m)
        return tr.rollout_once(m)

    def generate(self, fn):
        """Rank 0's generation (``fn()``: the engine's groups); None on the other ranks."""
        return fn() if self.tr.rank == 0 else None

    def sync_weights(self, m: dict) -> None:
        tr = self.tr
        t = time.time()
        tr.sync_weights()
        for k, v in tr.placement.take_sync_metrics().items():  # the sync's own offload (colocated offload)
            m[k] = m.get(k, 0.0) + v if k in ("time/offload", "mem/offload_gb") else v
        m["time/sync"] = time.time() - t
        m["time/weight_sync_exposed_s"] = m["time/sync"]  # nothing overlaps it here: all of it is waited for

    def end_step(self, m: dict, t0: float, result: RolloutResult) -> None:
        m["time/step"] = time.time() - t0

    def before_save(self) -> None:
        """Nothing in flight between steps."""

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict) -> None:
        """Nothing: a synchronous run starts its steps with nothing in flight (a saved queue is not trained)."""


def make_source(tr) -> RolloutSource:
    """``train.max_staleness > 0``: the asynchronous source (trainer.step.async_loop); else the synchronous one."""
    n = int(getattr(tr.cfg.train, "max_staleness", 0) or 0)
    if n > 0:
        from megatron_s3ac.trainer.step.async_loop import AsyncSource

        return AsyncSource(tr, n)
    return SyncSource(tr)


__all__ = ["RolloutSource", "SyncSource", "make_source"]

"""Time per RL step with separate engines: synchronous vs one-step asynchronous (``train.max_staleness: 1``).

A proxy in the spirit of ``memory.throughput_proxy`` (docs/planner.md "Sync vs async time per step"), for ranking
and sizing, not a prediction:

* training: the step's tokens (sequences x (prompt + response)) / (throughput proxy x training GPUs);
* generation: every response at ``response_len`` (the batch waits on its longest response; long-tailed lengths make
  that the common case at a cap), one decode step per token, memory-bound: each step reads the engine GPU's weights
  (``Engine.weights``: at a batch of a few dozen sequences a MoE's every expert is hit) and the KV of its active
  sequences at the mean context (prompt + response / 2) at ``HBM_TBPS`` x ``HBM_EFFICIENCY``; in waves when the
  engine cannot hold all its sequences (``capacity`` at max length < ``needed``);
* weight sync: ``plan.weight_sync`` on the transfer as built (stage leaders gather, then broadcast, stage after
  stage; docs/planner.md "Weight-sync time");
* sync step = generation + training + sync; one-step async = max(generation, training) + sync (today's loop: the
  engine stops for the sync, so all of it is exposed); overlapped = max(generation, training + sync) (the next
  version's buckets move while the engine still decodes on the old one, swapped in at the step boundary): the
  trainer's GPUs send, so the sync stays on the trainer's path, hidden behind generation when that is longer.
"""
from __future__ import annotations

import math

from megatron_s3ac.plan import constants as C


def step_times(e, info) -> dict | None:
    """{"generation_s", "training_s", "weight_sync_s", "sync_step_s", "async_step_s", "async_speedup",
    "async_overlapped_step_s", "weight_sync_exposed_overlapped_s", "decode_waves"} (seconds) for an
    ``memory.Estimate`` with separate engines of the model ``info``; None otherwise (colocated engines sleep while
    the models train)."""
    from megatron_s3ac.plan.weight_sync import for_estimate

    g, w = e.engine, e.workload
    if g is None or e.knobs.placement != "separate" or not g.engines or e.throughput <= 0:
        return None
    train = w.sequences * w.seq_len / (e.throughput * e.train_gpus)
    per_engine = math.ceil(w.sequences / g.engines)
    waves = math.ceil(per_engine / g.capacity) if g.capacity else 1
    active = math.ceil(per_engine / waves)
    step = (g.weights + active * (w.prompt_len + w.response_len / 2) * g.kv_per_token) / (
        C.HBM_TBPS * 1e12 * C.HBM_EFFICIENCY)
    gen = waves * w.response_len * step
    sync = for_estimate(info, e).total_s
    t_sync, t_async = gen + train + sync, max(gen, train) + sync
    t_overlap = max(gen, train + sync)
    return {"generation_s": round(gen, 1), "training_s": round(train, 1), "weight_sync_s": round(sync, 2),
            "sync_step_s": round(t_sync, 1), "async_step_s": round(t_async, 1),
            "async_speedup": round(t_sync / t_async, 3), "async_overlapped_step_s": round(t_overlap, 1),
            "weight_sync_exposed_overlapped_s": round(t_overlap - max(gen, train), 2), "decode_waves": waves}


__all__ = ["step_times"]

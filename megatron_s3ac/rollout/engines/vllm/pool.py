"""``VLLMEnginePool``: ``rollout.vllm.num_engines`` > 1 data-parallel vLLM engines, one server process each.

The prompts are split as ``EnginePool`` splits them (``engine_pool.split_generation``: contiguous balanced chunks,
chunk e seeded ``seed + first prompt x n_samples`` so request k of the batch carries ``seed + k`` on whichever
engine runs it; with no seed each engine draws from its own base, ``seed + index``), the chunks run concurrently,
the samples come back in prompt order. Every weight update reaches every engine, all or nothing across them: every
engine checks the whole update before any session opens, and a failure aborts every open session.

Why not ``EnginePool``'s Ray actors: a ``VLLMEngine`` is already a client of its own server process; what it holds
in this process is the sender's end of the weight transfer (rank 0 of the gloo / NCCL group, the IPC bucket the
workers map), which must live where the trainer's buckets are. In a Ray actor every bucket would first cross the
object store (a copy), and IPC / NCCL from the trainer's own memory would be impossible. So the pool keeps the
clients here and shares ``EnginePool``'s split and seeding code.

Separate placement (``VLLMStageSync``): one sender group per pipeline stage spans every engine's workers (engine e's
TP ranks at ``1 + e x tp_size``), so each stage leader's broadcast feeds all engines at once (vLLM's nccl backend
ranks data-parallel workers the same way, ``weight_transfer/nccl_common.py:184-203``).
"""
from __future__ import annotations

import threading
from typing import Optional, Sequence

from megatron_s3ac.rollout.base import RolloutEngine, Sample, SamplingParams
from megatron_s3ac.rollout.engines.vllm.session import SessionUpdates


def _each(fns: Sequence, what: str) -> list:
    """Run the callables concurrently (one thread each); results in order; the first error re-raised."""
    out: list = [None] * len(fns)
    errors: list = [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[i] = e
    threads = [threading.Thread(target=run, args=(i,), daemon=True, name=f"{what}-{i}") for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return out


class VLLMEnginePool(SessionUpdates, RolloutEngine):
    """N ``VLLMEngine`` clients in this process (see the module docstring). ``make(index) -> VLLMEngine``."""

    def __init__(self, make, num_engines: int):
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.engines: list = []
        built = [None] * num_engines

        def start(i):
            built[i] = make(i)
            return built[i]
        try:
            _each([lambda i=i: start(i) for i in range(num_engines)], "vllm-start")
        except BaseException:
            for e in built:
                if e is not None:
                    e.shutdown()
            raise
        self.engines = built
        first = built[0]
        self.device, self.moe, self.settings = first.device, first.moe, first.settings
        self.name = f"vllm pool of {num_engines} engines"
        self._session_open = False

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    # -- generation ---------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                 return_routed_experts: bool = False) -> list[list[Sample]]:
        from megatron_s3ac.rollout.engines.pool import split_generation

        prompts = [[int(t) for t in p] for p in prompt_ids]
        chunks = split_generation(len(prompts), params, n_samples, self.num_engines)
        results = _each([lambda e=e, lo=lo, hi=hi, p=p: self.engines[e].generate(prompts[lo:hi], p, n_samples,
                                                                                  return_routed_experts)
                         for e, lo, hi, p in chunks], "vllm-generate")
        out: list = []
        for (e, lo, hi, _), groups in zip(chunks, results):
            if len(groups) != hi - lo:
                raise RuntimeError(f"{self.engines[e].name} returned {len(groups)} groups for {hi - lo} prompts")
            out.extend(groups)
        return out

    def score(self, sequences):
        """Engine 0's teacher-forced log-probs (every engine holds the same weights: ``score_all``)."""
        return self.engines[0].score(sequences)

    def score_all(self, sequences) -> list:
        """Every engine's ``score`` (after a sync they agree)."""
        return _each([lambda e=e: e.score(sequences) for e in self.engines], "vllm-score")

    # -- weights --------------------------------------------------------------------------------------------------
    def weight_info(self):
        return self.engines[0].weight_info()

    def check_weights(self, names, shapes, call: str = "update_weights", session: bool = False) -> None:
        for e in self.engines:  # every engine before any session opens (the served checkpoints are the same)
            e.check_weights(names, shapes, call, session=session)

    def begin_weight_update(self) -> None:
        try:
            _each([e.begin_weight_update for e in self.engines], "vllm-begin")
        except BaseException:
            self._abort_quietly()
            raise
        self._session_open = True

    def _send_pairs(self, pairs: list, bucket_bytes: Optional[int] = None) -> None:
        """Checked pairs into every engine's open session (each its own group / IPC handle), one after another."""
        for e in self.engines:
            e._send_pairs(pairs, bucket_bytes)

    def open_sender_group(self, group: str, host: str, port: int, timeout_s: Optional[float] = None) -> None:
        """One sender group over every engine's workers (engine e's TP ranks at 1 + e x tp_size)."""
        tp = self.settings.tp_size
        world = 1 + tp * self.num_engines
        _each([lambda i=i, e=e: e.open_sender_group(group, host, port, timeout_s, world_size=world,
                                                    rank_offset=1 + i * tp)
               for i, e in enumerate(self.engines)], "vllm-group")

    @property
    def sender_world_size(self) -> int:
        return 1 + self.settings.tp_size * self.num_engines

    def receive_bucket(self, meta: dict, group: str) -> None:
        _each([lambda e=e: e.receive_bucket(meta, group) for e in self.engines], "vllm-receive")

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self._session_open = False
        _each([lambda e=e: e.finish_weight_update(weight_version=weight_version) for e in self.engines],
              "vllm-finish")

    def abort_weight_update(self) -> None:
        self._session_open = False
        _each([e.abort_weight_update for e in self.engines], "vllm-abort")

    def _abort_quietly(self) -> None:
        for e in self.engines:
            e._abort_quietly()
        self._session_open = False

    def flush_cache(self) -> None:
        _each([e.flush_cache for e in self.engines], "vllm-flush")

    # -- memory, lifetime -----------------------------------------------------------------------------------------
    def sleep(self) -> None:
        _each([e.sleep for e in self.engines], "vllm-sleep")

    def wake(self, tags=None) -> None:
        _each([lambda e=e: e.wake(tags) for e in self.engines], "vllm-wake")

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()
        self.engines = []

    close = shutdown

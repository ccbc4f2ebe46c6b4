"""``VLLMEnginePool``: ``rollout.vllm.num_engines`` > 1 data-parallel vLLM engines, one server process each.

The prompts are split as ``EnginePool`` splits them (``engine_pool.split_generation``: contiguous balanced chunks,
chunk e seeded ``seed + first prompt x n_samples`` so request k of the batch carries ``seed + k`` on whichever
engine runs it; with no seed each engine draws from its own base, ``seed + index``), the chunks run concurrently,
the samples come back in prompt order. ``generate_async`` / ``generate_stream_async`` / ``continue_async`` submit
every chunk to its engine's own non-blocking call at once (each ``VLLMEngine`` posts its call on a thread; its
server's ``AsyncLLM`` batches it with whatever else runs) and return one pending generation over them: the results
in prompt (request) order, the stream's groups as any engine finishes one (global prompt index), the timing the
earliest start and latest end of the engines' spans, an engine's error raised as soon as it arrives with its own
type (``VLLMEngineDied`` stays an ``EngineDied``: the asynchronous loop then closes the whole pool and builds a new
one, ``trainer/step/async_loop.py`` ``_restart``). Continuations are split like prompts with one sample each
(request k seeded ``seed + k`` on whichever engine runs it). Partial rollout (``rollout.partial_rollout``):
``pause_generation`` / ``continue_generation`` reach every engine concurrently; each engine's server pauses vLLM in
mode abort (``v1/engine/async_llm.py:952-988``), so every chunk in flight comes back with its tokens so far.

Every weight update reaches every engine, all or nothing across them: every
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

import queue
import threading
import time
from typing import Optional, Sequence

from megatron_s3ac.rollout.base import (PendingGeneration, RolloutEngine, Sample, SamplingParams, StreamingGeneration,
                                        check_images)
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


def _part(images, lo: int, hi: int):
    """The images of requests [lo, hi) (None where that chunk has no image)."""
    part = None if images is None else list(images[lo:hi])
    return part if part is not None and any(im is not None for im in part) else None


def _span(spans: list, t0: float) -> tuple[float, float]:
    """(the earliest start, the latest end) of the engines' (start, end) spans; (t0, now) when none is known."""
    if not spans:
        return t0, time.time()
    return min(float(a) for a, _ in spans), max(float(b) for _, b in spans)


class _Merged:
    """The pool stream's items: (global prompt index, group) as the engines' forwarding threads put them, then
    (None, the pool's span) once every engine's stream ended; an engine's error raised on arrival, and again on any
    later ``next`` (a second ``result()`` raises it too, not "the stream ended without ...")."""

    def __init__(self, got: queue.Queue, engines: int, t0: float):
        self.got, self.left, self.t0 = got, int(engines), t0
        self.spans: list = []
        self.error: Optional[BaseException] = None
        self.closed = False

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            if self.error is not None:
                raise self.error
            if self.closed:
                raise StopIteration
            if not self.left:
                self.closed = True
                return None, _span(self.spans, self.t0)
            kind, a, b = self.got.get()
            if kind == "error":
                self.error = a
            elif kind == "done":
                self.left -= 1
                if a is not None:
                    self.spans.append(a)
            else:
                return a, b


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
    def _chunks(self, n: int, params: SamplingParams, n_samples: int) -> list:
        """``engine_pool.split_generation``: (engine, lo, hi, params) per non-empty chunk, chunk e seeded
        ``seed + lo x n_samples`` (request k of the whole batch carries ``seed + k`` on whichever engine runs it)."""
        from megatron_s3ac.rollout.engines.pool import split_generation

        return split_generation(n, params, n_samples, self.num_engines)

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                 return_routed_experts: bool = False, images=None) -> list[list[Sample]]:
        """``generate_async(...).result()``: the chunks run on every engine at once; the first engine error to arrive
        is raised then (the other engines' chunks still run in their servers), as ``VLLMEngine.generate``."""
        return self.generate_async(prompt_ids, params, n_samples, return_routed_experts, images).result()

    def _joined(self, chunks: list, results: list, what: str) -> list:
        """The chunks' results, concatenated in prompt (request) order; each chunk's length checked."""
        out: list = []
        for (e, lo, hi, _), got in zip(chunks, results):
            if len(got) != hi - lo:
                raise RuntimeError(f"{self.engines[e].name} returned {len(got)} {what} for {hi - lo} requests")
            out.extend(got)
        return out

    def generate_async(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                       return_routed_experts: bool = False, images=None) -> PendingGeneration:
        """``generate`` returning at once: every chunk submitted to its engine's ``generate_async`` (each posts its
        call on a thread and its server batches it with whatever else runs), then combined (``_combined``)."""
        prompts = [[int(t) for t in p] for p in prompt_ids]
        images = check_images(prompts, images)
        chunks = self._chunks(len(prompts), params, n_samples)
        subs = [self.engines[e].generate_async(prompts[lo:hi], p, n_samples, return_routed_experts,
                                               _part(images, lo, hi)) for e, lo, hi, p in chunks]
        return self._combined(chunks, subs, "groups")

    def generate_stream_async(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                              return_routed_experts: bool = False, images=None) -> StreamingGeneration:
        """``generate_async`` handing each group back as any engine finishes it (each engine streams its chunk's
        groups, ``/generate_stream``): (global prompt index, group) in arrival order, then the pool's span (the
        earliest start, the latest end of the engines'); the same samples. An engine's error is raised from
        ``groups()`` / ``result()`` with its own type as soon as it arrives."""
        prompts = [[int(t) for t in p] for p in prompt_ids]
        images = check_images(prompts, images)
        chunks = self._chunks(len(prompts), params, n_samples)
        t0 = time.time()
        subs = [self.engines[e].generate_stream_async(prompts[lo:hi], p, n_samples, return_routed_experts,
                                                      _part(images, lo, hi)) for e, lo, hi, p in chunks]
        got: queue.Queue = queue.Queue()

        def forward(e, lo, hi, sub):
            try:
                for i, group in sub.groups():
                    if not 0 <= int(i) < hi - lo:
                        raise RuntimeError(f"{self.engines[e].name} streamed group {i} of a chunk of {hi - lo}")
                    got.put(("group", lo + int(i), group))
                got.put(("done", sub.timing, None))
            except BaseException as err:  # noqa: BLE001 - raised by the pool's stream, with its own type
                got.put(("error", err, None))
        threads = [threading.Thread(target=forward, args=(e, lo, hi, sub), daemon=True, name=f"vllm-stream-{e}")
                   for (e, lo, hi, _), sub in zip(chunks, subs)]
        for t in threads:
            t.start()
        return StreamingGeneration(len(prompts), _Merged(got, len(threads), t0),
                                   ready=lambda: not any(t.is_alive() for t in threads))

    def _combined(self, chunks: list, subs: list, what: str) -> PendingGeneration:
        """One PendingGeneration over the chunks' (``subs``, one per chunk): ``result()`` = their results in order,
        timing = (the earliest start, the latest end) of theirs; the first engine error to arrive is raised at once,
        with its own type (``VLLMEngineDied`` stays an ``EngineDied``: the asynchronous loop restarts the pool)."""
        done: queue.Queue = queue.Queue()

        def watch(i):
            try:
                done.put((i, subs[i].result(), None))
            except BaseException as err:  # noqa: BLE001 - raised by result()
                done.put((i, None, err))
        threads = [threading.Thread(target=watch, args=(i,), daemon=True, name=f"vllm-wait-{chunks[i][0]}")
                   for i in range(len(subs))]
        for t in threads:
            t.start()
        t0 = time.time()
        failed: list = []

        def wait():
            if failed:  # result() again after an engine's error: the same error
                raise failed[0]
            results: list = [None] * len(subs)
            for _ in subs:
                i, out, err = done.get()
                if err is not None:
                    failed.append(err)
                    raise err
                results[i] = out
            start, end = _span([s.timing for s in subs if s.timing is not None], t0)
            return self._joined(chunks, results, what), start, end
        return PendingGeneration(wait, ready=lambda: not any(t.is_alive() for t in threads))

    # -- partial rollout (rollout/partial.py): every engine paused / continued; continuations split ----------------
    supports_pause = True

    def pause_generation(self) -> None:
        """Every engine's ``pause_generation``, concurrently (``VLLMEngine.pause_generation``: vLLM's
        ``pause_generation(mode="abort")``, ``v1/engine/async_llm.py:952-984``): each engine's running chunks come
        back aborted with their tokens and log-probs so far; returns when every engine has paused. When one
        engine's pause fails, those that paused are continued again before the error is raised, so the pool is
        never left half paused (the caller, ``PartialRollout.interrupt``, then waits for the batches instead and
        does not call ``continue_generation``)."""
        paused = [False] * self.num_engines

        def pause(i):
            self.engines[i].pause_generation()
            paused[i] = True
        try:
            _each([lambda i=i: pause(i) for i in range(self.num_engines)], "vllm-pause")
        except BaseException:
            for i, e in enumerate(self.engines):
                if paused[i]:
                    try:
                        e.continue_generation()
                    except Exception:  # noqa: BLE001 - the pause's own error is the one to report
                        pass
            raise

    def continue_generation(self) -> None:
        """Every engine's ``continue_generation`` (``resume_generation``, ``async_llm.py:986-988``), concurrently."""
        _each([e.continue_generation for e in self.engines], "vllm-continue")

    def continue_async(self, requests: Sequence[tuple[Sequence[int], int]], params: SamplingParams,
                       return_routed_experts: bool = False, images=None) -> PendingGeneration:
        """The continuations in balanced contiguous chunks, one per engine, each submitted to its engine's
        ``continue_async`` at once; chunk [lo, hi) seeded ``params.seed + lo``, so request k is seeded
        ``params.seed + k`` whichever engine runs it (``VLLMEngine._prepare`` seeds its request j ``seed + j``);
        the samples in request order, timing the engines' span. ``images`` go with their requests' chunk."""
        reqs = [([int(t) for t in p], int(b)) for p, b in requests]
        images = check_images([p for p, _ in reqs], images)
        chunks = self._chunks(len(reqs), params, 1)
        subs = [self.engines[e].continue_async(reqs[lo:hi], p, return_routed_experts, _part(images, lo, hi))
                for e, lo, hi, p in chunks]
        return self._combined(chunks, subs, "continuations")

    def generate_continuations(self, requests: Sequence[tuple[Sequence[int], int]], params: SamplingParams,
                               return_routed_experts: bool = False, images=None) -> list[Sample]:
        """``continue_async(...).result()``."""
        return self.continue_async(requests, params, return_routed_experts, images).result()

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

    # -- staged weights (rollout.sync.overlap): each engine stages and swaps its own copy -------------------------
    stageable = True

    @property
    def staging(self) -> bool:
        return all(e.staging for e in self.engines)

    @staging.setter
    def staging(self, on: bool) -> None:
        for e in self.engines:
            e.staging = bool(on)

    def commit_staged(self) -> None:
        for e in self.engines:  # each returns at once: its server swaps behind its own calls
            e.commit_staged()

    def wait_committed(self) -> None:
        _each([e.wait_committed for e in self.engines], "vllm-commit")

    # -- memory, lifetime -----------------------------------------------------------------------------------------
    def sleep(self) -> None:
        _each([e.sleep for e in self.engines], "vllm-sleep")

    def wake(self, tags=None) -> None:
        _each([lambda e=e: e.wake(tags) for e in self.engines], "vllm-wake")

    def shutdown(self) -> None:
        """Every engine's server ended (each tried even when another's shutdown raised; the first error re-raised).
        The asynchronous loop's restart closes the whole pool and builds a new one (``build_engine``)."""
        first = None
        for e in self.engines:
            try:
                e.shutdown()
            except BaseException as err:  # noqa: BLE001 - re-raised after the others
                first = first or err
        self.engines = []
        if first is not None:
            raise first

    close = shutdown

"""Separate placement: any rollout engine hosted in its own process as a Ray actor.

``RemoteEngine(factory)`` starts a Ray actor that calls ``factory()`` (a picklable zero-argument
callable returning a RolloutEngine, e.g. ``functools.partial(CPUEngine.from_config, hf_config)``)
and forwards the RolloutEngine interface to it, so the trainer can use it wherever it uses a local
engine (``weight_sync.sync_weights`` included):

* ``generate`` returns exactly what the hosted engine returns (same seed -> same samples).
* ``update_weights(named_tensors)`` first has the engine check the whole update (``check_weights``: names,
  shapes, dtypes; a refusal raises before any byte moves), then streams the (name, tensor) pairs in buckets of at most
  ``bucket_bytes`` (``base.iter_buckets``, the same rule as SGLangEngine's). Each bucket is sent as
  raw bytes (a uint8 view of each tensor, any dtype incl. bfloat16): one copy into Ray's shared-memory
  object store, read zero-copy by the actor, which hands the bucket to the engine's own
  ``update_weights``. At most ``max_inflight`` buckets are in flight, so the caller never builds a
  full copy of the model (GPU tensors are moved to host one bucket at a time). Returns when every
  bucket is loaded; the engine's errors (unknown name, bad shape) are raised here with their own type.
* ``stageable=True`` (``rollout.sync.overlap``): the actor gets a "staging" thread and a second copy of the weights.
  While ``staging`` is set, ``update_weights`` sends its buckets to that thread, which copies them into the staging
  buffers while the default thread goes on generating with the live weights; ``commit_staged()`` then queues the swap
  (the staged tensors loaded into the live model) in the default thread, behind the generate calls already sent and
  ahead of the next ones. A generate and the swap hold the same lock and never run at once, so no generate sees a
  half-loaded model; each generate also checks it runs on the weights the client expects (the swaps sent so far).
* ``sleep``/``wake``/``flush_cache`` are forwarded with their arguments; ``call``/``get`` reach any
  other method or attribute of the hosted engine (e.g. ``call("model.save_pretrained", path)``).
* Failures are never a hang: every wait has a timeout. ``RemoteEngineDied`` says why the actor went
  away (the factory raised, the process was killed or crashed, it was closed); ``RemoteEngineTimeout``
  kills the actor (its state is unknown after a timeout) and says which call timed out.
* ``close()`` (or the context manager) asks the engine to shut down, then kills the actor.

Ray (``ray_init.init_ray``): unless already initialised, connects to the cluster at RAY_ADDRESS when set (the
launch scripts start one), else starts a local instance (``num_cpus``, no dashboard); RemoteEngine never shuts Ray down (other actors may share it). The actor inherits
Ray's thread setting (OMP_NUM_THREADS = its num_cpus); pass ``torch_threads`` to override.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
import time
import warnings
from typing import Any, Callable, Iterable, Optional, Sequence

from megatron_s3ac.rollout.base import (PendingGeneration, RolloutEngine, Sample, SamplingParams, StreamingGeneration,
                                        check_images, iter_buckets)
from megatron_s3ac.rollout.engines.ray_init import init_ray

DEFAULT_BUCKET_BYTES = 256 << 20


class RemoteEngineError(RuntimeError):
    """The remote engine's actor cannot serve calls (base class)."""


class RemoteEngineDied(RemoteEngineError):
    """The actor is gone: its factory raised, its process was killed or crashed, or it was killed."""


class RemoteEngineTimeout(RemoteEngineError, TimeoutError):
    """A call did not finish within its timeout; the actor has been killed."""


class RemoteEngineClosed(RemoteEngineError):
    """close() was called."""


@dataclasses.dataclass
class UpdateStats:
    """One update_weights call: what was streamed, and the bucket sizes as the actor received them."""

    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    bucket_sizes: list = dataclasses.field(default_factory=list)  # bytes of each bucket, in order
    seconds: float = 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9)


# ----------------------------------------------------------------------------------------------
# Wire format of a bucket: [(name, dtype name, shape, uint8 numpy view of the contiguous data)]
# ----------------------------------------------------------------------------------------------
def pack_bucket(bucket: Sequence[tuple[str, Any]]) -> list[tuple[str, str, tuple[int, ...], Any]]:
    """(name, tensor) pairs -> raw-byte records. No copy for contiguous CPU tensors (the copy into the
    object store happens when Ray serialises the call); GPU tensors are copied to host, one bucket at a time.

    The uint8 view goes to numpy through DLPack, not ``Tensor.numpy()``: that one clears the resizable flag of the
    tensor's whole storage for good (torch/csrc/utils/tensor_numpy.cpp, tensor_to_numpy), and on CPU these are views
    of the trainer's DDP parameter buffer, which idle-model offload frees by ``resize_(0)`` (models.offload). The
    records must not outlive the call that sends them (``update_weights`` drops them once submitted)."""
    import numpy as np
    import torch

    out = []
    for name, tensor in bucket:
        t = tensor if torch.is_tensor(tensor) else torch.as_tensor(tensor)
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous()
        raw = np.from_dlpack(t.reshape(-1).view(torch.uint8))
        out.append((str(name), str(t.dtype).removeprefix("torch."), tuple(t.shape), raw))
    return out


def unpack_bucket(records) -> tuple[list[tuple[str, Any]], int]:
    """Raw-byte records -> ((name, tensor) pairs viewing the received buffers, total bytes)."""
    import torch

    out, total = [], 0
    for name, dtype, shape, raw in records:
        if raw.size == 0:  # numpy may give an empty buffer any stride; nothing to view
            out.append((name, torch.empty(shape, dtype=getattr(torch, dtype))))
            continue
        with warnings.catch_warnings():  # the object store's buffers are read-only; we only read them
            warnings.simplefilter("ignore")
            flat = torch.from_numpy(raw)
        out.append((name, flat.view(getattr(torch, dtype)).view(shape)))
        total += int(raw.nbytes)
    return out, total


# ----------------------------------------------------------------------------------------------
# Actor body
# ----------------------------------------------------------------------------------------------
class EngineHost:
    """Ray actor body: builds the engine with ``factory()`` and serves the RolloutEngine calls."""

    def __init__(self, factory: Callable[[], RolloutEngine], torch_threads: Optional[int] = None):
        if torch_threads:
            import torch

            torch.set_num_threads(int(torch_threads))
        engine = factory()
        missing = [m for m in ("generate", "update_weights", "sleep", "wake", "flush_cache")
                   if not callable(getattr(engine, m, None))]
        if missing:
            raise TypeError(f"the engine factory returned {type(engine).__name__}, not a rollout engine "
                            f"(missing {missing})")
        self.engine = engine
        # staged weights (stageable actors): hf name -> staging buffer, the second copy, reused by every sync
        self._stage: dict = {}
        self._staged: dict = {}  # the names staged for the next swap (an ordered set)
        self._commits = 0  # swaps applied: the live weights' index as the client counts them
        self._commit_error: Optional[BaseException] = None
        # held by each generate and by the swap: the default thread runs them one at a time anyway; the lock makes
        # "no generate on a half-swapped model" hold whatever the actor's threading
        self._live = threading.Lock()
        # (kind, start, end, commits at start, commits at end): "generate" / "stage" / "commit" spans (tests, bench)
        self.stage_log: collections.deque = collections.deque(maxlen=10_000)

    @contextlib.contextmanager
    def _generating(self, expect_commit):
        """Around one generate: the live weights are whole and the ones the client expects (``expect_commit``: the
        swaps it sent before this call; None: unchecked)."""
        with self._live:
            if self._commit_error is not None:
                raise RuntimeError(f"the staged weights could not be swapped in ({type(self._commit_error).__name__}: "
                                   f"{self._commit_error}); refusing to generate on the previous version")
            if expect_commit is not None and int(expect_commit) != self._commits:
                raise RuntimeError(f"generate expected the weights of swap {expect_commit} but the engine holds swap "
                                   f"{self._commits}: a generate overtook a weight swap (or the reverse)")
            t0, c0 = time.time(), self._commits
            try:
                yield
            finally:
                self.stage_log.append(("generate", t0, time.time(), c0, self._commits))

    def stage_begin(self) -> None:
        """Staging thread: a new version's buckets follow (the previous swap has been applied: the client waits)."""
        self._staged = {}

    def stage_bucket(self, records) -> int:
        """Staging thread, beside a running generate: copy one bucket into the staging buffers (allocated by the
        first sync, reused after). Returns its bytes."""
        t0 = time.time()
        bucket, nbytes = unpack_bucket(records)
        for name, t in bucket:
            buf = self._stage.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                self._stage[name] = t.clone()  # the received view dies with the call: own the bytes
            else:
                buf.copy_(t)
            self._staged[name] = None
        self.stage_log.append(("stage", t0, time.time(), self._commits, self._commits))
        return nbytes

    def commit_staged(self, index: int) -> int:
        """Default thread, between two generate calls: load the staged tensors into the live model (the engine's
        own all-or-nothing ``update_weights``: checked first, so a refusal leaves the previous version whole and every
        later generate raises). ``index``: this swap's number as the client counts; returns the tensors loaded."""
        with self._live:
            t0 = time.time()
            try:
                if index != self._commits + 1:
                    raise RuntimeError(f"weight swap {index} arrived after swap {self._commits}")
                self.engine.update_weights([(n, self._stage[n]) for n in self._staged])
            except BaseException as err:  # noqa: BLE001 - kept: every later generate refuses to run on stale weights
                self._commit_error = err
                raise
            self._commits = index
            n, self._staged = len(self._staged), {}
            self.stage_log.append(("commit", t0, time.time(), index - 1, index))
            return n

    def staging_log(self) -> list:
        return list(self.stage_log)

    def ready(self) -> dict:
        return {"pid": os.getpid(), "engine": type(self.engine).__name__,
                "supports_pause": bool(getattr(self.engine, "supports_pause", False))}

    def pause_generation(self):
        """Runs in the "control" concurrency group (``RemoteEngine(pausable=True)``), beside a running generate."""
        return self.engine.pause_generation()

    def continue_generation(self):
        return self.engine.continue_generation()

    def continuations_timed(self, requests, params, return_routed_experts, images=None, expect_commit=None):
        """generate_continuations + its (start, end) wall-clock seconds."""
        with self._generating(expect_commit):
            t0 = time.time()
            kw = {} if images is None else {"images": images}  # engines without image prompts: three arguments
            out = self.engine.generate_continuations(requests, params, return_routed_experts, **kw)
            return out, t0, time.time()

    def generate(self, prompt_ids, params, n_samples, return_routed_experts, images=None, expect_commit=None):
        with self._generating(expect_commit):
            return _generate(self.engine, prompt_ids, params, n_samples, return_routed_experts, images)

    def check_weights(self, names, shapes, dtypes):
        """The engine's own check of a whole update, before its first bucket is sent (engines without one: none)."""
        check = getattr(self.engine, "check_weights", None)
        if callable(check):
            check(names, shapes, dtypes)

    def generate_timed(self, prompt_ids, params, n_samples, return_routed_experts, images=None, expect_commit=None):
        """generate + the (start, end) wall-clock seconds it ran (the engine's busy time, for async metrics)."""
        with self._generating(expect_commit):
            t0 = time.time()
            out = _generate(self.engine, prompt_ids, params, n_samples, return_routed_experts, images)
            return out, t0, time.time()

    def generate_stream(self, prompt_ids, params, n_samples, return_routed_experts, images=None, expect_commit=None):
        """Ray streaming generator (``num_returns="streaming"``): each (prompt index, group) as the engine finishes
        it (``generate_groups``), then (None, (start, end)) of the whole generation. The actor runs it to the end
        before its next call, as any other (the live-weights lock held throughout)."""
        with self._generating(expect_commit):
            t0 = time.time()
            groups = getattr(self.engine, "generate_groups", None)
            kw = {} if images is None else {"images": images}  # engines without image prompts: four arguments
            items = (groups(prompt_ids, params, n_samples, return_routed_experts, **kw) if callable(groups) else
                     enumerate(_generate(self.engine, prompt_ids, params, n_samples, return_routed_experts, images)))
            for i, group in items:
                yield int(i), group
            yield None, (t0, time.time())

    def load_bucket(self, records) -> int:
        bucket, nbytes = unpack_bucket(records)
        with self._live:
            self.engine.update_weights(bucket)
        return nbytes

    def sleep(self, args, kwargs):
        return self.engine.sleep(*args, **kwargs)

    def wake(self, args, kwargs):
        return self.engine.wake(*args, **kwargs)

    def flush_cache(self):
        return self.engine.flush_cache()

    def get(self, path: str):
        obj = self.engine
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    def call(self, path: str, args, kwargs):
        return self.get(path)(*args, **kwargs)

    def shutdown(self):
        shutdown = getattr(self.engine, "shutdown", None)
        return shutdown() if callable(shutdown) else None


def _death_cause(err: BaseException) -> str:
    """A one-paragraph reason from Ray's actor error (the full text stays on the chained exception)."""
    msg = str(err)
    if getattr(err, "actor_init_failed", False) or "creation task" in msg:
        lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
        return f"the engine factory raised in the actor: {lines[-1] if lines else msg}"
    if "ray.kill" in msg:
        return "the actor was killed with ray.kill"
    for key in ("Worker exit detail:", "The actor is dead because"):
        if key in msg:
            detail = msg[msg.index(key):].split(" Some common causes")[0].strip()
            return (f"its process exited ({detail}); typical causes: killed by a signal (SIGKILL, the OOM "
                    f"killer) or a crash (SIGSEGV)")
    return msg.strip().splitlines()[0] if msg.strip() else type(err).__name__


# ----------------------------------------------------------------------------------------------
# Client
# ----------------------------------------------------------------------------------------------
class RemoteEngine(RolloutEngine):
    """A RolloutEngine living in a Ray actor (separate placement). See the module docstring.

    factory: picklable zero-argument callable run inside the actor that returns the engine.
    bucket_bytes: default cap of one update_weights bucket (bytes; a larger tensor goes alone).
    max_inflight: buckets submitted but not yet loaded (bounds the object-store use to about
        (max_inflight + 1) x bucket_bytes).
    num_cpus / num_gpus: the actor's Ray resources; actor_options: any other ``.options()``.
    timeout_s: limit of one call (generate, one bucket, sleep, ...); start_timeout_s: limit of the
        factory (model loading); close_timeout_s: limit of the engine's own shutdown in close().
    ray_init_kwargs: passed to ``ray.init`` when Ray is not initialised yet (``ray_init.init_ray``).
    torch_threads: torch.set_num_threads in the actor (default: Ray's OMP_NUM_THREADS = num_cpus).
    pausable: a "control" thread for ``pause_generation`` (partial rollout). stageable: a "staging" thread and a
    second copy of the weights (``staging`` / ``commit_staged``: the overlapped weight sync).
    One caller at a time (not thread-safe), as a local engine.
    """

    def __init__(self, factory: Callable[[], RolloutEngine], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 max_inflight: int = 2, num_cpus: float = 1, num_gpus: float = 0, timeout_s: float = 1800.0,
                 start_timeout_s: float = 600.0, close_timeout_s: float = 30.0, torch_threads: Optional[int] = None,
                 ray_init_kwargs: Optional[dict] = None, actor_options: Optional[dict] = None,
                 pausable: bool = False, stageable: bool = False):
        import ray

        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.bucket_bytes, self.max_inflight = int(bucket_bytes), int(max_inflight)
        self.timeout_s, self.close_timeout_s = float(timeout_s), float(close_timeout_s)
        self.last_update: Optional[UpdateStats] = None
        self.pid: Optional[int] = None
        self._failure: Optional[RemoteEngineError] = None  # set once the actor is unusable
        self._actor = None
        init_ray(num_cpus, num_gpus, ray_init_kwargs)  # joins RAY_ADDRESS's cluster if set
        options = dict(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_task_retries=0)
        self.pausable = bool(pausable)
        options.update(actor_options or {})
        # pausable: pause_generation must reach the actor while its generate runs: a second thread for it only;
        # stageable: the staged buckets are copied on a thread of their own beside a running generate (Ray takes
        # concurrency groups at class definition, not in .options()); every other call runs in the default group,
        # one at a time, in the order sent
        self.stageable = bool(stageable)
        self.staging = False  # set around one sync by the caller: update_weights stages instead of loading
        self._stage_open = False  # stage_begin sent for the version being staged
        self._commits_sent = 0  # commit_staged calls sent: the swap index every later generate expects
        self._commit_ref = None  # the last swap's result (waited for before the next version is staged)
        groups = {**({"control": 1} if pausable else {}), **({"staging": 1} if stageable else {})}
        host = ray.remote(concurrency_groups=groups)(EngineHost) if groups else ray.remote(EngineHost)
        self._actor = host.options(**options).remote(factory, torch_threads)
        info = self._get(self._actor.ready.remote(), "start (engine factory)", start_timeout_s)
        self.pid, self.engine_class = info["pid"], info["engine"]
        self._engine_pauses = bool(info.get("supports_pause"))

    # -- plumbing -------------------------------------------------------------------------------
    def _check(self):
        if self._failure is not None:
            raise type(self._failure)(str(self._failure))
        if self._actor is None:
            raise RemoteEngineClosed("the remote engine is closed")

    def _get(self, ref, what: str, timeout: Optional[float] = None):
        """ray.get with a timeout; actor death / timeout -> RemoteEngineDied / RemoteEngineTimeout.
        Exceptions raised by the engine itself propagate with their own type (Ray's RayTaskError
        subclasses them) and leave the actor usable."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        timeout = self.timeout_s if timeout is None else timeout
        try:
            return ray.get(ref, timeout=timeout)
        except GetTimeoutError as err:
            self._fail(RemoteEngineTimeout(
                f"remote {self._label()} {what} did not finish within {timeout:g} s; the actor was killed "
                f"(pass a larger timeout_s / start_timeout_s if the call is legitimately that long)"), kill=True)
            raise self._failure from err
        except RayActorError as err:
            self._fail(RemoteEngineDied(f"remote {self._label()} died during {what}: {_death_cause(err)}"), kill=True)
            raise self._failure from err

    def _label(self) -> str:
        name = getattr(self, "engine_class", None) or "rollout engine"
        return f"{name} actor" + (f" (pid {self.pid})" if self.pid else "")

    def _fail(self, error: RemoteEngineError, kill: bool = False):
        if self._failure is None:
            self._failure = error
        if kill and self._actor is not None:
            self._kill()
            self._wait_dead(self._actor, self.close_timeout_s)

    def _kill(self):
        import ray

        if self._actor is not None:
            try:
                ray.kill(self._actor, no_restart=True)
            except Exception:  # already dead, or Ray already shut down
                pass

    def _call(self, method: str, *args, what: Optional[str] = None):
        self._check()
        return self._get(getattr(self._actor, method).remote(*args), what or f"{method}()")

    # -- RolloutEngine --------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                 return_routed_experts: bool = False, images=None) -> list[list[Sample]]:
        """``images`` (ImageInputs or None per prompt) travel to the actor with the prompts (Ray's object store;
        tensors only) and come back on the samples."""
        prompts = [[int(t) for t in p] for p in prompt_ids]
        return self._call("generate", prompts, params, int(n_samples), bool(return_routed_experts),
                          check_images(prompts, images), self._expect(), what="generate()")

    def _expect(self):
        """The swap index a generate sent now must run on (stageable actors; None: not checked)."""
        return self._commits_sent if self.stageable else None

    def generate_async(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                       return_routed_experts: bool = False, images=None) -> PendingGeneration:
        """Submit generate() to the actor and return at once; the actor runs its calls in order, so a weight
        update sent after it loads after this generation. ``result()`` waits (timeout_s, as every call)."""
        import ray

        self._check()
        prompts = [[int(t) for t in p] for p in prompt_ids]
        ref = self._actor.generate_timed.remote(prompts, params, int(n_samples), bool(return_routed_experts),
                                                check_images(prompts, images), self._expect())
        return PendingGeneration(lambda: self._get(ref, "generate()"),
                                 ready=lambda: bool(ray.wait([ref], timeout=0)[0]))

    def generate_stream_async(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                              return_routed_experts: bool = False, images=None) -> StreamingGeneration:
        """``generate_async`` whose groups come back while the actor still generates (a Ray streaming generator over
        the engine's ``generate_groups``; the same samples as ``generate``). Each wait for the next group has the
        call timeout (``timeout_s``); a dead actor raises RemoteEngineDied from ``groups()`` / ``result()``."""
        import ray
        from ray.exceptions import RayActorError

        self._check()
        prompts = [[int(t) for t in p] for p in prompt_ids]
        gen = self._actor.generate_stream.options(num_returns="streaming").remote(
            prompts, params, int(n_samples), bool(return_routed_experts), check_images(prompts, images),
            self._expect())

        def items():
            while True:
                try:
                    ref = gen._next_sync(timeout_s=self.timeout_s)
                except StopIteration:
                    return
                except RayActorError as err:
                    self._fail(RemoteEngineDied(f"remote {self._label()} died during generate(): "
                                                f"{_death_cause(err)}"), kill=True)
                    raise self._failure from err
                if ref.is_nil():  # no next group within the timeout
                    self._fail(RemoteEngineTimeout(
                        f"remote {self._label()} generate() handed back no group within {self.timeout_s:g} s; the "
                        f"actor was killed (pass a larger timeout_s if a group legitimately takes that long)"),
                        kill=True)
                    raise self._failure
                yield self._get(ref, "generate()")

        return StreamingGeneration(len(prompts), items(), ready=lambda: bool(ray.wait([gen], timeout=0)[0]))

    # -- partial rollout (rollout/partial.py) ------------------------------------------------------
    @property
    def supports_pause(self) -> bool:
        """The hosted engine can pause and this actor was started ``pausable`` (its control thread)."""
        return self.pausable and self._engine_pauses

    def pause_generation(self) -> None:
        """The hosted engine's ``pause_generation``, delivered on the actor's control thread while a ``generate``
        runs (the calls of the default group run in order, one at a time); returns once the flag is set."""
        from megatron_s3ac.rollout.base import PartialRolloutUnsupported

        if not self.supports_pause:
            raise PartialRolloutUnsupported(
                f"remote {self._label()} cannot pause generation: " + ("its engine has no pause_generation" if
                                                                       self.pausable else "started without pausable=True"))
        self._check()
        self._get(self._actor.pause_generation.options(concurrency_group="control").remote(), "pause_generation()")

    def continue_generation(self) -> None:
        """In the default group: after the calls sent before it (the weight update)."""
        self._call("continue_generation", what="continue_generation()")

    def generate_continuations(self, requests, params: SamplingParams, return_routed_experts: bool = False,
                               images=None):
        return self.continue_async(requests, params, return_routed_experts, images).result()

    def continue_async(self, requests, params: SamplingParams, return_routed_experts: bool = False, images=None
                       ) -> PendingGeneration:
        import ray

        self._check()
        reqs = [([int(t) for t in p], int(b)) for p, b in requests]
        images = check_images([p for p, _ in reqs], images)
        ref = self._actor.continuations_timed.remote(reqs, params, bool(return_routed_experts), images,
                                                     self._expect())
        return PendingGeneration(lambda: self._get(ref, "generate_continuations()"),
                                 ready=lambda: bool(ray.wait([ref], timeout=0)[0]))

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], bucket_bytes: Optional[int] = None) -> None:
        """Stream (hf_name, tensor) pairs to the engine in buckets of <= bucket_bytes (default: the
        constructor's); blocks until all are loaded. Stats of the call: ``self.last_update``.
        All or nothing: the hosted engine checks every name, shape and dtype (its ``check_weights``) before the first
        bucket is sent (a lazy stream is collected first: references to its tensors, no copies)."""
        self._check()
        named_tensors = list(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        check = (self._actor.check_weights.options(concurrency_group="staging") if self.staging else
                 self._actor.check_weights)
        load = self._actor.stage_bucket.options(concurrency_group="staging") if self.staging else \
            self._actor.load_bucket
        if self.staging and not self._stage_open:  # the first bucket of a version: the staging copy is free again
            if self._commit_ref is not None:
                self._get(self._commit_ref, "commit_staged()")  # the previous swap reads it (the trainer waits)
                self._commit_ref = None
            self._get(self._actor.stage_begin.options(concurrency_group="staging").remote(), "stage_begin()")
            self._stage_open = True
        self._get(check.remote([str(n) for n, _ in named_tensors], [tuple(t.shape) for _, t in named_tensors],
                               [str(t.dtype).removeprefix("torch.") for _, t in named_tensors]), "check_weights()")
        cap = int(bucket_bytes or self.bucket_bytes)
        stats = UpdateStats()
        t0 = time.perf_counter()
        pending: collections.deque = collections.deque()
        error: Optional[BaseException] = None
        try:
            for bucket in iter_buckets(named_tensors, cap):
                records = pack_bucket(bucket)
                pending.append(load.remote(records))  # serialised (copied) here
                stats.tensors += len(bucket)
                del records, bucket
                while len(pending) > self.max_inflight:
                    stats.bucket_sizes.append(self._get(pending.popleft(), "update_weights()"))
            while pending:
                stats.bucket_sizes.append(self._get(pending.popleft(), "update_weights()"))
        except Exception as err:  # engine error, actor death, or the caller's iterator raised
            error = err
        if error is not None:
            self._drain(pending)
            raise error
        stats.buckets, stats.bytes = len(stats.bucket_sizes), sum(stats.bucket_sizes)
        stats.seconds = time.perf_counter() - t0
        self.last_update = stats

    def commit_staged(self) -> None:
        """Queue the swap of the staged version into the live model behind the generate calls already sent (the
        default thread runs them in order): they finish on the old weights, every generate sent after this call runs
        on the new ones. Returns at once; the next staged version first waits for this swap, and a failed swap makes
        every later generate raise. A no-op when nothing was staged since the last swap."""
        self._check()
        if not self._stage_open:
            return
        self._commits_sent += 1
        self._commit_ref = self._actor.commit_staged.remote(self._commits_sent)
        self._stage_open = False

    def wait_committed(self) -> None:
        """Block until the last swap is applied (tests; a checkpoint does not need it: it waits for generations)."""
        if self._commit_ref is not None:
            self._get(self._commit_ref, "commit_staged()")
            self._commit_ref = None

    def staging_log(self) -> list:
        """The actor's (kind, start, end, swaps at start, swaps at end) spans: "generate", "stage", "commit"."""
        return self._call("staging_log", what="staging_log()")

    def _drain(self, pending):
        """After a failed bucket: wait for the buckets already submitted (their outcome is dropped), so
        no load is still running when the error reaches the caller."""
        import ray

        if self._failure is not None or not pending:
            return
        try:
            ray.wait(list(pending), num_returns=len(pending), timeout=self.timeout_s)
        except Exception:
            pass

    def sleep(self, *args, **kwargs) -> None:
        """Forwarded with its arguments (CPUEngine: keep_cpu_backup; SGLangEngine: tags)."""
        return self._call("sleep", args, kwargs, what="sleep()")

    def wake(self, *args, **kwargs) -> None:
        return self._call("wake", args, kwargs, what="wake()")

    def flush_cache(self) -> None:
        if self.staging:  # nothing is live yet: the swap's update_weights flushes
            return None
        return self._call("flush_cache", what="flush_cache()")

    def call(self, method: str, *args, **kwargs):
        """Call any method of the hosted engine by dotted path, e.g. call("model.save_pretrained", dir)."""
        return self._call("call", method, args, kwargs, what=f"call({method!r})")

    def get(self, attr: str):
        """Any attribute of the hosted engine by dotted path, e.g. get("num_layers") (pickled back)."""
        return self._call("get", attr, what=f"get({attr!r})")

    def ping(self) -> dict:
        """{'pid', 'engine'}; raises RemoteEngineDied if the actor is gone."""
        return self._call("ready", what="ping()")

    @property
    def alive(self) -> bool:
        return self._actor is not None and self._failure is None

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Shut the engine down (bounded by close_timeout_s), then kill the actor. Idempotent."""
        import ray

        if self._actor is None:
            return
        if self._failure is None and ray.is_initialized():
            try:
                ray.get(self._actor.shutdown.remote(), timeout=self.close_timeout_s)
            except Exception:  # dead, timed out, or the engine's shutdown raised: kill anyway
                pass
        if ray.is_initialized():
            self._kill()
            self._wait_dead(self._actor, self.close_timeout_s)
        self._actor = None
        if self._failure is None:
            self._failure = RemoteEngineClosed("the remote engine is closed")

    @staticmethod
    def _wait_dead(actor, timeout: float) -> bool:
        """ray.kill is asynchronous: poll until the actor answers with its death (its resources, e.g.
        GPU memory, are then released), at most ``timeout`` seconds."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ray.get(actor.ready.remote(), timeout=max(0.1, min(2.0, deadline - time.monotonic())))
            except RayActorError:
                return True
            except GetTimeoutError:
                continue
            time.sleep(0.05)
        return False

    def shutdown(self) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "alive" if self.alive else f"down: {self._failure}"
        return f"RemoteEngine({getattr(self, 'engine_class', '?')}, pid={self.pid}, {state})"


def _generate(engine, prompt_ids, params, n_samples, return_routed_experts, images):
    """engine.generate, passing ``images`` only when there are some (engines without image support keep their
    four-argument generate)."""
    if images is None:
        return engine.generate(prompt_ids, params, n_samples, return_routed_experts)
    return engine.generate(prompt_ids, params, n_samples, return_routed_experts, images=images)

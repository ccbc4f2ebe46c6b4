"""Data-parallel rollout over N engines, each a Ray actor pinned with its own placement group.

``EnginePool(factory, num_engines, gpus_per_engine=..., gpus_per_node=...)``:

* Placement: one placement group per engine. An engine that fits on a node (gpus_per_engine <= gpus_per_node)
  gets one bundle {GPU: gpus_per_engine, CPU: cpus_per_engine} (STRICT_PACK: all its GPUs on one node); a larger
  engine spans gpus_per_engine / gpus_per_node nodes, one bundle per node (STRICT_SPREAD), one actor per node:
  node 0's actor serves the calls, the others run sglang's schedulers for their node (``EngineSlot.node_rank``,
  ``dist_init_addr`` = node 0's address). Each actor is scheduled into its bundle
  (PlacementGroupSchedulingStrategy), so Ray gives it exactly those GPUs (CUDA_VISIBLE_DEVICES).
* ``factory(slot: EngineSlot) -> RolloutEngine`` runs inside the actor (picklable; e.g. factory.make_engine_factory).
* ``generate`` splits the prompts into contiguous, balanced chunks (one per engine), runs them concurrently and
  returns the samples in prompt order. With ``params.seed`` set, chunk e gets ``seed + (first prompt) x n_samples``,
  so request k of the whole batch carries seed + k on whichever engine runs it. A prompt that cannot fit
  prompt + max_new_tokens in its engine's context (``ready()["context_length"]``) is refused before any engine runs
  (``PromptTooLongError`` naming its index in the whole batch, not in the engine's chunk).
* Every wait has a per-engine timeout (``timeout_s``): an engine that does not answer in time is killed and
  ``EngineTimeout`` names it; an engine whose process died raises ``EngineDied`` naming it (index, node, pid) and
  the cause; the pool is unusable afterwards (restart it). An engine's own exception (e.g. WeightUpdateError)
  propagates with its type and message.
* Weight sync through the object store (tools and tests; the trainer uses the colocated hand-over or the broadcast):
  ``update_weights`` opens one weight-update session per engine, streams buckets (each put once, read by every
  engine), then ``finish_sync`` (session end + cache flush) on every engine. ``sync_colocated`` wraps it in
  the colocated order wake(["weights"]) -> sync -> wake(["kv_cache", "cuda_graph"]).
  Separate GPUs: ``broadcast.WeightBroadcaster(pool)`` + ``begin_weight_update`` / ``finish_sync``.
* Colocated hand-over (rollout/engines/sglang/ipc.py, rollout/engines/sglang/colocated.py): ``device_keys()`` says which device each engine's TP
  ranks use; ``submit(e, "load_serialized_bucket", payloads, names, shapes[, dtypes])`` loads one bucket from
  per-TP-rank payloads inside engine e's open session (SGLangEngine.load_serialized_bucket).
* Ray (``ray_init.init_ray``): connects to a running cluster (``ray.init(address="auto")``) when RAY_ADDRESS is
  set (the launch scripts start one on every node), else starts a local one; the pool never shuts Ray down.
"""
from __future__ import annotations

import collections
import dataclasses
import inspect
import os
import socket
from typing import Any, Callable, Iterable, Optional, Sequence

from megatron_s3ac.rollout.base import (PendingGeneration, RolloutEngine, Sample, SamplingParams, StreamingGeneration,
                                        check_images, iter_buckets)
from megatron_s3ac.rollout.engines.ray_init import engine_runtime_env, init_ray
from megatron_s3ac.rollout.engines.remote import _death_cause, pack_bucket, unpack_bucket
from megatron_s3ac.rollout.engines.sglang.engine import PromptTooLongError


class EnginePoolError(RuntimeError):
    """An engine of the pool cannot serve (base class)."""


class EngineDied(EnginePoolError):
    """An engine's process went away (crash, OOM kill, node loss, its factory raised)."""


class EngineTimeout(EnginePoolError, TimeoutError):
    """An engine did not answer within the timeout; it was killed."""


@dataclasses.dataclass(frozen=True)
class EngineSlot:
    """Where one engine actor runs: engine ``index`` of ``num_engines``; ``node_rank`` of ``nnodes`` for an engine
    spanning nodes (sglang's nnodes/node_rank/dist_init_addr)."""

    index: int
    num_engines: int
    node_rank: int = 0
    nnodes: int = 1
    dist_init_addr: Optional[str] = None


def check_prompt_lengths(prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         chunks: Iterable[tuple[int, int, int]], contexts: dict, label: Callable[[int], str]) -> None:
    """Raise PromptTooLongError for the first prompt that cannot fit prompt + max_new_tokens in the context of the
    engine it goes to (sglang refuses the whole batch then, managers/tokenizer_manager.py:1338-1378). chunks:
    (engine, lo, hi) prompt ranges; contexts: engine -> context length in tokens (None: unknown, not checked); the
    message names the prompt's index in ``prompts`` (the whole batch) and label(engine)."""
    for e, lo, hi in chunks:
        ctx = contexts.get(e)
        for i in range(lo, hi) if ctx else ():
            need = len(prompts[i]) + max_new_tokens
            if need > ctx:
                raise PromptTooLongError(
                    f"{label(e)}: prompt {i} has {len(prompts[i])} tokens; with max_new_tokens={max_new_tokens} it "
                    f"needs {need} > the context length {ctx}. Shorten or filter the prompt (data.max_prompt_tokens) "
                    f"or lower max_new_tokens")


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of n items over `parts` chunks, sizes differing by at most one, in order."""
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


def split_generation(n_prompts: int, params: SamplingParams, n_samples: int, num_engines: int
                     ) -> list[tuple[int, int, int, SamplingParams]]:
    """(engine, lo, hi, params) per non-empty chunk of ``n_prompts`` over ``num_engines`` engines: contiguous,
    balanced; with ``params.seed`` set chunk e is seeded ``seed + lo x n_samples``, so request k of the whole batch
    (prompt-major) carries seed + k on whichever engine runs it (``EnginePool``, ``VLLMEnginePool``)."""
    out = []
    for e, (lo, hi) in enumerate(split_evenly(n_prompts, num_engines)):
        if lo < hi:
            p = params if params.seed is None else dataclasses.replace(params, seed=params.seed + lo * n_samples)
            out.append((e, lo, hi, p))
    return out


class EngineWorker:
    """Ray actor body: one engine built by factory(slot), serving the pool's calls."""

    def __init__(self, factory: Callable, slot: EngineSlot):
        self.slot = slot
        self.engine = factory(slot)

    def ready(self) -> dict:
        config = getattr(self.engine, "config", None)
        ctx = getattr(self.engine, "context_length", None)  # tokens (prompt + response); None: unknown
        import ray

        return {"pid": os.getpid(), "node": socket.gethostname(), "engine": type(self.engine).__name__,
                # Ray's GPUs for this actor (its CUDA_VISIBLE_DEVICES); none outside Ray
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else [],
                "tp_size": int(getattr(config, "tp_size", 1) or 1),
                "base_gpu_id": int(getattr(config, "base_gpu_id", 0) or 0),
                "gpu_id_step": int((getattr(config, "extra", None) or {}).get("gpu_id_step", 1)),
                "context_length": int(ctx) if ctx else None,
                "supports_pause": bool(getattr(self.engine, "supports_pause", False))}

    @staticmethod
    def address() -> str:
        import ray

        return ray.util.get_node_ip_address()

    def generate(self, prompts, params, n_samples, return_routed_experts, images=None):
        if images is None:  # engines without image prompts keep their four-argument generate
            return self.engine.generate(prompts, params, n_samples, return_routed_experts)
        return self.engine.generate(prompts, params, n_samples, return_routed_experts, images=images)

    # partial rollout (rollout/partial.py): pause runs in the "control" concurrency group (``EnginePool(pausable=
    # True)``), beside a generate of the default group; the rest run in order in the default group
    def pause_generation(self):
        return self.engine.pause_generation()

    def continue_generation(self):
        return self.engine.continue_generation()

    def continuations(self, requests, params, return_routed_experts, images=None):
        if images is None:  # engines without image prompts keep their three-argument generate_continuations
            return self.engine.generate_continuations(requests, params, return_routed_experts)
        return self.engine.generate_continuations(requests, params, return_routed_experts, images=images)

    def call(self, method: str, args, kwargs):
        """engine.<method>(*args, **kwargs); method may be a dotted path (e.g. "engine.debug_...")."""
        obj = self.engine
        for part in method.split("."):
            obj = getattr(obj, part)
        return obj(*args, **kwargs)

    # weight sync: sessions where the engine has them (SGLangEngine), plain update_weights otherwise
    def begin_weight_update(self):
        if hasattr(self.engine, "begin_weight_update"):
            self.engine.begin_weight_update()

    def check_weights(self, names, shapes, dtypes=None):
        """The engine's own check of a whole update (names, shapes, dtypes), before anything moves."""
        if hasattr(self.engine, "check_weights"):
            self.engine.check_weights(names, shapes, dtypes)

    def load_bucket(self, records, flattened: bool):
        bucket, nbytes = unpack_bucket(records)
        if hasattr(self.engine, "load_weights_bucket"):
            self.engine.load_weights_bucket(bucket, flattened=flattened)
        else:
            self.engine.update_weights(bucket)
        return nbytes

    def finish_sync(self, names, require_complete: bool):
        if hasattr(self.engine, "finish_sync"):
            self.engine.finish_sync(names, require_complete)
        else:
            self.engine.flush_cache()

    def abandon_sync(self):
        if hasattr(self.engine, "end_weight_update"):
            self.engine.end_weight_update()

    def sleep(self, tags):
        if "tags" in inspect.signature(self.engine.sleep).parameters:
            return self.engine.sleep(tags)
        return self.engine.sleep() if tags is None or "weights" in tags else None

    def wake(self, tags):
        if "tags" in inspect.signature(self.engine.wake).parameters:
            return self.engine.wake(tags)
        return self.engine.wake() if tags is None or "weights" in tags else None

    def shutdown(self):
        fn = getattr(self.engine, "shutdown", None)
        return fn() if callable(fn) else None


class EnginePool(RolloutEngine):
    """N data-parallel engines in Ray actors (see the module docstring)."""

    def __init__(self, factory: Callable[[EngineSlot], RolloutEngine], num_engines: int, *,
                 gpus_per_engine: int = 0, gpus_per_node: Optional[int] = None, cpus_per_engine: float = 1,
                 timeout_s: float = 1800.0, start_timeout_s: float = 900.0, max_inflight: int = 2,
                 bucket_bytes: int = 256 << 20, ray_init_kwargs: Optional[dict] = None, pausable: bool = False):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        per_node = gpus_per_node or gpus_per_engine or 1
        if gpus_per_engine > per_node and gpus_per_engine % per_node:
            raise ValueError(f"an engine of {gpus_per_engine} GPUs spans whole nodes: it must be a multiple of "
                             f"gpus_per_node={per_node}")
        self.nnodes = max(1, gpus_per_engine // per_node) if gpus_per_engine > per_node else 1
        self.num_engines, self.timeout_s, self.max_inflight = int(num_engines), float(timeout_s), int(max_inflight)
        self.bucket_bytes = int(bucket_bytes)
        self.pausable = bool(pausable)  # partial rollout: each actor gets a "control" thread for pause_generation
        self._failure: Optional[EnginePoolError] = None
        init_ray(num_engines * cpus_per_engine * self.nnodes, gpus_per_engine, ray_init_kwargs)  # RAY_ADDRESS: join
        gpus_per_bundle = gpus_per_engine // self.nnodes if gpus_per_engine else 0
        bundle = {"CPU": cpus_per_engine, **({"GPU": gpus_per_bundle} if gpus_per_bundle else {})}
        self.placement_groups, self.actors, self.followers, self.info = [], [], [], []
        self._bundle_devices: dict[int, list[dict]] = {}  # engine -> visible_devices() per bundle (nnodes > 1)
        try:
            for e in range(num_engines):
                pg = placement_group([dict(bundle) for _ in range(self.nnodes)],
                                     strategy="STRICT_SPREAD" if self.nnodes > 1 else "STRICT_PACK")
                self.placement_groups.append(pg)
            for e, pg in enumerate(self.placement_groups):
                if not self._ready(pg.ready(), start_timeout_s):
                    raise EngineTimeout(f"rollout engine {e}: no placement for {self.nnodes} x {bundle} within "
                                        f"{start_timeout_s:g} s (the Ray cluster lacks the resources; `ray status`)")
            env = engine_runtime_env(factory)  # the driver's engine variables: Ray gives actors the raylet's
            opts = lambda pg, b: dict(num_cpus=cpus_per_engine, num_gpus=gpus_per_bundle, max_restarts=0,
                                      max_task_retries=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                                          placement_group=pg, placement_group_bundle_index=b),
                                      **({"runtime_env": env} if env else {}))
            # a task takes max_retries (Ray refuses the actor-only max_restarts / max_task_retries for tasks)
            task_opts = lambda pg, b: {**{k: v for k, v in opts(pg, b).items()
                                          if k not in ("max_restarts", "max_task_retries")}, "max_retries": 0}
            # Ray takes concurrency groups at class definition (as RemoteEngine(pausable=True)): one "control"
            # thread for pause_generation beside the default group, whose calls stay one at a time, in order
            remote = (ray.remote(concurrency_groups={"control": 1})(EngineWorker) if self.pausable
                      else ray.remote(EngineWorker))
            for e, pg in enumerate(self.placement_groups):
                addr = None
                if self.nnodes > 1:  # node 0's address, found by a probe in its bundle
                    probe = ray.remote(EngineWorker.address).options(**task_opts(pg, 0))
                    addr = f"{ray.get(probe.remote(), timeout=start_timeout_s)}:{_free_port()}"
                    # the devices each bundle gives its actor (same bundle, same GPUs), probed before the actors
                    # hold the bundles: followers block inside sglang and can never answer device_keys()
                    self._bundle_devices[e] = ray.get(
                        [ray.remote(visible_devices).options(**task_opts(pg, r)).remote() for r in range(self.nnodes)],
                        timeout=start_timeout_s)
                for r in range(1, self.nnodes):  # non-zero node ranks: sglang blocks in them; never awaited
                    self.followers.append(remote.options(**opts(pg, r)).remote(
                        factory, EngineSlot(e, num_engines, r, self.nnodes, addr)))
                self.actors.append(remote.options(**opts(pg, 0)).remote(
                    factory, EngineSlot(e, num_engines, 0, self.nnodes, addr)))
            self.info = self.wait([(e, a.ready.remote()) for e, a in enumerate(self.actors)], "start (engine factory)",
                                  start_timeout_s)
        except BaseException:
            self.close()
            raise

    # -- plumbing -------------------------------------------------------------------------------
    @staticmethod
    def _ready(ref, timeout) -> bool:
        import ray

        done, _ = ray.wait([ref], timeout=timeout)
        return bool(done)

    def label(self, e: int) -> str:
        info = self.info[e] if e < len(self.info) and isinstance(self.info[e], dict) else {}
        where = f" on {info['node']}, pid {info['pid']}" if info else ""
        return f"rollout engine {e} of {self.num_engines}{where}"

    @property
    def tp_sizes(self) -> list[int]:
        return [int(i["tp_size"]) for i in self.info]

    def _check(self):
        if self._failure is not None:
            raise type(self._failure)(str(self._failure))
        if not self.actors:
            raise EnginePoolError("the engine pool is closed")

    def submit(self, e: int, method: str, *args, **kwargs):
        """Run engine e's ``method(*args, **kwargs)`` asynchronously; returns (e, ref) for ``wait``."""
        self._check()
        return e, self.actors[e].call.remote(method, args, kwargs)

    def wait(self, refs: Sequence[tuple[int, Any]], what: str, timeout: Optional[float] = None) -> list:
        """Results of (engine, ref) pairs in order. Per-engine deadline; dead / late engines are named."""
        import ray
        from ray.exceptions import RayActorError

        timeout = self.timeout_s if timeout is None else timeout
        pending = {ref: e for e, ref in refs}
        _, late = ray.wait(list(pending), num_returns=len(pending), timeout=timeout)
        if late:
            names = ", ".join(self.label(pending[r]) for r in late)
            raise self._fail(EngineTimeout(f"{names}: {what} did not finish within {timeout:g} s; killed (raise "
                                           f"rollout.sglang.timeout_s if it is legitimately that long)"),
                             [pending[r] for r in late])
        out = []
        for e, ref in refs:
            try:
                out.append(ray.get(ref))
            except RayActorError as err:
                raise self._fail(EngineDied(f"{self.label(e)} died during {what}: {_death_cause(err)}"), [e]) from err
        return out

    def _fail(self, error: EnginePoolError, engines: Iterable[int]) -> EnginePoolError:
        """Record the first failure (the pool is unusable after it), kill the named engines, return error."""
        import ray

        if self._failure is None:
            self._failure = error
        for e in engines:
            try:
                ray.kill(self.actors[e], no_restart=True)
            except Exception:
                pass
        return error

    def _all(self, method: str, *args, what: Optional[str] = None) -> list:
        self._check()
        return self.wait([(e, getattr(a, method).remote(*args)) for e, a in enumerate(self.actors)],
                         what or f"{method}()")

    # -- RolloutEngine --------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                 return_routed_experts: bool = False, images=None) -> list[list[Sample]]:
        return self.generate_async(prompt_ids, params, n_samples, return_routed_experts, images).result()

    def generate_async(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                       return_routed_experts: bool = False, images=None) -> PendingGeneration:
        """Submit every engine's chunk and return at once (``generate`` = this + ``result()``); each engine
        runs its calls in order, so a weight update sent after it loads after this generation. ``images`` (one
        ImageInputs or None per prompt) go with their prompts' chunk."""
        import ray

        self._check()
        prompts = [[int(t) for t in p] for p in prompt_ids]
        images = check_images(prompts, images)
        split = split_generation(len(prompts), params, n_samples, self.num_engines)
        chunks = [(e, lo, hi) for e, lo, hi, _ in split]
        # an engine numbers the prompts of its own chunk: check here, naming the prompt's index in the whole batch
        contexts = {e: self.info[e].get("context_length") for e, _, _ in chunks}
        check_prompt_lengths(prompts, params.max_new_tokens, chunks, contexts, self.label)
        refs, spans = [], []
        for e, lo, hi, p in split:
            refs.append((e, self.actors[e].generate.remote(prompts[lo:hi], p, int(n_samples),
                                                           bool(return_routed_experts),
                                                           None if images is None else
                                                           check_images(prompts[lo:hi], images[lo:hi]))))
            spans.append((lo, hi))

        def wait():
            try:
                results = self.wait(refs, "generate")
            except PromptTooLongError:
                # the context was unknown up front and an engine learnt it from sglang's refusal: name the global
                # index
                infos = self.wait([(e, self.actors[e].ready.remote()) for e, _, _ in chunks], "ready()")
                check_prompt_lengths(prompts, params.max_new_tokens, chunks,
                                     {e: i.get("context_length") for (e, _, _), i in zip(chunks, infos)}, self.label)
                raise
            out: list = []
            for (lo, hi), groups in zip(spans, results):
                if len(groups) != hi - lo:
                    raise EnginePoolError(f"an engine returned {len(groups)} groups for {hi - lo} prompts")
                out.extend(groups)
            return out

        def ready() -> bool:
            return not refs or not ray.wait([r for _, r in refs], num_returns=len(refs), timeout=0)[1]

        pending = PendingGeneration(wait, ready=ready)
        pending.chunks = list(zip(refs, spans))  # ((engine, ref), (lo, hi)): generate_stream_async's view
        return pending

    def generate_stream_async(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                              return_routed_experts: bool = False, images=None) -> StreamingGeneration:
        """``generate_async`` handing back each engine's groups as soon as that engine has finished its chunk (the
        pool's unit of completion: an engine answers one call with its whole chunk), in the order engines finish;
        the same samples. A dead or late engine raises from ``groups()`` / ``result()`` as from ``generate``."""
        import time

        import ray

        t0 = time.time()
        pending = self.generate_async(prompt_ids, params, n_samples, return_routed_experts, images)

        def items():
            left = {ref: (e, span) for (e, ref), span in pending.chunks}
            while left:
                done, _ = ray.wait(list(left), num_returns=1, timeout=self.timeout_s)
                if not done:  # names and kills the late engines (EngineTimeout)
                    self.wait([(e, r) for r, (e, _) in left.items()], "generate", timeout=0)
                for ref in done:
                    e, (lo, hi) = left.pop(ref)
                    (groups,) = self.wait([(e, ref)], "generate")
                    if len(groups) != hi - lo:
                        raise EnginePoolError(f"an engine returned {len(groups)} groups for {hi - lo} prompts")
                    yield from ((lo + j, g) for j, g in enumerate(groups))
            yield None, (t0, time.time())

        return StreamingGeneration(len(prompt_ids), items(), ready=pending.done)

    # -- partial rollout (rollout/partial.py; docs/rollout.md "Partial rollout") --------------------
    @property
    def supports_pause(self) -> bool:
        """Every engine can pause (SGLangEngine) and the actors were started ``pausable`` (their control thread)."""
        return self.pausable and bool(self.info) and all(bool(i.get("supports_pause")) for i in self.info)

    def pause_generation(self) -> None:
        """Every engine's ``pause_generation`` on its actor's control thread, while its generate runs; returns when
        each has paused (SGLangEngine: once its aborted batch came back)."""
        from megatron_s3ac.rollout.base import PartialRolloutUnsupported

        if not self.supports_pause:
            raise PartialRolloutUnsupported("the engine pool cannot pause generation: " + (
                "an engine has no pause_generation" if self.pausable else "started without pausable=True"))
        self._check()
        self.wait([(e, a.pause_generation.options(concurrency_group="control").remote())
                   for e, a in enumerate(self.actors)], "pause_generation()")

    def continue_generation(self) -> None:
        """In each actor's default group: after the calls sent before it (the weight update)."""
        self._all("continue_generation")

    def generate_continuations(self, requests, params: SamplingParams, return_routed_experts: bool = False,
                               images=None):
        return self.continue_async(requests, params, return_routed_experts, images).result()

    def continue_async(self, requests, params: SamplingParams, return_routed_experts: bool = False, images=None
                       ) -> PendingGeneration:
        """The continuations split into balanced contiguous chunks, one per engine (request k seeded
        ``params.seed + k`` on whichever engine runs it, as ``generate``); the samples in request order and the
        call's (start, end) wall-clock span. ``images`` (one ImageInputs or None per request) go with their
        requests' chunk."""
        import time

        import ray

        self._check()
        reqs = [([int(t) for t in p], int(b)) for p, b in requests]
        images = check_images([p for p, _ in reqs], images)
        t0 = time.time()
        refs = []
        for e, lo, hi, p in split_generation(len(reqs), params, 1, self.num_engines):
            chunk = None if images is None else check_images(reqs[lo:hi], images[lo:hi])
            refs.append((e, self.actors[e].continuations.remote(reqs[lo:hi], p, bool(return_routed_experts),
                                                                chunk)))

        def wait():
            out = [s for chunk in self.wait(refs, "generate_continuations()") for s in chunk]
            if len(out) != len(reqs):
                raise EnginePoolError(f"the engines returned {len(out)} continuations for {len(reqs)} requests")
            return out, t0, time.time()

        return PendingGeneration(wait, ready=lambda: not refs or not ray.wait(
            [r for _, r in refs], num_returns=len(refs), timeout=0)[1])

    def begin_weight_update(self) -> None:
        self._all("begin_weight_update")

    def end_weight_update(self) -> None:
        """Close every engine's session without the finishing flush (after a failed sync)."""
        self._all("abandon_sync")

    def finish_sync(self, names: Iterable[str], require_complete: bool = False) -> None:
        self._all("finish_sync", list(names), bool(require_complete))

    def load_weights_bucket(self, bucket: Sequence[tuple[str, Any]], flattened: bool = False) -> int:
        """One bucket into every engine (inside their open sessions); blocks until all loaded. Returns bytes."""
        import ray

        self._check()
        ref = ray.put(pack_bucket(bucket))
        return self.wait([(e, a.load_bucket.remote(ref, flattened)) for e, a in enumerate(self.actors)],
                         "update_weights")[0]

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], bucket_bytes: Optional[int] = None,
                       flattened: bool = False, require_complete: bool = False) -> dict:
        """One session per engine around the whole sync; each bucket is put in the object store once and loaded
        by every engine (at most max_inflight buckets in flight). Returns {"tensors", "bytes", "buckets"}.
        All or nothing: every engine checks every name, shape and dtype of the update (``check_weights``) before the
        sessions open and the first bucket moves (a lazy stream is collected first: references, no copies)."""
        import ray

        self._check()
        named_tensors = list(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        self._all("check_weights", [n for n, _ in named_tensors], [list(t.shape) for _, t in named_tensors],
                  [str(t.dtype).removeprefix("torch.") for _, t in named_tensors],
                  what="check_weights (every tensor of the update)")
        self.begin_weight_update()
        stats, names, pending = {"tensors": 0, "bytes": 0, "buckets": 0}, [], collections.deque()
        try:
            for bucket in iter_buckets(named_tensors, int(bucket_bytes or self.bucket_bytes)):
                ref = ray.put(pack_bucket(bucket))
                names.extend(n for n, _ in bucket)
                pending.append([(e, a.load_bucket.remote(ref, flattened)) for e, a in enumerate(self.actors)])
                stats["tensors"] += len(bucket)
                stats["buckets"] += 1
                del ref, bucket
                while len(pending) > self.max_inflight:
                    stats["bytes"] += self.wait(pending.popleft(), "update_weights")[0]
            while pending:
                stats["bytes"] += self.wait(pending.popleft(), "update_weights")[0]
        except BaseException:
            if self._failure is None:
                for refs in pending:  # let submitted loads finish before closing the sessions
                    ray.wait([r for _, r in refs], num_returns=len(refs), timeout=self.timeout_s)
                try:
                    self._all("abandon_sync")
                except Exception:
                    pass
            raise
        self.finish_sync(names, require_complete)
        return stats

    def sync_colocated(self, named_tensors, **kwargs) -> dict:
        """Colocated order: wake(["weights"]) -> update_weights -> wake(["kv_cache", "cuda_graph"])."""
        self.wake(["weights"])
        stats = self.update_weights(named_tensors, **kwargs)
        self.wake(["kv_cache", "cuda_graph"])
        return stats

    def sleep(self, tags: Optional[Sequence[str]] = None) -> None:
        self._all("sleep", list(tags) if tags else None)

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        self._all("wake", list(tags) if tags else None)

    def flush_cache(self) -> None:
        self._check()
        self.wait([self.submit(e, "flush_cache") for e in range(self.num_engines)], "flush_cache()")

    def device_keys(self) -> list[list[str]]:
        """Per engine, the ipc.device_key of each TP rank in TP-rank order (match them with the trainer ranks'
        ipc.device_key() to find who shares a GPU with whom). A single-node engine answers itself
        (SGLangEngine.device_keys); an engine spanning nodes is mapped from the per-bundle probe taken at start:
        TP rank r -> bundle r // tp_per_node, visible device base_gpu_id + (r % tp_per_node) * gpu_id_step."""
        self._check()
        if self.nnodes == 1:
            return self.wait([self.submit(e, "device_keys") for e in range(self.num_engines)], "device_keys()")
        return [tp_device_keys(self._bundle_devices[e], self.info[e]["tp_size"], self.info[e]["base_gpu_id"],
                               self.info[e]["gpu_id_step"], what=self.label(e)) for e in range(self.num_engines)]

    def call_all(self, method: str, *args, **kwargs) -> list:
        """engine.method(*args, **kwargs) on every engine, results in engine order."""
        self._check()
        return self.wait([self.submit(e, method, *args, **kwargs) for e in range(self.num_engines)], f"{method}()")

    # -- lifetime -------------------------------------------------------------------------------
    def close(self, timeout_s: float = 30.0) -> None:
        """Shut engines down (bounded), kill the actors, remove the placement groups. Idempotent."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        if self._failure is None and self.actors:
            try:
                ray.wait([a.shutdown.remote() for a in self.actors], num_returns=len(self.actors), timeout=timeout_s)
            except Exception:
                pass
        for a in self.actors + self.followers:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.actors, self.followers, self.placement_groups = [], [], []
        if self._failure is None:
            self._failure = EnginePoolError("the engine pool is closed")

    def shutdown(self) -> None:
        self.close()


def visible_devices() -> dict:
    """What a process placed in a bundle sees: {"host", "cuda": [ipc.device_key(i) per visible GPU]} (Ray task body)."""
    import torch

    from megatron_s3ac.rollout.engines.sglang import ipc

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"host": socket.gethostname(), "cuda": [ipc.device_key(i) for i in range(n)]}


def shared_devices(trainer_keys: Sequence[Optional[str]], engine_keys: Sequence[Sequence[str]]) -> list[str]:
    """Separate placement: the trainer ranks' ``ipc.device_key()`` (None: not on a GPU) against every engine TP
    rank's (``EnginePool.device_keys()``) -> one line per GPU both use ("rank 3 and engine 0 TP rank 1 on GPU-..");
    empty when they are disjoint. Two NCCL ranks on one device are refused ("Duplicate GPU detected") or run out of
    memory, so the sync refuses it first, naming who."""
    mine = {k: r for r, k in enumerate(trainer_keys) if k is not None}
    return [f"trainer rank {mine[k]} and engine {e} TP rank {t} on GPU {k}"
            for e, keys in enumerate(engine_keys) for t, k in enumerate(keys) if k in mine]


def tp_device_keys(bundles: Sequence[dict], tp_size: int, base_gpu_id: int = 0, gpu_id_step: int = 1,
                   what: str = "the engine") -> list[str]:
    """Device key of each TP rank of an engine spanning len(bundles) nodes (one bundle, one node_rank each): sglang
    puts TP rank r on node r // tp_per_node, visible GPU base_gpu_id + (r % tp_per_node) * gpu_id_step
    (entrypoints/engine.py:928-939, 2047-2077). A bundle without GPUs gives ipc.device_key's CPU form."""
    nnodes = len(bundles)
    if nnodes < 1 or tp_size % nnodes:
        raise EnginePoolError(f"{what}: tp_size={tp_size} is not a multiple of its {nnodes} nodes")
    per_node, keys = tp_size // nnodes, []
    for r in range(tp_size):
        b, i = bundles[r // per_node], int(base_gpu_id) + (r % per_node) * int(gpu_id_step)
        if not b["cuda"]:
            keys.append(f"{b['host']}:cpu{i}")  # ipc.device_key(i) on a host without CUDA
        elif i < len(b["cuda"]):
            keys.append(b["cuda"][i])
        else:
            raise EnginePoolError(f"{what}: TP rank {r} would run on visible GPU {i} of node rank {r // per_node} "
                                  f"({b['host']}), which shows only {len(b['cuda'])} GPUs")
    return keys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]

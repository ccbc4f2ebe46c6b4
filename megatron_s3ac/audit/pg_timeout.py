"""A short distributed timeout and a slow rank-0 engine: the harness of ``s3ac-train rehearse`` and of the tests
that rank-0-only phases (engine start, rollout generation, periodic evaluation) do not hold the other ranks inside a
collective.

On a GPU cluster NCCL's watchdog aborts a rank that waits in one collective longer than the process group's
timeout (10 min by default) while rank 0 alone starts engines or generates 16K-token responses. Gloo honours the
same timeout (a blocked collective raises after it), so CPU tests can show it in seconds:

* ``run_with_pg_timeout(fn, world_size, pg_timeout_s, *args)``: ``models.gloo_ranks.run_distributed`` with the default
  process group created with ``timeout=pg_timeout_s`` (the stand-in for NCCL's watchdog);
* ``SlowEngine`` / ``slow_rank0_engine(build, start_s, generate_s)``: the trainer's real engine
  (``trainer.step.build.build_engine`` patched in this process, so only the rank that builds one, rank 0, is slowed),
  started ``start_s`` late and sleeping ``generate_s`` before every ``generate`` (rollouts and evaluation alike);
  everything else is the engine's own. ``SlowEngine.events`` records (what, seconds) of each slowed call.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import time
import traceback

from megatron_s3ac.models.gloo_ranks import _context, collect_results, free_port


def _worker(rank, world_size, port, pg_timeout_s, fn, args, kwargs, out, threads):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    try:
        from megatron_s3ac.models import cpu_compat

        cpu_compat.enable()
        if pg_timeout_s is not None:  # None: ``fn`` creates the process group itself (env:// from the variables above)
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=pg_timeout_s))
        out.put((rank, True, pickle.dumps(fn(*args, **kwargs))))
    except BaseException:  # noqa: BLE001 - everything goes to the parent, assertion errors included
        out.put((rank, False, traceback.format_exc()))
    finally:
        try:
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_with_pg_timeout(fn, world_size: int, pg_timeout_s: float | None, *args, timeout: float = 300.0,
                        **kwargs) -> list:
    """``fn(*args, **kwargs)`` on ``world_size`` gloo ranks whose default process group times out after
    ``pg_timeout_s`` (None: ``fn`` initialises it); results by rank. A failing rank raises ``DistributedTestError``
    with its traceback; ``timeout``: the parent's limit per rank's result."""
    ctx = _context()
    out = ctx.Queue()
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, pg_timeout_s, fn, args, kwargs, out, threads))
             for r in range(world_size)]
    for p in procs:
        p.start()
    return collect_results(procs, out, world_size, timeout)


class SlowEngine:
    """An engine whose ``generate`` first sleeps ``generate_s`` (a long rollout or evaluation); the rest delegates."""

    def __init__(self, engine, generate_s: float, events: list):
        self.__dict__.update(_engine=engine, _generate_s=float(generate_s), events=events)

    def generate(self, *args, **kwargs):
        t0 = time.monotonic()
        time.sleep(self._generate_s)
        out = self._engine.generate(*args, **kwargs)
        self.events.append(("generate", time.monotonic() - t0))
        return out

    def generate_async(self, *args, **kwargs):
        """The engine's own submission; its ``result()`` first sleeps ``generate_s`` (once: a long generation the
        asynchronous loop waits for)."""
        from megatron_s3ac.rollout.base import PendingGeneration

        pending, slept = self._engine.generate_async(*args, **kwargs), []

        def wait():
            if not slept:
                t0 = time.monotonic()
                time.sleep(self._generate_s)
                out = pending.result()
                slept.append(True)
                self.events.append(("generate_async", time.monotonic() - t0))
                return (out, *pending.timing) if pending.timing is not None else out
            return (pending.result(), *pending.timing) if pending.timing is not None else pending.result()

        return PendingGeneration(wait, ready=pending.done)

    def generate_stream_async(self, *args, **kwargs):
        """The engine's own streaming submission; its first group is handed over ``generate_s`` late."""
        from megatron_s3ac.rollout.base import StreamingGeneration

        stream = self._engine.generate_stream_async(*args, **kwargs)

        def items():
            t0 = time.monotonic()
            time.sleep(self._generate_s)
            yield from stream.groups()
            self.events.append(("generate_async", time.monotonic() - t0))
            if stream.timing is not None:
                yield None, stream.timing

        return StreamingGeneration(stream.n_prompts, items(), ready=stream.done)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def __setattr__(self, name, value):
        setattr(self._engine, name, value)


@contextlib.contextmanager
def slow_rank0_engine(build, start_s: float, generate_s: float):
    """While inside, ``build.build_engine`` (``build``: the module ``megatron_s3ac.trainer.step.build``, passed in: this
    floor does not import the trainer; the trainer calls it on rank 0 only) takes ``start_s`` longer and returns a
    ``SlowEngine``; yields the list of (what, seconds) events of the slowed calls."""
    real = build.build_engine
    events: list = []

    def slow_build(cfg, info, **kwargs):
        t0 = time.monotonic()
        time.sleep(start_s)
        engine, owns_ray = real(cfg, info, **kwargs)
        events.append(("start", time.monotonic() - t0))
        return SlowEngine(engine, generate_s, events), owns_ray

    build.build_engine = slow_build
    try:
        yield events
    finally:
        build.build_engine = real

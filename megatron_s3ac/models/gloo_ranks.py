"""Run a function on N gloo CPU ranks, so multi-rank tests are ordinary pytest tests
(and ``s3ac-convert verify`` / ``s3ac-train rehearse`` run on CPU ranks).

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes from a forkserver that has
already imported torch and megatron-core (the main start-up cost, ~3-5 s per process, is paid once
per test session), gives each its own free port, runs ``fn(*args)`` on every rank with
torch.distributed initialised (gloo) and the CPU shim active, and returns the per-rank results.
A failure on any rank raises ``DistributedTestError`` with that rank's traceback.
``fn`` must be importable by name (a module-level function).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback

_PRELOAD = ["torch", "megatron.core", "megatron.core.models.gpt", "megatron_s3ac.models.actor_critic"]
_CTX = None


class DistributedTestError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(backend: str, port: int) -> None:
    """A one-rank process group (gloo on CPU, nccl on GPU) with the CPU shim enabled, for the
    single-process device checks; MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE already set are kept."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    from megatron_s3ac.models import cpu_compat

    cpu_compat.enable()
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=0, world_size=1)


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def _worker(rank, world_size, port, fn, args, kwargs, queue, threads):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    try:
        from megatron_s3ac.models import cpu_compat

        cpu_compat.enable()
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(*args, **kwargs)
        # plain pickle: tensors travel as bytes, not as shared-memory fds that die with this process
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return results ordered by rank."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, kwargs, queue, threads), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    return collect_results(procs, queue, world_size, timeout)


def collect_results(procs: list, queue, world_size: int, timeout: float) -> list:
    """The started rank processes' ``(rank, ok, payload)`` answers from ``queue``, ordered by rank; the first failing
    rank's traceback raises ``DistributedTestError`` (the others, maybe stuck in a collective, are killed). A rank
    whose process died without answering (killed, ``os._exit``, a crash in native code) fails at once, naming its
    exit code, instead of after ``timeout``."""
    import queue as _q
    import time

    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except _q.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in results and r not in errors]
                if dead:  # an answer sent before the exit is in the pipe: read it first
                    try:
                        rank, ok, payload = queue.get(timeout=2.0)
                    except _q.Empty:
                        r, code = dead[0]
                        errors[r] = f"rank {r}'s process exited with code {code} without answering"
                        break
                elif time.monotonic() >= deadline:
                    raise DistributedTestError(f"timed out after {timeout}s waiting for "
                                               f"{world_size - len(results) - len(errors)} rank(s)")
                else:
                    continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
            if errors:  # one rank failed: the others may be stuck in a collective
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank = min(errors)
        raise DistributedTestError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]

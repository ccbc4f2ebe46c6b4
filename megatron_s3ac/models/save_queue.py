"""megatron-core's torch_dist writer reports its write results through a queue served by a ``multiprocessing``
Manager, started with the spawn method at a process's first save (megatron-core 0.19.2
dist_checkpointing/strategies/filesystem_async.py:52-66, ``get_write_results_queue(mp_mode='spawn')``; called from
``FileSystemWriterAsync.prepare_write_data``, :200, by synchronous saves too): one server process, plus its
resource tracker, per saving process. Nothing ties that server to its parent. A normal exit shuts it down (the
Manager's finalizer); a trainer killed by SIGKILL (the OOM killer, a preempted node, torchrun ending a failed
job, the kill-and-resume tests) leaves both alive under init, asleep, one more pair per killed rank and restart.

``install()`` swaps megatron's function for one that starts the same Manager (spawn, one per process, on first
use) whose server exits once its parent is gone: a daemon thread in the server polls ``os.getppid()`` every
``POLL_S`` (a SIGKILLed parent runs no finaliser, and PR_SET_PDEATHSIG would fire when the *thread* that spawned
the server ends). Its resource tracker then exits by itself: the last process holding its pipe is gone.
"""
from __future__ import annotations

import os
import threading
import time

POLL_S = 0.5
_STATE: dict = {"queue": None, "manager": None}


def _exit_with_parent(parent: int) -> None:
    """Manager initializer (runs in the server process)."""

    def watch():
        while os.getppid() == parent:
            time.sleep(POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="s3ac-exit-with-parent", daemon=True).start()


def write_results_queue(mp_mode: str = "spawn"):
    """megatron's ``get_write_results_queue``, its Manager's server bound to this process's life. Always spawn,
    megatron's default (``mp_mode`` is accepted for megatron's signature; no megatron caller passes another)."""
    if _STATE["queue"] is None:
        import multiprocessing as mp
        from multiprocessing.managers import SyncManager

        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=_exit_with_parent, initargs=(os.getpid(),))
        # the Manager object is kept: its finaliser (util.Finalize on the object) shuts the server down once it is
        # garbage-collected, and the queue proxy alone does not keep it alive
        _STATE["manager"], _STATE["queue"] = manager, manager.Queue()
    return _STATE["queue"]


def install() -> None:
    """Route megatron's torch_dist writer to ``write_results_queue`` (idempotent; a queue megatron already made in
    this process is kept)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if fa._results_queue is not None:
        return
    fa.get_write_results_queue = write_results_queue

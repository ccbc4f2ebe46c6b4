"""Rank-0-only phases: how the other ranks wait for them.

Rank 0 alone starts the engines (up to ``engine_pool``'s 900 s), generates and scores each rollout, and runs the
periodic evaluation; meanwhile the other ranks have nothing to do. Waiting inside an NCCL collective of the
default group would let NCCL's watchdog abort them after the process group's timeout (10 min by default), whatever
rank 0 is doing. So they wait here instead: rank 0's result of the phase is broadcast on a gloo group of all ranks
made for this purpose, whose timeout is the run's deadline ``train.dist_timeout_s`` (gloo holds no GPU and has no
watchdog: a wait is a blocked socket read). A rank that waits past the deadline, or whose rank 0 died, raises
``Rank0WaitError`` naming the phase and the key. On one rank it is a no-op.
"""
from __future__ import annotations

import datetime
import time

import torch.distributed as dist


class Rank0WaitError(RuntimeError):
    """A rank stopped waiting for rank 0's phase: the deadline passed, or rank 0 is gone."""


class Rank0Phases:
    """The other ranks' wait for rank 0. Built collectively (``new_group``: every rank, the same point in the
    group-creation order); ``share`` is collective too."""

    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = None
        if self.world > 1:
            dist.barrier()  # gloo connects a new group's ranks within the group's own timeout: arrive together
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))

    def share(self, phase: str, obj=None):
        """Rank 0's ``obj`` (picklable; ignored elsewhere) on every rank, once rank 0 has finished ``phase``."""
        if self.group is None:
            return obj
        box = [obj if self.rank == 0 else None]
        t0 = time.monotonic()
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except RuntimeError as e:
            waited = time.monotonic() - t0
            who = "rank 0 finished" if self.rank == 0 else f"rank {self.rank} waited for rank 0's {phase}"
            raise Rank0WaitError(
                f"{who}, but the hand-over failed after {waited:.0f} s (deadline train.dist_timeout_s="
                f"{self.timeout_s:g} s: raise it if {phase} legitimately takes longer; otherwise a rank died): "
                f"{e}") from e
        return box[0]

"""Fault injection for the crash-safety tests: the trainer's only fault seam (production code, inert unless
set). Both hooks are read from the environment (the tests run the trainer under torchrun) and do nothing when unset.

  S3AC_TESTING_FAIL_AT_STEP=N           os._exit(9) after step N is logged and saved (like kill -9)
  S3AC_TESTING_SAVE_PAUSE=SECONDS[@N]   mid-save (after the actor's shards, at step N): touch
                                        <tmp>/PAUSED_rank<r>, sleep, remove it (a window to SIGKILL)
  S3AC_TESTING_FAIL_IN_STAGE=STAGE      os._exit(9) inside pipeline stage STAGE, after part of its output
                                        is written and before its DONE.json (trainer.stages.pipeline); for rl: after
                                        RL step 1 is logged and saved
  S3AC_TESTING_DECODE_DELAY=SECONDS     the CPU engine sleeps this long after each decode step (generation
                                        slower than training, so a weight sync finds requests in flight: the
                                        partial-rollout tests)
"""
from __future__ import annotations

import os
import time

FAIL_AT_STEP = "S3AC_TESTING_FAIL_AT_STEP"
SAVE_PAUSE = "S3AC_TESTING_SAVE_PAUSE"
FAIL_IN_STAGE = "S3AC_TESTING_FAIL_IN_STAGE"
DECODE_DELAY = "S3AC_TESTING_DECODE_DELAY"


def decode_delay() -> float:
    """Seconds the CPU engine waits after each decode step (0 unless S3AC_TESTING_DECODE_DELAY is set)."""
    return float(os.environ.get(DECODE_DELAY) or 0.0)


def after_step(step: int) -> None:
    at = os.environ.get(FAIL_AT_STEP)
    if at is not None and int(at) == step:
        os._exit(9)  # an abrupt death (no cleanup), like kill -9
    if step == 1:
        in_stage("rl")


def in_stage(stage: str) -> None:
    if os.environ.get(FAIL_IN_STAGE) == stage:
        os._exit(9)


def mid_save(tmp: str, step: int, rank: int) -> None:
    spec = os.environ.get(SAVE_PAUSE)
    if not spec:
        return
    secs, _, at = spec.partition("@")
    if at and int(at) != step:
        return
    marker = os.path.join(tmp, f"PAUSED_rank{rank}")
    open(marker, "w").close()
    time.sleep(float(secs))
    os.remove(marker)

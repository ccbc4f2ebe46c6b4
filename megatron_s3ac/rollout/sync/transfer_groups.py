"""Weight-transfer process groups whose peer is an engine process (vLLM's ``s3ac_nccl``, SGLang's per-stage
broadcast): built so that the engine's death does not take the trainer down, aborted when it died. Engine-neutral:
every engine kind's transfer imports it from here."""
from __future__ import annotations

import contextlib
import os
import threading

import torch.distributed as dist

# torch's ProcessGroupNCCL reads TORCH_NCCL_ASYNC_ERROR_HANDLING once, in its constructor (default 3, SkipCleanUp:
# its watchdog takes the whole process down when a work of the group fails or times out). A weight-transfer group's
# peer is an engine process, which may die mid-broadcast (the asynchronous loop then restarts it and re-syncs): such
# a group is built with 2 (CleanUpOnly: the watchdog aborts the group's communicators, the work raises, the process
# lives), the trainer's own groups keep the launcher's setting. Issue 41, fourth review, finding 2.
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
TRANSFER_ERROR_HANDLING = "2"  # CleanUpOnly
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def transfer_group_error_handling():
    """While inside: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (CleanUpOnly) for the ProcessGroupNCCL constructed here;
    the previous value (or its absence) is restored on exit. Serialised: weight-transfer groups are built in helper
    threads too."""
    with _ENV_LOCK:
        old = os.environ.get(NCCL_ERROR_HANDLING)
        os.environ[NCCL_ERROR_HANDLING] = TRANSFER_ERROR_HANDLING
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(NCCL_ERROR_HANDLING, None)
            else:
                os.environ[NCCL_ERROR_HANDLING] = old


def abort_group(pg) -> bool:
    """Abort an NCCL weight-transfer group whose peer died (its pending broadcast never completes: ``destroy`` would
    wait for it, ``ProcessGroupNCCL::shutdown`` finalizes first). Returns False where the group is not NCCL or this
    torch has no ``_abort_process_group``; the caller then destroys it as before."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        nccl = pg is not None and "nccl" in str(dist.get_backend(pg)).lower()
    except Exception:  # noqa: BLE001 - a group torch.distributed does not know (a bare ProcessGroupNCCL)
        nccl = False
    if abort is None or not nccl:
        return False
    abort(pg)
    return True

"""Fourth GPU-path review, finding 2: an engine dying mid weight-transfer took the trainer process down on GPUs.

The separate-placement weight syncs broadcast over NCCL groups whose other members are engine processes (vLLM's
``s3ac_nccl``: ``rollout/engines/vllm/transfer.join_group``; SGLang's per-stage groups:
``rollout/engines/sglang/broadcast.init_custom_process_group``). torch's ProcessGroupNCCL reads
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` once, in its constructor, default 3 (SkipCleanUp: ``SHOULD_TEAR_DOWN``, the
watchdog rethrows the work's error on its thread and the process terminates). So when an engine died during a
broadcast (NCCL's ``ncclRemoteError``), or did not answer within the group's timeout (a refused bucket:
``VLLMEngine._abandon_group`` keeps the group with its broadcast pending; a dead SGLang pool: ``_serve`` skips the
work's ``wait``), the trainer rank was torn down by that group's watchdog: the asynchronous loop's "a death during the
weight sync is recovered" (gloo on CPU) could not happen on NCCL, and a dead pool's ``close`` (``destroy`` =
``ProcessGroupNCCL::shutdown``: finalize, wait for the pending work) waited for a broadcast that never completes.

Fixed: both constructors run under ``transfer.transfer_group_error_handling()`` (2, CleanUpOnly, for that group only:
the watchdog aborts the group's communicators, the work raises, the process lives; the trainer's own groups keep the
launcher's setting), and a dead peer's NCCL group is aborted (``_abort_process_group`` / ``ProcessGroupNCCL.abort``)
instead of destroyed. CPU torch has no ProcessGroupNCCL: the constructors are recorded, the environment each saw
is what is checked.
"""
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

KEY = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@pytest.fixture
def no_setting(monkeypatch):
    monkeypatch.delenv(KEY, raising=False)


def test_vllm_nccl_transfer_group_is_built_clean_up_only(monkeypatch, no_setting):
    from megatron_s3ac.models.gloo_ranks import free_port
    from megatron_s3ac.rollout.engines.vllm import transfer

    seen = []

    class FakeNCCL:
        class Options:
            pass

        def __init__(self, store, rank, world, opts):
            seen.append(os.environ.get(KEY))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    g = transfer.join_group("127.0.0.1", free_port(), 0, 1, 10.0, backend="nccl")
    assert seen == ["2"], (f"the s3ac_nccl group was built with {KEY}={seen[0]!r} (unset: torch's default 3, "
                           f"SkipCleanUp: an engine's death mid-broadcast takes the trainer down)")
    assert KEY not in os.environ  # the trainer's own groups keep the launcher's setting
    assert g.device == torch.device("cuda", 0)


def test_a_set_value_is_restored(monkeypatch):
    from megatron_s3ac.rollout.engines.vllm import transfer

    monkeypatch.setenv(KEY, "1")
    with transfer.transfer_group_error_handling():
        assert os.environ[KEY] == "2"
    assert os.environ[KEY] == "1"


def test_sglang_stage_group_is_built_clean_up_only(monkeypatch, no_setting):
    import torch.distributed.distributed_c10d as c10d

    from megatron_s3ac.models.gloo_ranks import free_port
    from megatron_s3ac.rollout.engines.sglang import broadcast

    seen = []

    def helper(world_size, rank, ranks, backend, store, **kw):
        seen.append((str(backend), os.environ.get(KEY)))
        return object(), None

    monkeypatch.setattr(c10d, "_new_process_group_helper", helper)
    pg = broadcast.init_custom_process_group("nccl", f"tcp://127.0.0.1:{free_port()}", 1, 0, "s3ac-test-pp0")
    c10d._world.pg_group_ranks.pop(pg, None)
    assert seen == [("nccl", "2")], seen
    assert KEY not in os.environ


def test_a_dead_pools_nccl_group_is_aborted_not_destroyed(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    from megatron_s3ac.rollout.engines.sglang.broadcast import StageBroadcastSync

    calls = []
    group = object()
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)  # a stage leader, not the controller
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "nccl")
    monkeypatch.setattr(dist, "destroy_process_group", lambda g=None: calls.append("destroy"))
    monkeypatch.setattr(c10d, "_abort_process_group", lambda g=None: calls.append("abort"), raising=False)
    sync = StageBroadcastSync.__new__(StageBroadcastSync)
    sync.pool = SimpleNamespace(_failure=RuntimeError("engine 0 died"))
    sync.roles, sync.group, sync.timeout_s = {"controller": 0, "leaders": {0: 0, 1: 1}, "tp_sizes": [1]}, group, 1.0
    sync.group_name = "s3ac-weights"
    sync.close()
    assert calls == ["abort"], (f"{calls}: the group whose engines died was destroyed (ProcessGroupNCCL::shutdown "
                                f"flushes its pending broadcast first, which never completes)")
    # a live pool's group (gloo or NCCL) is destroyed as before
    calls.clear()
    sync.pool, sync.group = SimpleNamespace(_failure=None), group
    sync.roles = {"controller": 0, "leaders": {0: 0, 1: 1}, "tp_sizes": [1]}
    sync.close()
    assert calls == ["destroy"]


def test_vllm_abandoned_nccl_group_is_aborted(monkeypatch):
    from megatron_s3ac.rollout.engines.vllm.engine import VLLMEngine
    from megatron_s3ac.rollout.engines.vllm.transfer import TransferGroup

    aborted = []
    eng = VLLMEngine.__new__(VLLMEngine)
    eng._group = TransferGroup(SimpleNamespace(abort=lambda: aborted.append(True)), None, torch.device("cuda", 0))
    eng._stale_groups = []
    eng._abandon_group()
    assert aborted == [True] and eng._group is None and len(eng._stale_groups) == 1
    gloo = TransferGroup(SimpleNamespace(abort=lambda: aborted.append("gloo")), None, torch.device("cpu"))
    eng._group = gloo
    eng._abandon_group()
    assert aborted == [True]  # gloo: kept as before, nothing aborted

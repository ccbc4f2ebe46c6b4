"""Fifth GPU-path review, finding 2: after a vLLM engine restart the stage sync reused the dead engine's groups.

``VLLMStageSync`` (vllm, separate) joins one weight-transfer group per pipeline stage at its first sync
(``_connect``: the stage leader hosts a store on a free port, the engine's workers join it as group ``pp<stage>``,
worker_ext.py ``init_transfer_engine``) and kept ``roles`` / ``group`` for the rest of the run; its ``close`` did
nothing ("the gloo groups go with the engine"). Since the vLLM engine's death is an ``EngineDied``
(``VLLMEngineDied``, engines/vllm/engine.py:60), the asynchronous loop restarts it: ``_restart`` calls
``close_weight_sync`` on every rank, builds a new engine, ``attach``es it and re-syncs. That sync skipped
``_connect`` (roles kept), so the new engine's workers were never told to join ``pp0`` (worker_ext.py
``receive_weights``: "weight transfer group 'pp0' not initialised") while the leader broadcast into the old
group, whose peers died with the old server: the re-sync failed (gloo) or waited out the group's timeout (NCCL),
and the restart that ``rollout.max_engine_restarts`` promises never worked for vLLM.

Fixed: ``VLLMStageSync.close`` aborts its NCCL group (kept, not destroyed), forgets the group and the roles; the
next sync connects again on every rank with a fresh port and the engine's workers join it.

The same path's failure inside a sync: the controller (rank 0, its own stage's leader) raised out of the export
loop at the first failed bucket, as soon as the engine refused or died, waiting first for the broadcast into the
dead workers (gloo: the group's whole timeout). The export is collective over the stage (its TP / EP / DP ranks
send their pieces to the leader bucket by bucket) and the other stages' leaders wait for the controller's go /
stop per bucket: they were left inside those, so the asynchronous loop's restart (``_sync_surviving``: "the sync
runs to its end on every rank") never came. Fixed as ``rollout.sync.weight_sync.sync_weights`` does it: a failure
stops the transfers, not the export; the controller answers the other stages "stop", drains them, abandons its
out-of-step group and raises the engine's error once the protocol is through; the broadcast is polled beside the
workers' receive (``VLLMEngine.send_bucket``'s way), so a dead engine is seen at once.

Shown with a real gloo weight-transfer group (``transfer.join_group``) in one process: the trainer's side is the
real ``VLLMStageSync`` over a world-1 default group; the engine is a stand-in whose "workers" join the groups it is
told to open and receive each bucket from them, refusing an unknown group as worker_ext does.
"""
import threading
from types import SimpleNamespace

import pytest
import torch


class _Engine:
    """A vLLM engine stand-in (the ``VLLMEngine`` calls ``VLLMStageSync`` makes) whose one worker is a thread."""

    device = "cpu"

    def __init__(self, name, die_at=None):
        self.name, self.groups, self.received, self._threads, self.die_at = name, {}, [], [], die_at

    def open_sender_group(self, group, host, port):
        from megatron_s3ac.rollout.engines.vllm.transfer import join_group

        def join():
            self.groups[group] = join_group(host, port, 1, 2, SETTINGS.timeout_s, "gloo")

        t = threading.Thread(target=join, daemon=True)
        t.start()
        self._threads.append(t)

    def check_weights(self, names, shapes, call, session=False):
        pass

    def begin_weight_update(self):
        for t in self._threads:
            t.join(10)

    def receive_bucket(self, meta, group):
        from megatron_s3ac.rollout.engines.vllm.transfer import flat_nbytes

        if group not in self.groups:  # worker_ext.py receive_weights
            raise RuntimeError(f"{self.name}: s3ac_gloo weight transfer group {group!r} not initialised (groups: "
                               f"{sorted(self.groups)}): call init_weight_transfer_engine first")
        if meta["names"][0] == self.die_at:  # the server process is gone: its receive fails at once
            from megatron_s3ac.rollout.engines.vllm.engine import VLLMEngineDied

            raise VLLMEngineDied(f"{self.name}: update_weights: the vLLM server is not running (exit -9)")
        flat = torch.empty(flat_nbytes(meta), dtype=torch.uint8)
        self.groups[group].broadcast(flat, 0).wait()
        self.received.append(meta["names"])

    def finish_weight_update(self, weight_version=None):
        pass

    def _abort_quietly(self):
        pass


SETTINGS = SimpleNamespace(tp_size=1, num_engines=1, timeout_s=4.0, bucket_bytes=1 << 20, weight_transfer="auto")


@pytest.fixture
def world1(tmp_path, monkeypatch):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import megatron_s3ac.convert.export as export
    import megatron_s3ac.rollout.engines.vllm.sync as vsync

    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    monkeypatch.setattr(ps, "get_tensor_and_data_parallel_group", lambda **kw: dist.group.WORLD)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vsync, "planned_weights", lambda info: ([], []))
    buckets = [[("model.embed_tokens.weight", torch.arange(12, dtype=torch.float32).view(3, 4))]]
    exported = []

    def export_hf_weights(chunks, info, bucket_bytes, group=None):  # the stage's collective export, recorded
        for b in buckets:
            yield b
            exported.append(b[0][0])
        exported.append("end")

    monkeypatch.setattr(export, "export_hf_weights", export_hf_weights)
    try:
        yield buckets, exported
    finally:
        dist.destroy_process_group()


def test_a_restarted_engine_gets_fresh_stage_groups(world1):
    from megatron_s3ac.rollout.engines.vllm.sync import VLLMStageSync

    old, new = _Engine("engine A"), _Engine("engine B")
    sync = VLLMStageSync(old, settings=SETTINGS)
    sync.sync([None], info=None)
    assert old.received == [["model.embed_tokens.weight"]]
    # the engine died; the asynchronous loop's _restart: close_weight_sync on every rank, a new engine, attach
    sync.close()
    sync.attach(new)
    try:
        sync.sync([None], info=None)
    except Exception as err:  # noqa: BLE001
        pytest.fail(f"the re-sync of the restarted engine failed: {type(err).__name__}: {err}")
    assert new.received == [["model.embed_tokens.weight"]], (
        f"the restarted engine's workers got {new.received}: the sync broadcast into the dead engine's group")
    assert set(new.groups) == {"pp0"}


def test_an_engine_dying_mid_sync_lets_the_export_finish_and_raises_its_death(world1):
    """The engine dies at the second of three buckets: the export still runs to its end on the controller (the
    stage's other ranks would otherwise wait in its collectives), the error raised is the engine's death (what
    ``_sync_surviving`` restarts), and after ``close`` the rebuilt engine is synced whole."""
    from megatron_s3ac.rollout.engines.pool import EngineDied
    from megatron_s3ac.rollout.engines.vllm.sync import VLLMStageSync

    buckets, exported = world1
    buckets[:] = [[(f"model.layers.{i}.mlp.down_proj.weight", torch.full((2, 2), float(i)))] for i in range(3)]
    dying, rebuilt = _Engine("engine A", die_at="model.layers.1.mlp.down_proj.weight"), _Engine("engine B")
    sync = VLLMStageSync(dying, settings=SETTINGS)
    with pytest.raises(Exception) as info:
        sync.sync([None], info=None)
    assert isinstance(info.value, EngineDied), (
        f"the sync raised {type(info.value).__name__}: {info.value}, not the engine's death (the asynchronous loop "
        f"restarts an EngineDied)")
    assert exported == [b[0][0] for b in buckets] + ["end"], (
        f"the export stopped after {exported}: the stage's other ranks would be left inside its collectives")
    assert dying.received == [["model.layers.0.mlp.down_proj.weight"]]
    sync.close()
    sync.attach(rebuilt)
    del exported[:]
    sync.sync([None], info=None)
    assert rebuilt.received == [[b[0][0]] for b in buckets]


def _two_stages(die_at):
    """One rank per pipeline stage (world 2, gloo): rank 0 drives the engine and leads stage 0, rank 1 leads stage
    1; each stage exports 3 buckets. Returns (what this rank raised, its exported names, after close + a rebuilt
    engine: what that engine received)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import megatron_s3ac.convert.export as export
    import megatron_s3ac.rollout.engines.vllm.sync as vsync
    from megatron_s3ac.rollout.engines.vllm.sync import VLLMStageSync

    me = dist.get_rank()
    stages = [dist.new_group([0]), dist.new_group([1])]  # each stage's export group: its one rank
    ps.get_tensor_and_data_parallel_group = lambda **kw: stages[me]
    ps.get_pipeline_model_parallel_rank = lambda: me
    vsync.planned_weights = lambda info: ([], [])
    exported = []

    def export_hf_weights(chunks, info, bucket_bytes, group=None):
        for i in range(3):
            name = f"model.layers.{3 * me + i}.mlp.down_proj.weight"
            yield [(name, torch.full((2, 2), float(i)))]
            exported.append(name)
        exported.append("end")

    export.export_hf_weights = export_hf_weights
    engine = _Engine("engine A", die_at=die_at) if me == 0 else None
    sync = VLLMStageSync(engine, settings=SETTINGS)
    raised = None
    try:
        sync.sync([None], info=None)
    except Exception as err:  # noqa: BLE001 - reported to the test
        raised = f"{type(err).__name__}: {err}"
    first = list(exported)
    sync.close()  # the asynchronous loop's _restart, every rank
    rebuilt = _Engine("engine B") if me == 0 else None
    sync.attach(rebuilt)
    sync.sync([None], info=None)
    return raised, first, None if rebuilt is None else sorted(n for names in rebuilt.received for n in names)


def test_a_death_at_another_stages_bucket_is_raised_by_the_controller_alone():
    """Pipeline stage 1's leader broadcasts its second bucket into workers that died: before, it waited out the
    group's timeout and raised that (a rank other than 0: ``_sync_surviving`` re-raises it, the run ends); now the
    controller tells it the workers did not take the bucket, it stops, the controller raises the engine's death,
    and both stages are synced whole to the rebuilt engine."""
    from megatron_s3ac.models.gloo_ranks import DistributedTestError, run_distributed

    try:
        (r0, _, got), (r1, exp1, _) = run_distributed(_two_stages, 2, "model.layers.4.mlp.down_proj.weight",
                                                       timeout=120)
    except DistributedTestError as e:
        pytest.fail(f"a rank did not get through the failed sync and the re-sync:\n{e}")
    assert r0 is not None and r0.startswith("VLLMEngineDied"), r0
    assert r1 is None, f"stage 1's leader raised {r1} (not rank 0: the asynchronous loop re-raises it, no restart)"
    assert exp1[-1] == "end", exp1  # its export ran to its end
    assert got == sorted(f"model.layers.{i}.mlp.down_proj.weight" for i in range(6)), got

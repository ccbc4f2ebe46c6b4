"""The colocated hand-over (rollout/engines/sglang/ipc.py payloads -> SGLangEngine.load_serialized_bucket) against the 0.5.23
stand-in, which deserializes each TP rank's payload like sglang does (caller-side normalization, SafeUnpickler,
payloads[tp_rank], reconstruct). References: the tensors the producer process built, sent back by value."""
import base64
import dataclasses
import multiprocessing as mp
import os
import socket

import pytest
import torch
from safetensors.torch import load_file

from megatron_s3ac.rollout.engines.sglang import ipc
from megatron_s3ac.rollout.engines.pool import EnginePoolError, tp_device_keys
from megatron_s3ac.rollout.engines.sglang.engine import SGLangConfig, SGLangEngine, WeightUpdateError, flatten_bucket

from fake_sglang import FakeSGLangEngine, SchedulerDied, save_tiny_qwen3_moe


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("ipc_ckpt"), seed=0)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Path of a second weight set of the same architecture (checkpoint names)."""
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("ipc_other"), seed=1) + "/model.safetensors"


def make(ckpt, tp_size=1, **kw):
    engine = SGLangEngine(SGLangConfig(model_path=ckpt, tp_size=tp_size, **kw), engine_cls=FakeSGLangEngine,
                          name="sglang engine 0", flush_retry_delay_s=0.001)
    return engine, engine.engine


def layer_bucket(path, n=4):
    """The first n layer tensors of the weight file at path: [(name, tensor)]."""
    sd = load_file(path)
    return [(k, sd[k]) for k in sorted(sd) if k.startswith("model.layers.0.")][:n]


@dataclasses.dataclass
class LocalMeta:  # a project class in the metadata: what sglang's SafeUnpickler refuses
    name: str
    shape: tuple
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _produce(conn, path, n, tp):
    """Another process: build a flat bucket in its own memory, hand over one serialization per TP rank (handles,
    not bytes of tensors), send the values by value as the reference, and stay alive until told to exit."""
    import torch

    torch.set_num_threads(1)
    bucket = [(k, t * 3 + 1) for k, t in layer_bucket(path, n)]  # values no file holds
    payload = flatten_bucket(bucket)
    conn.send(([ipc.serialize(payload) for _ in range(tp)], [k for k, _ in bucket],
               [list(t.shape) for _, t in bucket], [str(t.dtype).split(".")[1] for _, t in bucket],
               {k: t.numpy().copy() for k, t in bucket}))
    conn.recv()  # the payload (its shared-memory segment) stays alive until the engine has loaded it


def test_bucket_from_another_process_loads_exactly_per_tp_rank(ckpt, other):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_produce, args=(child, other, 4, 2), daemon=True)
    proc.start()
    try:
        assert parent.poll(120), "the producer process did not answer"
        payloads, names, shapes, dtypes, values = parent.recv()
        engine, fake = make(ckpt, tp_size=2)
        assert len(payloads) == 2 and all(isinstance(p, bytes) for p in payloads)
        engine.begin_weight_update()
        nbytes = engine.load_serialized_bucket(payloads, names, shapes, dtypes)
        engine.end_weight_update()
        assert nbytes == sum(v.nbytes for v in values.values()) == engine.last_sync["bytes"]
        assert engine.last_sync["tensors"] == 4 and engine.last_sync["buckets"] == 1
        for name, v in values.items():
            torch.testing.assert_close(fake.debug_checkpoint_tensor(name), torch.from_numpy(v), rtol=0, atol=0)
        (entry,) = fake.debug_payload_log
        assert entry["producers"] == [proc.pid, proc.pid] and entry["matches_rank0"] == [True, True]
        assert entry["names"] == names and entry["bucket"] == 0
    finally:
        parent.send(None)
        _reap(proc)


def _reap(proc, timeout_s=30.0):
    """Wait for the producer to exit by polling (join() would wait on its sentinel pipe, whose write end the
    torch_shm_manager daemon it started inherits and keeps open while segments are mapped)."""
    import time

    deadline = time.monotonic() + timeout_s
    while proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.is_alive():
        proc.kill()


def test_in_process_flattened_path_serializes_once_per_tp_rank(ckpt, other):
    engine, fake = make(ckpt, tp_size=2)
    sent = []
    real = fake.update_weights_from_tensor

    def spy(**kw):
        sent.append(kw["named_tensors"])
        return real(**kw)

    fake.update_weights_from_tensor = spy
    weights = load_file(other)
    engine.update_weights(weights.items(), bucket_bytes=64 * 1024, flattened=True, require_complete=True)
    assert len(sent) == engine.last_sync["buckets"] > 1
    for payloads in sent:  # one serialization per TP rank, never one object for all
        assert len(payloads) == 2 and all(isinstance(p, bytes) for p in payloads) and payloads[0] is not payloads[1]
    log = fake.debug_payload_log
    assert [e["bucket"] for e in log] == list(range(len(sent)))
    assert all(e["matches_rank0"] == [True, True] and e["producers"] == [os.getpid()] * 2 for e in log)
    for name, t in weights.items():
        torch.testing.assert_close(fake.debug_checkpoint_tensor(name), t, rtol=0, atol=0)


def test_inconsistent_tp_payloads_are_recorded(ckpt, other):
    """Real TP ranks narrow their shard from their own payload: rank 1 given other values loads them silently."""
    engine, fake = make(ckpt, tp_size=2)
    bucket = layer_bucket(other)
    names, shapes = [k for k, _ in bucket], [list(t.shape) for _, t in bucket]
    p0 = ipc.serialize(flatten_bucket(bucket))
    p1 = ipc.serialize(flatten_bucket([(k, t + 1) for k, t in bucket]))
    engine.begin_weight_update()
    engine.load_serialized_bucket([p0, p1], names, shapes)
    engine.end_weight_update()
    assert [e["matches_rank0"] for e in fake.debug_payload_log] == [[True, False]]
    torch.testing.assert_close(fake.debug_checkpoint_tensor(names[0]), bucket[0][1], rtol=0, atol=0)


def test_base64_str_payload_is_accepted(ckpt, other):
    engine, fake = make(ckpt)
    bucket = layer_bucket(other, 2)
    fake.begin_weight_update()
    text = base64.b64encode(ipc.serialize(flatten_bucket(bucket))).decode()
    assert fake.update_weights_from_tensor(named_tensors=[text], load_format="flattened_bucket",
                                           flush_cache=False) == (True, "Success")
    torch.testing.assert_close(fake.debug_checkpoint_tensor(bucket[1][0]), bucket[1][1], rtol=0, atol=0)


def test_non_allowlisted_metadata_kills_the_engine(ckpt, other):
    bucket = layer_bucket(other, 2)
    good = flatten_bucket(bucket)
    bad = {"flattened_tensor": good["flattened_tensor"],
           "metadata": [LocalMeta(**vars(m)) for m in good["metadata"]]}
    names, shapes = [k for k, _ in bucket], [list(t.shape) for _, t in bucket]
    # through the wrapper: an error naming the engine and sglang's reason
    engine, fake = make(ckpt)
    engine.begin_weight_update()
    with pytest.raises(WeightUpdateError, match=r"sglang engine 0: update_weights_from_tensor raised for bucket 0 .*"
                                                r"Blocked unsafe global \(.*LocalMeta\) during pickle deserialization"):
        engine.load_serialized_bucket([ipc.serialize(bad)], names, shapes)
    assert fake.dead and "Blocked unsafe global" in fake.dead
    with pytest.raises(SchedulerDied):  # the scheduler died: the engine serves nothing any more
        fake.flush_cache()
    # raw, on a fresh stand-in: the SimpleNamespace form of the same bucket passes, the dataclass form does not
    _, fake = make(ckpt)
    fake.begin_weight_update()
    assert fake.update_weights_from_tensor(named_tensors=[ipc.serialize(good)], load_format="flattened_bucket")[0]
    with pytest.raises(SchedulerDied, match=r"Blocked unsafe global \(.*LocalMeta\)"):
        fake.update_weights_from_tensor(named_tensors=[ipc.serialize(bad)], load_format="flattened_bucket")


def test_non_bytes_payload_is_a_type_error_and_the_engine_lives(ckpt, other):
    bucket = layer_bucket(other, 2)
    payload = flatten_bucket(bucket)  # the dict itself, not serialized
    _, fake = make(ckpt)
    fake.begin_weight_update()
    with pytest.raises(TypeError, match="serialized_named_tensors entries must be base64 strings or bytes-like "
                                        "payloads, got dict"):
        fake.update_weights_from_tensor(named_tensors=[payload], load_format="flattened_bucket")
    assert fake.dead is None and fake.flush_cache().success
    engine, fake = make(ckpt)
    engine.begin_weight_update()
    fake.calls.clear()
    with pytest.raises(TypeError, match="sglang engine 0: payload 0 of bucket 0 .* is a dict"):
        engine.load_serialized_bucket([payload], [k for k, _ in bucket], [list(t.shape) for _, t in bucket])
    assert "update_weights_from_tensor" not in fake.calls


def test_too_few_payloads(ckpt, other):
    bucket = layer_bucket(other, 2)
    names, shapes = [k for k, _ in bucket], [list(t.shape) for _, t in bucket]
    one = [ipc.serialize(flatten_bucket(bucket))]
    engine, fake = make(ckpt, tp_size=2)
    engine.begin_weight_update()
    fake.calls.clear()
    with pytest.raises(WeightUpdateError, match="sglang engine 0: 1 serialized payloads for bucket 0 .*tp_size=2"):
        engine.load_serialized_bucket(one, names, shapes)
    assert "update_weights_from_tensor" not in fake.calls and fake.dead is None
    # raw: TP rank 1 indexes payloads[1] in its scheduler (tp_worker.py:194-201) and dies
    with pytest.raises(SchedulerDied, match="TP rank 1.*IndexError"):
        fake.update_weights_from_tensor(named_tensors=one, load_format="flattened_bucket")
    assert fake.dead


def test_names_and_shapes_checked_before_the_engine_is_called(ckpt, other):
    bucket = layer_bucket(other, 2)
    payloads = [ipc.serialize(flatten_bucket(bucket))]
    engine, fake = make(ckpt)
    with pytest.raises(WeightUpdateError, match="outside a weight-update session"):
        engine.load_serialized_bucket(payloads, [k for k, _ in bucket], [list(t.shape) for _, t in bucket])
    engine.begin_weight_update()
    fake.calls.clear()
    vl = [k.replace("model.", "model.language_model.", 1) for k, _ in bucket]
    with pytest.raises(WeightUpdateError, match="model.language_model.*not in the served checkpoint"):
        engine.load_serialized_bucket(payloads, vl, [list(t.shape) for _, t in bucket])
    with pytest.raises(WeightUpdateError, match="has shape"):
        engine.load_serialized_bucket(payloads, [k for k, _ in bucket], [[1, 2]] + [list(bucket[1][1].shape)])
    assert "update_weights_from_tensor" not in fake.calls and fake.debug_payload_log == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the device keys")
def test_device_keys(ckpt):
    engine, _ = make(ckpt, tp_size=2, base_gpu_id=3)
    host = socket.gethostname()
    assert engine.device_keys() == [ipc.device_key(3), ipc.device_key(4)] == [f"{host}:cpu3", f"{host}:cpu4"]
    # an engine over two nodes: each node's SGLangEngine knows its own ranks only
    cfg = SGLangConfig(model_path=ckpt, tp_size=4, nnodes=2, node_rank=1, base_gpu_id=1)
    engine.config = cfg
    assert engine.device_keys() == [ipc.device_key(1), ipc.device_key(2)]
    # the pool maps bundle probes: TP rank r -> bundle r // tp_per_node, visible base + (r % tp_per_node) * step
    gpus = [{"host": h, "cuda": [f"GPU-{h}{i}" for i in range(3)]} for h in ("a", "b")]
    assert tp_device_keys(gpus, 4, base_gpu_id=1) == ["GPU-a1", "GPU-a2", "GPU-b1", "GPU-b2"]
    assert tp_device_keys(gpus, 2, base_gpu_id=0, gpu_id_step=2) == ["GPU-a0", "GPU-b0"]
    assert tp_device_keys([{"host": "a", "cuda": []}, {"host": "b", "cuda": []}], 4) == ["a:cpu0", "a:cpu1",
                                                                                        "b:cpu0", "b:cpu1"]
    with pytest.raises(EnginePoolError, match="TP rank 1 would run on visible GPU 3 .* shows only 3 GPUs"):
        tp_device_keys(gpus, 4, base_gpu_id=2)
    with pytest.raises(EnginePoolError, match="tp_size=3 is not a multiple of its 2 nodes"):
        tp_device_keys(gpus, 3)


@pytest.mark.slow  # > 60 s under load; the fast suite's 20-minute budget (CI)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the device keys")
def test_process_pool_device_keys_and_hand_over(ckpt, other):
    """Two engines (tp_size 2) in their own processes, on device slots 0-1 and 2-3; this process produces the
    payloads (one per TP rank), each engine maps the segments of this process and loads them."""
    from process_engine_pool import ProcessEnginePool

    host = socket.gethostname()
    pool = ProcessEnginePool(ckpt, 2, tp_size=2)
    try:
        assert pool.device_keys() == [[f"{host}:cpu0", f"{host}:cpu1"], [f"{host}:cpu2", f"{host}:cpu3"]]
        bucket = [(k, t * 3 + 1) for k, t in layer_bucket(other)]
        names, shapes = [k for k, _ in bucket], [list(t.shape) for _, t in bucket]
        payload = flatten_bucket(bucket)  # kept alive (referenced) until both engines answered
        pool.begin_weight_update()
        got = pool.wait([pool.submit(e, "load_serialized_bucket", [ipc.serialize(payload) for _ in range(2)], names,
                                     shapes, nbytes=payload["flattened_tensor"].numel()) for e in range(2)], "load")
        pool.finish_sync(names)
        assert got == [payload["flattened_tensor"].numel()] * 2
        for e in range(2):
            (entry,) = pool.wait([pool.submit(e, "engine.debug_payload_log.copy")], "log")[0]
            assert entry["producers"] == [os.getpid()] * 2 and entry["matches_rank0"] == [True, True]
            served = pool.wait([pool.submit(e, "engine.debug_checkpoint_state_dict")], "read back")[0]
            for name, t in bucket:
                torch.testing.assert_close(served[name], t, rtol=0, atol=0)
    finally:
        pool.close()


class _NodeEngine:
    """What EnginePool needs of one node's engine for device_keys(): its SGLangConfig (an engine spanning nodes
    builds one per node; sglang's followers block, so only node 0's answers and the pool maps bundle probes)."""

    def __init__(self, slot):
        self.config = SGLangConfig(model_path="unused", tp_size=2, base_gpu_id=0, nnodes=slot.nnodes,
                                   node_rank=slot.node_rank, dist_init_addr=slot.dist_init_addr)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU Ray cluster with declared GPUs")
def test_engine_pool_device_keys_of_an_engine_spanning_two_nodes():
    """A two-node Ray cluster on this host (1 declared GPU each): one engine of 2 GPUs spans both nodes (STRICT_SPREAD
    bundles); device_keys() comes from probes taken in each bundle before the actors start."""
    import sys

    import ray
    from ray.cluster_utils import Cluster

    from megatron_s3ac.rollout.engines.pool import EnginePool

    if ray.is_initialized():
        pytest.skip("needs its own Ray cluster")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 1})
    pool = None
    try:
        cluster.add_node(num_cpus=1, num_gpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        pool = EnginePool(_NodeEngine, 1, gpus_per_engine=2, gpus_per_node=1, cpus_per_engine=0.5,
                          timeout_s=60, start_timeout_s=120)
        host = socket.gethostname()
        assert pool.nnodes == 2 and pool.device_keys() == [[f"{host}:cpu0", f"{host}:cpu0"]]
        addr = pool.wait([pool.submit(0, "config.server_args")], "addr")[0]["dist_init_addr"]
        assert addr and addr.rsplit(":", 1)[1].isdigit()  # node 0's address, from the (now valid) address probe
    finally:
        if pool is not None:
            pool.close()
        ray.shutdown()
        cluster.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in on CPU")
def test_engine_pool_hand_over_through_submit(ckpt, other):
    """EnginePool (a Ray actor, the stand-in with tp_size 2): device_keys() asks the engine; a bucket this process
    serialized per TP rank reaches it through submit(e, "load_serialized_bucket", ...) inside its session."""
    import ray

    import fake_sglang
    import rollout_fixtures
    from megatron_s3ac.rollout.engines.pool import EnginePool
    from megatron_s3ac.rollout.factory import SGLangSettings, make_engine_factory

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    for m in (fake_sglang, rollout_fixtures):
        ray.cloudpickle.register_pickle_by_value(m)
    pool = None
    try:
        factory = make_engine_factory("sglang", model_dir=ckpt, settings=SGLangSettings(tp_size=2, gpus_per_engine=2),
                                      engine_cls=FakeSGLangEngine, torch_threads=1)
        pool = EnginePool(factory, 1, cpus_per_engine=0.5, timeout_s=120, start_timeout_s=300)
        host = socket.gethostname()
        assert pool.device_keys() == [[f"{host}:cpu0", f"{host}:cpu1"]]
        bucket = [(k, t * 3 + 1) for k, t in layer_bucket(other)]
        names, shapes = [k for k, _ in bucket], [list(t.shape) for _, t in bucket]
        payload = flatten_bucket(bucket)
        pool.begin_weight_update()
        n = pool.wait([pool.submit(0, "load_serialized_bucket", [ipc.serialize(payload) for _ in range(2)], names,
                                   shapes, [str(t.dtype).split(".")[1] for _, t in bucket])], "load")[0]
        pool.finish_sync(names)
        assert n == payload["flattened_tensor"].numel()
        (entry,) = pool.wait([pool.submit(0, "engine.debug_payload_log.copy")], "log")[0]
        assert entry["producers"] == [os.getpid()] * 2 and entry["matches_rank0"] == [True, True]
        served = pool.wait([pool.submit(0, "engine.debug_checkpoint_state_dict")], "read back")[0]
        for name, t in bucket:
            torch.testing.assert_close(served[name], t, rtol=0, atol=0)
    finally:
        if pool is not None:
            pool.close()
        for m in (fake_sglang, rollout_fixtures):
            ray.cloudpickle.unregister_pickle_by_value(m)
        if started:
            ray.shutdown()

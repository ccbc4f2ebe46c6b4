"""The weight-transfer wire shared by the s3ac_gloo / s3ac_nccl / s3ac_ipc backends (rollout.engines.vllm.transfer),
in the trainer's environment (no vLLM): a gloo sender group broadcast received and unpacked bit-exact, NCCL refused on a
CPU-only torch naming the cause, a bucket shared through torch.multiprocessing.reductions (file_system shared
memory) rebuilt from its JSON fields in another process, hostile handle fields refused, the backend chosen per
placement / device, and the seeds of a batch split over engines."""
import json
import subprocess
import sys
import threading

import pytest
import torch

from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.vllm.transfer import (bucket_meta, join_group, open_shared, pack, share_flat, unpack,
                                                 flat_nbytes)


def _bucket():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(3, 5, generator=g)), ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
            ("c.idx", torch.arange(3, dtype=torch.int64)), ("d.half", torch.randn(2, 1, 3, generator=g).half())]


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pack_unpack_is_exact_and_aligned():
    b = _bucket()
    meta = bucket_meta(b)
    flat = pack(b)
    assert flat.dtype == torch.uint8 and flat.numel() == flat_nbytes(meta) and flat.numel() % 8 == 0
    for (n, t), (m, u) in zip(b, unpack(flat, meta)):
        assert n == m and u.dtype == t.dtype and torch.equal(u, t)


def test_gloo_group_broadcast_between_sender_and_receiver():
    """The s3ac_gloo protocol: rank 0 (sender) hosts the store, rank 1 (a worker) receives a flat bucket of the
    size its meta says and unpacks the sender's tensors."""
    b = _bucket()
    meta = json.loads(json.dumps(bucket_meta(b)))  # travels as JSON
    port, got = _free_port(), {}

    def worker():
        g = join_group("127.0.0.1", port, 1, 2, 60)
        flat = torch.empty(flat_nbytes(meta), dtype=torch.uint8, device=g.device)
        g.broadcast(flat, 0).wait()
        got["tensors"] = unpack(flat, meta)

    t = threading.Thread(target=worker)
    t.start()
    sender = join_group("127.0.0.1", port, 0, 2, 60)
    assert sender.device.type == "cpu"
    sender.broadcast(pack(b, sender.device), 0).wait()
    t.join(60)
    assert [n for n, _ in got["tensors"]] == [n for n, _ in b]
    assert all(torch.equal(u, v) for (_, u), (_, v) in zip(got["tensors"], b))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only torch: the NCCL half runs in the device check")
def test_nccl_group_needs_cuda():
    with pytest.raises(RuntimeError, match="s3ac_nccl.*needs CUDA"):
        join_group("127.0.0.1", _free_port(), 0, 2, 5, backend="nccl")
    with pytest.raises(ValueError, match="'mpi' is not one of"):
        join_group("127.0.0.1", _free_port(), 0, 2, 5, backend="mpi")


RECEIVER = """
import json, sys, torch
from megatron_s3ac.rollout.engines.vllm.transfer import open_shared, unpack
handle, meta = json.loads(sys.stdin.read())
flat = open_shared(handle)
print(json.dumps([[n, t.float().flatten().tolist()] for n, t in unpack(flat, meta)]))
"""


def test_ipc_handle_is_json_and_maps_in_another_process():
    """s3ac_ipc on CPU: the bucket's storage shared in file_system shared memory; the other process rebuilds it
    from the handle's JSON fields (no pickle) and reads the sender's values."""
    b = _bucket()
    flat = pack(b)
    handle = share_flat(flat)
    text = json.dumps([handle, bucket_meta(b)])  # JSON-safe: bytes as base64, classes / dtypes by name
    assert handle["kind"] == "cpu" and "pickle" not in text
    r = subprocess.run([sys.executable, "-c", RECEIVER], input=text, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert [n for n, _ in got] == [n for n, _ in b]
    for (_, vals), (_, t) in zip(got, b):
        assert torch.equal(torch.tensor(vals), t.float().flatten())
    del flat


def test_ipc_handle_refuses_fields_it_does_not_write():
    flat = pack(_bucket())
    h = share_flat(flat)
    bad = json.loads(json.dumps(h))
    bad["args"]["seq"][0] = {"cls": "os.system"}
    with pytest.raises(ValueError, match="os.system"):
        open_shared(bad)
    bad["args"]["seq"][0] = {"pickle": "gASV"}
    with pytest.raises(ValueError, match="not one this wire writes"):
        open_shared(bad)
    with pytest.raises(ValueError, match="kind 'x'"):
        open_shared({**h, "kind": "x"})
    with pytest.raises(ValueError, match="flat uint8"):
        share_flat(torch.zeros(3))


@pytest.mark.parametrize("setting,placement,gpu,want", [
    ("auto", "colocated", False, "ipc"), ("auto", "colocated", True, "ipc"), ("auto", "separate", False, "gloo"),
    ("auto", "separate", True, "nccl"), ("gloo", "colocated", True, "gloo"), ("nccl", "separate", True, "nccl")])
def test_transfer_backend_per_placement_and_device(setting, placement, gpu, want):
    from megatron_s3ac.rollout.engines.vllm.settings import transfer_backend

    assert transfer_backend(setting, placement, gpu) == want


def test_transfer_backend_refusals_name_the_key():
    from megatron_s3ac.rollout.errors import ConfigError
    from megatron_s3ac.rollout.engines.vllm.settings import VLLMSettings, transfer_backend, validate_vllm_settings

    with pytest.raises(ConfigError, match="rollout.vllm.weight_transfer: nccl needs GPUs"):
        transfer_backend("nccl", "separate", False)
    with pytest.raises(ConfigError, match="rollout.vllm.weight_transfer: ipc .* colocated"):
        transfer_backend("ipc", "separate", True)
    with pytest.raises(ConfigError, match="rollout.vllm.weight_transfer: 'rdma' is not one of"):
        validate_vllm_settings(VLLMSettings(weight_transfer="rdma"))
    with pytest.raises(ConfigError, match="rollout.vllm.weight_transfer: ipc"):
        validate_vllm_settings(VLLMSettings(weight_transfer="ipc"), placement="separate")


def test_split_generation_gives_request_k_seed_plus_k():
    """EnginePool and VLLMEnginePool split a batch the same way: contiguous balanced chunks, and request k of the
    whole batch (prompt-major, n samples per prompt) carries seed + k whichever engine runs it."""
    from megatron_s3ac.rollout.engines.pool import split_generation

    n, k = 7, 3
    chunks = split_generation(n, SamplingParams(seed=100), k, 3)
    assert [(e, lo, hi) for e, lo, hi, _ in chunks] == [(0, 0, 2), (1, 2, 4), (2, 4, 7)]
    seeds = [p.seed + j for _, lo, hi, p in chunks for j in range((hi - lo) * k)]
    assert seeds == list(range(100, 100 + n * k))
    assert [e for e, *_ in split_generation(1, SamplingParams(seed=None), 2, 3)] == [2]  # empty chunks dropped
    assert split_generation(4, SamplingParams(seed=None), 2, 2)[1][3].seed is None

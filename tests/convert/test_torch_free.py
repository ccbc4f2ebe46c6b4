"""hf-to-mcore without torch: the hand-built torch.save blobs are torch.save's own bytes, the path
imports neither torch nor numpy nor megatron, the safetensors header check agrees with the library,
and the torch.save fallback (zip64-sized chunks) still produces loadable, bit-exact checkpoints."""
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_s3ac.convert import dcp_io
from megatron_s3ac.convert.dcp_io import (DistcpCheckpoint, no_crc32, tensor_pickle, torch_save_bytes,
                                          torch_save_parts)
from megatron_s3ac.convert.plan import ConversionError
from megatron_s3ac.convert.safetensors_io import SafetensorsFile

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.bool, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
SHAPES = [(), (1,), (3,), (3, 5), (1, 1, 24, 16), (2, 3, 4), (1, 2, 3, 4, 5), (70000, 3), (1, 70000), (300, 301)]


def torch_save(obj, path=None) -> bytes:
    with no_crc32():
        if path is not None:
            torch.save(obj, path)
            return open(path, "rb").read()
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()


def ours(t: torch.Tensor) -> bytes:
    head, tail = torch_save_parts(tensor_pickle(tuple(t.shape), t.dtype), t.nbytes)
    return head + t.reshape(-1).view(torch.uint8).numpy().tobytes() + tail


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_blob_is_torch_save_bytes(dtype):
    g = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        t = (torch.randn(shape, generator=g) * 50).to(dtype)
        blob = ours(t)
        assert blob == torch_save(t), (shape, dtype)
        back = torch.load(io.BytesIO(blob), weights_only=True)
        assert back.dtype == t.dtype and back.shape == t.shape and back.stride() == t.stride()
        assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), (shape, dtype)


def test_object_blobs_are_torch_save_bytes(tmp_path):
    for obj in ([None], {}, [1, "a", (2.5, b"x")], {"k": [True, None]}):
        assert torch_save_bytes(obj) == torch_save(obj), obj
        assert torch.load(io.BytesIO(torch_save_bytes(obj)), weights_only=True) == obj
    # a file's archive folder is its name's stem (megatron's common.pt)
    assert torch_save_bytes({}, archive="common") == torch_save({}, str(tmp_path / "common.pt"))


def test_empty_and_huge_storages_are_left_to_torch():
    assert torch_save_parts(tensor_pickle((0, 4), torch.float32), 0) is None
    assert torch_save_parts(tensor_pickle((1 << 31, 2), torch.bfloat16), 1 << 33) is None


def test_checkpoint_blobs_equal_torch_save_of_their_tensors(mcore_dirs):
    """Every chunk of a converted checkpoint is byte for byte what torch.save writes for its tensor."""
    for name in ("qwen2_untied", "qwen3_moe"):
        ck = DistcpCheckpoint(mcore_dirs[name])
        n = 0
        for (key, off), (path, start, length) in ck.storage.items():
            with open(os.path.join(ck.dir, path), "rb") as f:
                f.seek(start)
                blob = f.read(length)
            if off is None:
                assert blob == torch_save([None]), key
                continue
            t = torch.load(io.BytesIO(blob), weights_only=True)
            assert blob == torch_save(t), key
            n += 1
        assert n > 20
        ck.close()


def test_common_pt_is_torch_save_of_empty_dict(mcore_dirs, tmp_path):
    got = open(os.path.join(mcore_dirs["qwen3"], "common.pt"), "rb").read()
    assert got == torch_save({}, str(tmp_path / "common.pt"))


_NO_TORCH = textwrap.dedent("""
    import runpy, sys
    src, dst = sys.argv[1], sys.argv[2]
    if sys.argv[3] == "hf-to-mcore":
        sys.argv = ["s3ac-convert", "hf-to-mcore", "--hf", src, "--out", dst, "--workers", "2", "--no-progress"]
    else:
        sys.argv = ["s3ac-convert", "mcore-to-hf", "--mcore", src, "--out", dst, "--no-progress"]
    try:
        runpy.run_module("checkpoints_convert", run_name="__main__")
    except SystemExit as e:
        assert not e.code, e.code
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "megatron", "safetensors",
                                                                   "transformers"))
    print("HEAVY", heavy)
""")


def round_trip_without_torch(hf: str, tmp_path) -> tuple[str, str]:
    """hf-to-mcore then mcore-to-hf of ``hf`` through the CLI, each in a fresh process that must not import torch /
    numpy / megatron / safetensors / transformers. Returns (mcore dir, HF dir written back)."""
    m, back = str(tmp_path / "m"), str(tmp_path / "hf")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    for src, dst, cmd in ((hf, m, "hf-to-mcore"), (m, back, "mcore-to-hf")):
        r = subprocess.run([sys.executable, "-c", _NO_TORCH, src, dst, cmd], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        assert "HEAVY []" in r.stdout, (cmd, r.stdout)
        assert "GB/s" in r.stdout
    return m, back


def assert_tiny_buffer_is_default(hf: str, tmp_path, monkeypatch) -> None:
    """hf-to-mcore of ``hf`` through a 97-byte buffer (no kernel copies) is byte for byte the default conversion."""
    from megatron_s3ac.convert import hf_to_mcore

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    hf_to_mcore(hf, a, workers=1, progress=False)
    monkeypatch.setattr(dcp_io, "COPY_BUFFER", 97)
    monkeypatch.setattr(dcp_io, "SPLICE_MIN_BYTES", 1 << 62)
    hf_to_mcore(hf, b, workers=1, progress=False)
    files = sorted(f for f in os.listdir(a) if f.endswith(".distcp") or f in (".metadata", "common.pt"))
    assert files == sorted(f for f in os.listdir(b) if f.endswith(".distcp") or f in (".metadata", "common.pt"))
    for f in files:
        if f != ".metadata":  # holds the directory name
            assert open(os.path.join(a, f), "rb").read() == open(os.path.join(b, f), "rb").read(), f


def test_cli_both_directions_import_no_torch(hf_dirs, tmp_path):
    """Both CLI commands on our own checkpoints, start to finish, without torch / numpy / megatron /
    safetensors / transformers (start-up ~0.1 s instead of ~1.5 s); the round trip stays bit-exact."""
    from safetensors.torch import load_file

    m, back = round_trip_without_torch(hf_dirs["qwen3_moe"], tmp_path)
    assert os.path.exists(os.path.join(m, ".metadata"))
    files = lambda d: {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")  # noqa: E731
                       for k, v in load_file(os.path.join(d, f)).items()}
    a, b = files(hf_dirs["qwen3_moe"]), files(back)
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a)


def test_layers_are_stacked_matches_megatron_config(hf_dirs):
    from megatron_s3ac.convert.qwen import layers_are_stacked, layers_are_stacked_by_config
    from megatron_s3ac.models.registry import model_info, supported_model_types
    from megatron_s3ac.models.tiny_qwen3_5 import tiny_qwen3_5_config

    infos = [model_info(d) for d in hf_dirs.values()]
    infos.append(model_info(tiny_qwen3_5_config("vl").to_dict()))
    infos.append(model_info(tiny_qwen3_5_config("text").to_dict()))
    cfg = json.load(open(os.path.join(hf_dirs["qwen3_moe"], "config.json")))
    cfg["mlp_only_layers"] = [0, 2]  # a mix of dense and MoE layers
    infos.append(model_info(cfg))
    assert {i.model_type for i in infos} >= set(supported_model_types()) - {"qwen3_5_moe_text"}
    for info in infos:
        assert layers_are_stacked(info) == layers_are_stacked_by_config(info), info.model_type


# --------------------------------------------------------------------------------- safetensors headers
def _st_file(path, header: dict | bytes, data: bytes, length: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)
    return str(path)


def _library_accepts(path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            list(f.keys())
        return True
    except Exception:  # noqa: BLE001
        return False


def _ours_accepts(path) -> bool:
    try:
        SafetensorsFile(path).close()
        return True
    except ConversionError as e:
        assert "corrupted safetensors header" in str(e) and str(path) in str(e)
        return False


def _cases():
    a = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    b = {"dtype": "BF16", "shape": [4], "data_offsets": [16, 24]}
    d24 = bytes(range(24))
    ok = {"a": a, "b": b}
    yield "valid", ok, d24, None, True
    yield "valid_reversed_order", {"b": b, "a": a}, d24, None, True
    yield "valid_metadata", {"__metadata__": {"format": "pt"}, **ok}, d24, None, True
    empty = {"dtype": "F32", "shape": [0, 3], "data_offsets": [24, 24]}
    yield "valid_empty_tensor", {**ok, "c": empty}, d24, None, True
    yield "valid_padded_header", json.dumps(ok).encode() + b"    ", d24, None, True
    yield "valid_no_tensors", {}, b"", None, True
    yield "garbage", b"#garbage####" + json.dumps(ok).encode()[12:], d24, None, False
    yield "leading_space", b" " + json.dumps(ok).encode(), d24, None, True
    yield "not_object", b"[1, 2]", b"", None, False
    yield "not_utf8", b"{\"\xff\": 1}", b"", None, False
    yield "length_too_big", ok, d24, 10_000, False
    yield "hole", {"a": a, "b": {**b, "data_offsets": [18, 26]}}, d24 + b"xx", None, False
    yield "overlap", {"a": a, "b": {**b, "data_offsets": [8, 16]}}, d24[:16], None, False
    yield "wrong_size", {"a": a, "b": {**b, "shape": [3]}}, d24, None, False
    yield "trailing_bytes", ok, d24 + b"extra", None, False
    yield "truncated_data", ok, d24[:20], None, False
    yield "not_from_zero", {"a": {**a, "data_offsets": [8, 24]}}, d24, None, False
    yield "unknown_dtype", {"a": {**a, "dtype": "Q7"}}, d24[:16], None, False
    yield "float_shape", {"a": {**a, "shape": [2.0, 2]}}, d24[:16], None, False
    yield "negative_offset", {"a": {**a, "data_offsets": [-1, 15]}}, d24[:16], None, False
    yield "three_offsets", {"a": {**a, "data_offsets": [0, 16, 16]}}, d24[:16], None, False
    yield "missing_shape", {"a": {"dtype": "F32", "data_offsets": [0, 16]}}, d24[:16], None, False
    yield "metadata_not_strings", {"__metadata__": {"n": 1}, **ok}, d24, None, False
    yield "entry_not_object", {"a": [1, 2]}, b"", None, False


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_header_check_agrees_with_safetensors_library(tmp_path, case):
    name, header, data, length, valid = case
    path = _st_file(tmp_path / f"{name}.safetensors", header, data, length)
    assert _library_accepts(path) == valid, name
    assert _ours_accepts(path) == valid, name


def test_short_file(tmp_path):
    p = tmp_path / "short.safetensors"
    p.write_bytes(b"\x01\x02")
    assert not _library_accepts(str(p)) and not _ours_accepts(str(p))


# ------------------------------------------------------------------------------------ torch fallback
def test_torch_save_fallback_round_trip(hf_dirs, tmp_path, monkeypatch):
    """Chunks too large for a zip32 archive go through torch.save (with the data write spliced):
    force that path for every chunk; the checkpoint is the same bytes, reads back and round-trips."""
    from megatron_s3ac.convert import hf_to_mcore, mcore_to_hf
    from tests.convert.test_roundtrip import assert_same_tensors, read_hf

    hf = hf_dirs["qwen3_moe"]
    normal = str(tmp_path / "normal")
    hf_to_mcore(hf, normal, workers=1, progress=False)
    monkeypatch.setattr(dcp_io, "_ZIP32_LIMIT", 64)  # the fallback splices chunks >= 4 KiB, reads smaller ones
    for splice_min in (0, 1 << 62):
        monkeypatch.setattr(dcp_io, "SPLICE_MIN_BYTES", splice_min)
        m, h = str(tmp_path / f"m{splice_min}"), str(tmp_path / f"h{splice_min}")
        hf_to_mcore(hf, m, workers=2, progress=False)
        mcore_to_hf(m, h, progress=False)
        assert_same_tensors(read_hf(hf), read_hf(h))
        a, b = DistcpCheckpoint(normal), DistcpCheckpoint(m)
        for key in a.md.state_dict_metadata:
            if a.has(key):
                for c in a.md.state_dict_metadata[key].chunks:
                    off, shape = tuple(c.offsets), tuple(c.sizes)
                    assert torch.equal(a.read_region(key, off, shape), b.read_region(key, off, shape)), key
        a.close()
        b.close()


def test_write_tensor_and_empty_chunks(tmp_path, monkeypatch):
    """``ItemFile.write_tensor`` (hand-built blob, or torch.save for empty / forced-zip64 tensors)
    reads back equal, and an empty spliced chunk is written by torch."""
    from megatron_s3ac.convert.dcp_io import DistcpWriter

    g = torch.Generator().manual_seed(1)
    tensors = {"a": torch.randn(5, 7, generator=g).to(torch.bfloat16), "b": torch.zeros(0, 3),
               "c": torch.arange(6, dtype=torch.int64).reshape(2, 3)[:, 1]}  # a view: saved as its own storage
    for limit in (dcp_io._ZIP32_LIMIT, 64):
        monkeypatch.setattr(dcp_io, "_ZIP32_LIMIT", limit)
        d = tmp_path / f"ck{limit}"
        d.mkdir()
        w = DistcpWriter(str(d))
        f = w.open_file()
        for k, t in tensors.items():
            f.write_tensor(k, tuple(t.shape), (0,) * t.dim(), t)
        f.write_spliced("e", (2, 0), (0, 0), (2, 0), "float32", [])
        f.close()
        w.finish()
        ck = DistcpCheckpoint(str(d))
        for k, t in tensors.items():
            got = ck.read_region(k, (0,) * t.dim(), tuple(t.shape))
            assert got.dtype == t.dtype and torch.equal(got, t), k
        assert ck.read_region("e", (0, 0), (2, 0)).shape == (2, 0)
        ck.close()


def test_metadata_streamed_to_file_equals_in_memory(mcore_dirs, tmp_path):
    from megatron_s3ac.convert.dcp_meta import dump_metadata

    tensors = {"a": ((4, 2), "bfloat16", [((0, 0), (2, 2)), ((2, 0), (2, 2))])}
    storage = {("a", (0, 0)): ("__0_0.distcp", 0, 100), ("a", (2, 0)): ("__0_1.distcp", 5, 1 << 40),
               ("o/shard_0_1", None): ("__0_0.distcp", 100, 7)}
    with open(tmp_path / "md", "wb") as f:
        assert dump_metadata(tensors, ["o/shard_0_1"], storage, "/x", out=f) is None
    assert (tmp_path / "md").read_bytes() == dump_metadata(tensors, ["o/shard_0_1"], storage, "/x")
    # and DCP's own reader reads what the converter wrote
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    md = FileSystemReader(mcore_dirs["qwen3_moe"]).read_metadata()
    ours = DistcpCheckpoint(mcore_dirs["qwen3_moe"])
    assert set(md.state_dict_metadata) == set(ours.md.state_dict_metadata)
    assert {(k.fqn, None if k.offset is None else tuple(k.offset)): (v.relative_path, v.offset, v.length)
            for k, v in md.storage_data.items()} == ours.storage
    ours.close()


def test_tiny_copy_buffer_splits_everything(hf_dirs, tmp_path, monkeypatch):
    """Everything through a 97-byte buffer (no kernel copies) cuts zip records, tensor bytes and QKV
    pieces at odd places: the checkpoint is still byte for byte the default one."""
    assert_tiny_buffer_is_default(hf_dirs["qwen3_moe"], tmp_path, monkeypatch)


def test_kernel_copied_chunks_keep_the_source_page_phase(hf_dirs, tmp_path, monkeypatch):
    """Blobs copied by the kernel start after a hole that puts their data at the source's offset
    modulo PHASE_BYTES; the blobs themselves are unchanged and the checkpoint reads back equal."""
    from megatron_s3ac.convert import hf_to_mcore, mcore_to_hf
    from megatron_s3ac.convert.hf_to_mcore import chunk_segments, key_dtypes
    from megatron_s3ac.convert.plan import build_plan
    from megatron_s3ac.convert.safetensors_io import HFCheckpoint
    from megatron_s3ac.models.registry import model_info
    from tests.convert.test_roundtrip import assert_same_tensors, read_hf

    hf = hf_dirs["qwen3_moe"]
    monkeypatch.setattr(dcp_io, "SPLICE_MIN_BYTES", 0)
    monkeypatch.setattr(dcp_io, "PHASE_BYTES", 256)
    m, h = str(tmp_path / "m"), str(tmp_path / "h")
    hf_to_mcore(hf, m, workers=2, progress=False)
    plan, src = build_plan(model_info(hf)), HFCheckpoint(hf)
    dtypes = key_dtypes(plan, src)
    ck = DistcpCheckpoint(m, contiguous_chunks=True)
    gaps = 0
    for ch in plan.chunks:
        segs = [s for s in chunk_segments(ch, src, dtypes[ch.key]) if s[0] is not None]
        if not segs:
            continue
        _, data_at, _ = ck.byte_range(ch.key, ch.offset, ch.shape)
        assert (data_at - segs[0][1]) % 256 == 0, ch.key
        path, start, length = ck.storage[(ch.key, tuple(ch.offset))]
        with open(os.path.join(m, path), "rb") as f:
            f.seek(start)
            blob = f.read(length)
        assert blob == torch_save(torch.load(io.BytesIO(blob), weights_only=True)), ch.key
    ends: dict[str, int] = {}
    for path, start, length in sorted(ck.storage.values()):
        gaps += start > ends.get(path, 0)
        assert start >= ends.get(path, 0)  # no overlaps
        ends[path] = start + length
    assert gaps > 10
    ck.close()
    src.close()
    mcore_to_hf(m, h, progress=False)
    assert_same_tensors(read_hf(hf), read_hf(h))

"""HF safetensors checkpoints: a validated, row-range reader and a streaming shard writer.

Reading hands out byte ranges (fd, offset, length) at the offsets of the safetensors header, which
the converter copies file-to-file in the kernel; nothing is mmapped (pages of an mmap stay in the
process' RSS while the file is open: a 5 GB shard would count 5 GB). Each header is validated by the
rules of the ``safetensors`` library's own parser (``Metadata::validate``: a UTF-8 JSON object, known
dtypes, offsets that tile the data section exactly, in order, without holes), so a corrupted header is
rejected with the file named before anything is converted; tests check that both parsers agree.
Nothing here imports torch (``safe_open`` does: it is not used on this path).

Writing precomputes the header of a shard from the (name, shape, dtype) list, then appends tensor
bytes in order, so a shard never exists in memory as a whole.
"""
from __future__ import annotations

import json
import math
import os
import struct

from megatron_s3ac.convert.dcp_meta import DType
from megatron_s3ac.convert.plan import ConversionError

# safetensors dtype -> torch dtype name
ST_DTYPES = {
    "F64": DType("float64"), "F32": DType("float32"), "F16": DType("float16"), "BF16": DType("bfloat16"),
    "I64": DType("int64"), "I32": DType("int32"), "I16": DType("int16"), "I8": DType("int8"), "U8": DType("uint8"),
    "BOOL": DType("bool"), "F8_E4M3": DType("float8_e4m3fn"), "F8_E5M2": DType("float8_e5m2"),
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}  # torch dtype name -> safetensors dtype
MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
INDEX = "model.safetensors.index.json"


def __getattr__(name):  # DTYPES / DTYPE_NAMES with torch dtypes, for callers that want them (imports torch)
    if name in ("DTYPES", "DTYPE_NAMES"):
        dtypes = {k: v.torch() for k, v in ST_DTYPES.items()}
        globals().update(DTYPES=dtypes, DTYPE_NAMES={v: k for k, v in dtypes.items()})
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def st_dtype_name(dtype) -> str:
    """The safetensors name ("BF16") of a torch dtype, a ``DType`` or a dtype name."""
    name = str(dtype).removeprefix("torch.")
    if name not in ST_NAMES:
        raise ConversionError(f"dtype {name} cannot be stored in safetensors by this writer")
    return ST_NAMES[name]


def _uint(v) -> bool:
    return type(v) is int and v >= 0


def parse_header(raw: bytes, file_size: int) -> tuple[int, dict]:
    """(data section start, {name: (DType, shape, absolute offset)}) of a safetensors file whose first
    bytes are ``raw`` (at least 8 + header length of them); ValueError naming the defect otherwise.
    The checks are those of the safetensors library's ``read_metadata`` + ``Metadata::validate``."""
    if len(raw) < 8:
        raise ValueError("file shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > MAX_HEADER:
        raise ValueError(f"header length {n} exceeds the safetensors limit")
    if 8 + n > file_size or 8 + n > len(raw):
        raise ValueError(f"header length {n} does not fit a {file_size}-byte file")
    header = json.loads(bytes(raw[8:8 + n]).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ValueError("__metadata__ is not a map of strings")
    base, spans, entries = 8 + n, [], {}
    for name, e in header.items():
        if not isinstance(e, dict):
            raise ValueError(f"tensor {name!r}: entry is not an object")
        st = e.get("dtype")
        dtype = ST_DTYPES.get(st) if isinstance(st, str) else None
        if dtype is None:
            raise ValueError(f"tensor {name!r} has unsupported dtype {st!r}")
        shape, offs = e.get("shape"), e.get("data_offsets")
        if not isinstance(shape, list) or not all(_uint(x) for x in shape):
            raise ValueError(f"tensor {name!r} has an invalid shape {shape!r}")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_uint(x) for x in offs):
            raise ValueError(f"tensor {name!r} has invalid data_offsets {offs!r}")
        spans.append((offs[0], offs[1], name))
        entries[name] = (dtype, tuple(shape), base + offs[0])
        if offs[1] < offs[0] or offs[1] - offs[0] != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name!r} has data_offsets {offs} inconsistent with shape {shape} {st}")
    end = 0
    for b0, b1, name in sorted(spans):
        if b0 != end:
            raise ValueError(f"tensor {name!r} has data_offsets {[b0, b1]}: the tensors do not tile the data "
                             f"section (expected start {end})")
        end = b1
    if base + end != file_size:
        raise ValueError(f"tensors end at byte {base + end} of a {file_size}-byte file")
    return base, entries


class SafetensorsFile:
    """One .safetensors file: header entries {name: (DType, shape, absolute byte offset)}."""

    def __init__(self, path: str):
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise ConversionError(f"cannot open {path}: {e}") from e
        try:
            size = os.fstat(fd).st_size
            raw = os.pread(fd, 1 << 20, 0)  # headers are usually well below 1 MiB
            if len(raw) >= 8:
                need = 8 + struct.unpack("<Q", raw[:8])[0]
                if len(raw) < need <= min(size, 8 + MAX_HEADER):
                    raw = os.pread(fd, need, 0)
            self.data_start, self.entries = parse_header(raw, size)
        except Exception as e:  # noqa: BLE001  (json, struct, unicode, value errors alike)
            os.close(fd)
            raise ConversionError(f"corrupted safetensors header in {path}: {e}; the file is truncated or "
                                  f"damaged") from e
        self.fd = fd

    def row_range(self, name: str, start: int, stop: int) -> tuple[int, int, int]:
        """(fd, absolute byte offset, nbytes) of rows [start, stop) of ``name``: a contiguous range."""
        dtype, shape, off = self.entries[name]
        row = math.prod(shape[1:]) * dtype.itemsize
        return self.fd, off + start * row, (stop - start) * row

    def close(self) -> None:
        os.close(self.fd)


def read_index(path: str) -> list[str]:
    """The shard file names a ``model.safetensors.index.json`` maps tensors to (sorted, unique)."""
    try:
        with open(path, encoding="utf-8") as f:
            idx = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ConversionError(f"{path}: not JSON ({e})") from None
    wm = idx.get("weight_map") if isinstance(idx, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) and v for v in wm.values()):
        raise ConversionError(f"{path}: not a safetensors index (a JSON object whose weight_map maps tensor names "
                              f"to shard file names)")
    return sorted(set(wm.values()))


def safetensors_names(model_dir: str) -> list[str]:
    """The ``*.safetensors`` files of a directory, sorted ([] if it is not a directory)."""
    return sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")) if os.path.isdir(model_dir) else []


def check_weight_files(model_dir: str) -> None:
    """ConversionError naming the first ``*.safetensors`` file of ``model_dir`` that is truncated or malformed
    (``parse_header``: the header against the file size), before a loader dies in a raw deserializer traceback."""
    for f in safetensors_names(model_dir):
        SafetensorsFile(os.path.join(model_dir, f)).close()


class HFCheckpoint:
    """All safetensors of an HF model directory, addressed by tensor name."""

    def __init__(self, hf_dir: str):
        if not os.path.isdir(hf_dir):
            raise ConversionError(f"HF directory {hf_dir} does not exist")
        self.dir = hf_dir
        index = os.path.join(hf_dir, INDEX)
        files = read_index(index) if os.path.exists(index) else safetensors_names(hf_dir)
        if not files:
            raise ConversionError(f"no .safetensors files in {hf_dir}")
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, SafetensorsFile] = {}
        for fn in files:
            path = os.path.join(hf_dir, fn)
            if not os.path.exists(path):
                raise ConversionError(f"{INDEX} names {fn}, which is missing from {hf_dir}")
            sf = self.files[fn] = SafetensorsFile(path)
            for name in sf.entries:
                self.where[name] = sf

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].entries[name][1]

    def dtype(self, name: str) -> DType:
        """The dtype by name (``DType``: a str with ``itemsize`` and ``torch()``)."""
        return self.where[name].entries[name][0]

    def row_range(self, name: str, start: int, stop: int) -> tuple[int, int, int]:
        return self.where[name].row_range(name, start, stop)

    def close(self) -> None:
        for sf in self.files.values():
            sf.close()


class ShardWriter:
    """Writes one safetensors file whose tensors (name, shape, dtype) are known up front.

    ``write(t)`` appends the next rows of the current tensor; tensors are filled in the order given.
    """

    def __init__(self, path: str, tensors: list[tuple[str, tuple[int, ...], object]]):
        """``tensors``: (name, shape, dtype) with torch dtypes or dtype names."""
        header, off = {"__metadata__": {"format": "pt"}}, 0
        self.sizes = []
        for name, shape, dtype in tensors:
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": st_dtype_name(dtype), "shape": list(shape), "data_offsets": [off, off + n]}
            self.sizes.append((name, n))
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
        self.f = open(path, "wb", buffering=0)  # unbuffered: copy_from appends at the fd position
        self._write(struct.pack("<Q", len(raw)) + raw)
        self.path, self.total, self.i, self.filled = path, off, 0, 0

    def _write(self, data) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            mv = mv[self.f.write(mv):]

    def _account(self, nbytes: int) -> int:
        name, n = self.sizes[self.i]
        if self.filled + nbytes > n:
            raise ConversionError(f"{self.path}: too many bytes for tensor {name}")
        self.filled += nbytes
        if self.filled == n:
            self.i, self.filled = self.i + 1, 0
        return nbytes

    def write(self, t) -> int:
        """Append rows of the current tensor (a torch tensor); returns the bytes written."""
        import torch

        data = t.contiguous().view(torch.uint8).reshape(-1).numpy()
        self._account(len(data))
        self._write(data)
        return len(data)

    def copy_from(self, fd: int, offset: int, nbytes: int) -> int:
        """Append rows of the current tensor straight from another file, inside the kernel."""
        from megatron_s3ac.convert.dcp_io import copy_range

        self._account(nbytes)
        copy_range(fd, offset, self.f.fileno(), nbytes)
        return nbytes

    def close(self) -> None:
        if self.i != len(self.sizes):
            raise ConversionError(f"{self.path}: tensor {self.sizes[self.i][0]} was not completely written")
        self.f.close()

"""HF safetensors checkpoints: a validated, row-range reader and a streaming shard writer.

Reading hands out byte ranges (fd, offset, length) at the offsets of the safetensors header, which
the converter copies file-to-file in the kernel; nothing is mmapped (pages of an mmap stay in the
process' RSS while the file is open: a 5 GB shard would count 5 GB). Each header is
parsed strictly here *and* opened once with the ``safetensors`` library, so a corrupted header is
rejected with the file named before anything is converted.

Writing precomputes the header of a shard from the (name, shape, dtype) list, then appends tensor
bytes in order, so a shard never exists in memory as a whole.
"""
from __future__ import annotations

import json
import math
import os
import struct

import torch

from megatron_s3ac.convert.plan import ConversionError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
INDEX = "model.safetensors.index.json"


class SafetensorsFile:
    """One .safetensors file: header entries {name: (dtype, shape, absolute byte offset)}."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) != 8:
                    raise ValueError("file shorter than the 8-byte header length")
                (n,) = struct.unpack("<Q", raw)
                if n > MAX_HEADER or 8 + n > size:
                    raise ValueError(f"header length {n} does not fit a {size}-byte file")
                header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
            self.entries = {}
            base, data_len, end = 8 + n, size - 8 - n, 0
            for name, e in header.items():
                if name == "__metadata__":
                    continue
                dtype = DTYPES.get(e.get("dtype"))
                if dtype is None:
                    raise ValueError(f"tensor {name!r} has unsupported dtype {e.get('dtype')!r}")
                shape = tuple(int(x) for x in e["shape"])
                b0, b1 = (int(x) for x in e["data_offsets"])
                if b1 - b0 != math.prod(shape) * dtype.itemsize or not 0 <= b0 <= b1 <= data_len:
                    raise ValueError(f"tensor {name!r} has data_offsets {[b0, b1]} inconsistent with "
                                     f"shape {list(shape)} {e['dtype']} in a {data_len}-byte data section")
                self.entries[name] = (dtype, shape, base + b0)
                end = max(end, b1)
            from safetensors import safe_open  # the reference parser must agree

            with safe_open(path, framework="pt") as f:
                if set(f.keys()) != set(self.entries):
                    raise ValueError("safetensors library lists different tensors")
        except ConversionError:
            raise
        except Exception as e:  # noqa: BLE001  (json, struct, safetensors errors alike)
            raise ConversionError(f"corrupted safetensors header in {path}: {e}") from e
        self.fd = os.open(path, os.O_RDONLY)

    def row_range(self, name: str, start: int, stop: int) -> tuple[int, int, int]:
        """(fd, absolute byte offset, nbytes) of rows [start, stop) of ``name``: a contiguous range."""
        dtype, shape, off = self.entries[name]
        row = math.prod(shape[1:]) * dtype.itemsize
        return self.fd, off + start * row, (stop - start) * row

    def close(self) -> None:
        os.close(self.fd)


class HFCheckpoint:
    """All safetensors of an HF model directory, addressed by tensor name."""

    def __init__(self, hf_dir: str):
        if not os.path.isdir(hf_dir):
            raise ConversionError(f"HF directory {hf_dir} does not exist")
        index = os.path.join(hf_dir, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
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

    def dtype(self, name: str) -> torch.dtype:
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

    def __init__(self, path: str, tensors: list[tuple[str, tuple[int, ...], torch.dtype]]):
        header, off = {"__metadata__": {"format": "pt"}}, 0
        self.sizes = []
        for name, shape, dtype in tensors:
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
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

    def write(self, t: torch.Tensor) -> int:
        """Append rows of the current tensor; returns the bytes written."""
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

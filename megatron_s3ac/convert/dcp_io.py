"""megatron-core ``torch_dist`` checkpoints (PyTorch DCP on disk) without a distributed job.

On disk: ``.metadata`` (pickled ``torch.distributed.checkpoint.Metadata``: per key the global shape,
dtype and stored chunks; per chunk the file, byte offset and length), ``__*.distcp`` files holding
one ``torch.save`` blob per chunk (DCP's reader ``torch.load``s each, ``weights_only=True``),
``metadata.json`` (megatron's backend tag) and ``common.pt`` (megatron's non-sharded state).

``DistcpWriter`` appends chunks as they are produced and writes ``.metadata`` last, so no more than
the chunks in flight are ever in memory. ``DistcpCheckpoint`` reads any region of any key from
whatever chunking the checkpoint has (ours, or a training save at any TP/PP/EP).
``.metadata`` is written and read by ``dcp_meta`` (same bytes DCP reads; no DCP import, which is a
large part of the CLI's start-up); unusual metadata files fall back to DCP's own reader.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import math
import struct
import threading
import zipfile
from collections import OrderedDict

import torch

from megatron_s3ac.convert.dcp_meta import DType, dump_metadata, load_metadata
from megatron_s3ac.convert.plan import ConversionError, box_slices, overlap

MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}


@contextlib.contextmanager
def no_crc32():
    """torch.save without the zip CRC32 (10x faster here; torch.load does not need it)."""
    old = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(old)


SPLICE_MIN_BYTES = 64 * 1024  # smaller chunks are simply read and torch.save'd


def copy_range(src_fd: int, src_off: int, dst_fd: int, nbytes: int) -> None:
    """Append ``nbytes`` of ``src_fd`` at ``src_off`` to ``dst_fd`` (at its position) inside the kernel,
    as ``cp`` does: the bytes never enter this process."""
    while nbytes > 0:
        n = os.copy_file_range(src_fd, dst_fd, nbytes, src_off)
        if n <= 0:
            raise ConversionError(f"short copy: {nbytes} bytes left at offset {src_off}")
        src_off += n
        nbytes -= n


def write_all(fd: int, data) -> None:
    mv = memoryview(data).cast("B")
    while len(mv):
        mv = mv[os.write(fd, mv):]


def write_zeros(fd: int, nbytes: int) -> None:
    block = bytes(min(nbytes, 1 << 20))
    while nbytes > 0:
        write_all(fd, block[:nbytes])
        nbytes -= min(nbytes, len(block))


def write_segments(fd: int, segments) -> None:
    """``segments``: [(src_fd, src_offset, nbytes)] copied in order; src_fd None means zeros."""
    for src, off, n in segments:
        if src is None:
            write_zeros(fd, n)
        else:
            copy_range(src, off, fd, n)


class _SpliceStream(io.RawIOBase):
    """What ``torch.save`` writes into: the zip records pass through, but the single write of the
    tensor's bytes (``nbytes`` long; torch writes a storage in one call) is replaced by ``segments``."""

    def __init__(self, fd: int, nbytes: int, segments):
        self.fd, self.nbytes, self.segments, self.done = fd, nbytes, segments, False
        self.start = os.lseek(fd, 0, os.SEEK_CUR)

    def writable(self):
        return True

    def tell(self):
        return os.lseek(self.fd, 0, os.SEEK_CUR) - self.start

    def write(self, b):
        mv = memoryview(b).cast("B")
        if not self.done and len(mv) == self.nbytes:
            write_segments(self.fd, self.segments)
            self.done = True
        else:
            write_all(self.fd, mv)
        return len(mv)


class DistcpWriter:
    """Collects items written by any number of ``ItemFile``s, then writes the metadata files."""

    def __init__(self, out_dir: str):
        self.dir = out_dir
        self.tensors: dict[str, tuple] = {}  # key -> (global shape, dtype name, [(offsets, sizes)])
        self.storage: dict[tuple, tuple] = {}  # (key, offsets or None) -> (file, byte offset, length)
        self.objects: list[str] = []
        self.lock = threading.Lock()
        self.nfiles = 0

    def open_file(self) -> "ItemFile":
        with self.lock:
            self.nfiles += 1
            return ItemFile(self, f"__0_{self.nfiles - 1}.distcp")

    def _record_tensor(self, key, global_shape, offset, shape, dtype, info: tuple) -> None:
        dtype = str(dtype).removeprefix("torch.")
        offset, shape, global_shape = (tuple(int(x) for x in t) for t in (offset, shape, global_shape))
        with self.lock:
            md = self.tensors.get(key)
            if md is None:
                md = self.tensors[key] = (global_shape, dtype, [])
            elif md[1] != dtype or md[0] != global_shape:
                raise ConversionError(f"{key}: chunks disagree on dtype/global shape "
                                      f"({md[1]} {md[0]} vs {dtype} {global_shape})")
            md[2].append((offset, shape))
            self.storage[(key, offset)] = info

    def _record_object(self, unique_key: str, info: tuple) -> None:
        with self.lock:
            self.objects.append(unique_key)
            self.storage[(unique_key, None)] = info

    def finish(self) -> None:
        """Write ``.metadata``, ``metadata.json`` and ``common.pt`` (after all ItemFiles are closed)."""
        with open(os.path.join(self.dir, ".metadata"), "wb") as f:
            f.write(dump_metadata(self.tensors, self.objects, self.storage, self.dir))
        with open(os.path.join(self.dir, "metadata.json"), "w") as f:
            json.dump(MEGATRON_METADATA, f)
        torch.save({}, os.path.join(self.dir, "common.pt"))


class ItemFile:
    """One ``.distcp`` file; items are appended. Not thread-safe: one per worker."""

    def __init__(self, writer: DistcpWriter, name: str):
        self.w, self.name = writer, name
        self.f = open(os.path.join(writer.dir, name), "wb", buffering=0)  # fd position == tell()
        self.blobs: dict[str, bytes] = {}

    def write_tensor(self, key, global_shape, offset, t: torch.Tensor) -> int:
        t = t.detach().contiguous()
        if t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone()  # torch.save writes the whole storage of a view
        start = self.f.tell()
        torch.save(t, self.f)  # callers run under ``no_crc32()`` (a process-wide switch)
        end = self.f.tell()
        self.w._record_tensor(key, global_shape, offset, tuple(t.shape), t.dtype,
                              (self.name, start, end - start))
        return end - start

    def write_spliced(self, key, global_shape, offset, shape, dtype, segments) -> int:
        """Write a chunk whose bytes are ``segments`` of other files (see ``write_segments``) without
        reading them: torch.save serialises an untouched placeholder and the data write is spliced."""
        placeholder = torch.empty(shape, dtype=dtype)  # never filled: its pages are never touched
        if placeholder.nbytes < SPLICE_MIN_BYTES:
            buf = placeholder.view(torch.uint8).reshape(-1).numpy()
            at = 0
            for src, off, n in segments:
                if src is None:
                    buf[at:at + n] = 0
                else:
                    got = os.preadv(src, [memoryview(buf[at:at + n])], off)
                    if got != n:
                        raise ConversionError(f"short read of {n} bytes at offset {off}")
                at += n
            return self.write_tensor(key, global_shape, offset, placeholder)
        start = self.f.tell()
        stream = _SpliceStream(self.f.fileno(), placeholder.nbytes, segments)
        torch.save(placeholder, stream)
        if not stream.done:
            raise ConversionError(f"{key}: torch.save did not write the tensor data in one piece")
        end = self.f.tell()
        self.w._record_tensor(key, global_shape, offset, tuple(shape), dtype, (self.name, start, end - start))
        return end - start

    def write_object(self, unique_key: str, obj) -> None:
        """A ShardedObject as megatron stores it: torch.save([obj]) (serialised once per distinct obj)."""
        blob = self.blobs.get(repr(obj))
        if blob is None:
            buf = io.BytesIO()
            torch.save([obj], buf)
            blob = self.blobs[repr(obj)] = buf.getvalue()
        start = self.f.tell()
        self.f.write(blob)
        self.w._record_object(unique_key, (self.name, start, self.f.tell() - start))

    def close(self) -> None:
        self.f.close()


class _FileView(io.RawIOBase):
    """Bytes [offset, offset+length) of an open file as a seekable stream (torch.load reads from it
    straight into tensor storage: no intermediate bytes copy)."""

    def __init__(self, f, offset: int, length: int):
        self.f, self.base, self.length, self.pos = f, offset, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, pos, whence=0):
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), self.length - self.pos))
        if n == 0:
            return 0
        got = os.preadv(self.f.fileno(), [memoryview(b)[:n]], self.base + self.pos)
        self.pos += got
        return got


class DistcpCheckpoint:
    """Read access to a torch_dist checkpoint directory."""

    def __init__(self, ckpt_dir: str, cache_chunks: int = 2, contiguous_chunks: bool = False):
        if not os.path.exists(os.path.join(ckpt_dir, ".metadata")):
            raise ConversionError(f"{ckpt_dir} is not a torch_dist checkpoint (no .metadata)")
        self.dir = ckpt_dir
        self.md = load_metadata(os.path.join(ckpt_dir, ".metadata"))
        if self.md is None:  # metadata with more than DCP's plain classes: DCP's own reader
            from torch.distributed.checkpoint.filesystem import FileSystemReader

            self.md = FileSystemReader(ckpt_dir).read_metadata()
        # (key, chunk offsets or None) -> (relative path, byte offset, length)
        self.storage = {(i.fqn, None if getattr(i, "offset", None) is None else tuple(int(x) for x in i.offset)):
                        (s.relative_path, s.offset, s.length) for i, s in self.md.storage_data.items()}
        self.files: dict[str, object] = {}
        self.cache: OrderedDict = OrderedDict()
        self.cache_chunks = cache_chunks
        self.contiguous_chunks = contiguous_chunks
        self.data_starts: dict[tuple, tuple[int, int]] = {}

    def byte_range(self, key: str, offset: tuple, shape: tuple):
        """(fd, byte offset, nbytes) of the region when it is one contiguous byte range of a stored
        chunk, else None. Only for checkpoints whose chunks are known to be saved contiguous, row-major
        and without a larger storage (``contiguous_chunks``; ours are)."""
        if not self.contiguous_chunks:
            return None
        md = self.md.state_dict_metadata[key]
        for c in md.chunks:
            co, cs = tuple(c.offsets), tuple(c.sizes)
            if overlap(offset, shape, co, cs) != (tuple(offset), tuple(shape)):
                continue  # not inside this chunk
            lo = [o - x for o, x in zip(offset, co)]
            k = next((i for i, n in enumerate(shape) if n != 1), len(shape))  # first non-singleton axis
            if any(shape[i] != cs[i] for i in range(k + 1, len(shape))):
                return None  # rows of a column slice: not contiguous
            strides = [math.prod(cs[i + 1:]) for i in range(len(cs))]
            item = md.properties.dtype.itemsize
            fd, data = self._data_start(key, co, math.prod(cs) * item)
            return fd, data + sum(a * b for a, b in zip(lo, strides)) * item, math.prod(shape) * item
        return None

    def _data_start(self, key: str, chunk_offsets: tuple, nbytes: int) -> tuple[int, int]:
        """fd and absolute offset of the tensor bytes inside a chunk's torch.save zip blob."""
        hit = self.data_starts.get((key, chunk_offsets))
        if hit is not None:
            return hit
        path, off, length = self.storage[(key, tuple(chunk_offsets))]
        f = self._file(path)
        z = zipfile.ZipFile(_FileView(f, off, length))
        zi = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
        if zi.compress_type != zipfile.ZIP_STORED or zi.file_size != nbytes:
            raise ConversionError(f"{key}: chunk at {chunk_offsets} is not a plain stored tensor of {nbytes} bytes")
        head = os.pread(f.fileno(), 30, off + zi.header_offset)  # zip local file header
        name_len, extra_len = struct.unpack("<HH", head[26:30])
        hit = self.data_starts[(key, chunk_offsets)] = (f.fileno(), off + zi.header_offset + 30 + name_len + extra_len)
        return hit

    def _file(self, relative_path: str):
        f = self.files.get(relative_path)
        if f is None:
            f = self.files[relative_path] = open(os.path.join(self.dir, relative_path), "rb")
        return f

    def has(self, key: str) -> bool:
        return hasattr(self.md.state_dict_metadata.get(key), "chunks")  # a tensor, not a byte object

    def global_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.md.state_dict_metadata[key].size)

    def dtype(self, key: str) -> torch.dtype:
        dt = self.md.state_dict_metadata[key].properties.dtype
        return dt.torch() if isinstance(dt, DType) else dt

    def _load_chunk(self, key: str, offsets: tuple) -> torch.Tensor:
        ck = (key, offsets)
        if ck in self.cache:
            self.cache.move_to_end(ck)
            return self.cache[ck]
        path, off, length = self.storage[(key, tuple(offsets))]
        t = torch.load(_FileView(self._file(path), off, length), map_location="cpu", weights_only=True)
        self.cache[ck] = t
        while len(self.cache) > self.cache_chunks:
            self.cache.popitem(last=False)
        return t

    def read_region(self, key: str, offset: tuple, shape: tuple) -> torch.Tensor:
        """The region ``offset``/``shape`` of global tensor ``key``, from whichever chunks overlap it.
        Treat the result as read-only: it may be a cached chunk."""
        md = self.md.state_dict_metadata[key]
        for c in md.chunks:  # the common case for our own checkpoints: a region is one stored chunk
            if tuple(c.offsets) == tuple(offset) and tuple(c.sizes) == tuple(shape):
                return self._load_chunk(key, tuple(offset))
        out = torch.empty(shape, dtype=self.dtype(key))
        filled = 0
        for c in md.chunks:
            ov = overlap(offset, shape, tuple(c.offsets), tuple(c.sizes))
            if ov is None:
                continue
            src = self._load_chunk(key, tuple(c.offsets))
            out[box_slices(*ov, offset)] = src[box_slices(*ov, tuple(c.offsets))]
            filled += int(torch.Size(ov[1]).numel())
        if filled != out.numel():
            raise ConversionError(f"{key}: the checkpoint chunks cover {filled} of {out.numel()} elements of "
                                  f"region {offset}+{shape}")
        return out

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.cache.clear()

"""megatron-core ``torch_dist`` checkpoints (PyTorch DCP on disk) without a distributed job.

On disk: ``.metadata`` (pickled ``torch.distributed.checkpoint.Metadata``: per key the global shape,
dtype and stored chunks; per chunk the file, byte offset and length), ``__*.distcp`` files holding
one ``torch.save`` blob per chunk (DCP's reader ``torch.load``s each, ``weights_only=True``),
``metadata.json`` (megatron's backend tag) and ``common.pt`` (megatron's non-sharded state).

``DistcpWriter`` appends chunks as they are produced and writes ``.metadata`` last, so no more than
the chunks in flight are ever in memory. It needs no torch: a ``torch.save`` blob is a zip archive
whose records (``data.pkl``, ``byteorder``, ``data/0``, ...) depend only on the tensor's shape and
dtype, so ``torch_save_parts`` builds the bytes around the tensor data by hand (the same bytes
``torch.save`` writes with its CRC32 option off; tests compare them byte for byte) and the data
itself is copied file-to-file by the kernel (``copy_file_range``, as ``cp`` does; small chunks go
through a small buffer), never materialised as a tensor. ``DistcpCheckpoint`` reads any region of any key from
whatever chunking the checkpoint has (ours, or a training save at any TP/PP/EP); it imports torch.
``.metadata`` is written and read by ``dcp_meta`` (same bytes DCP reads; no DCP import, which is a
large part of the CLI's start-up); unusual metadata files fall back to DCP's own reader.
"""
from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import pickle
import struct
import threading
from collections import OrderedDict

from megatron_s3ac.convert.dcp_meta import DType, _Emit, dump_metadata, load_metadata
from megatron_s3ac.convert.plan import ConversionError, box_slices, overlap

MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}


def _dtype(dtype) -> DType:
    """A ``DType`` from a ``DType``, a dtype name or a ``torch.dtype``."""
    return DType(str(dtype).removeprefix("torch."))


# ------------------------------------------------------------------------------------ torch.save bytes
# torch.save writes a zip (PyTorchStreamWriter): every record stored uncompressed, its data 64-byte
# aligned by an "FB" extra field, sizes in a data descriptor after the data, then the central
# directory, a zip64 end record + locator and the classic end record. With CRC32 switched off every
# CRC field is 0, and the serialization id (combined CRCs and record-name hashes) depends only on
# which records exist: one constant per record set.
_ALIGN = 64
_ZIP32_LIMIT = 0xFFFFFFFF  # archives this large need zip64 fields per record: left to torch.save itself
_SERIALIZATION_ID = {True: b"1572819951185464302603005401530805769991",  # records include data/0
                     False: b"0290846867776292310400046082544174525093"}  # no storage at all
_STORAGE_GLOBAL = {"float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
                   "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
                   "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage"}
# (dtypes without a typed storage class, e.g. float8, are pickled with an untyped storage + the dtype)


def tensor_pickle(shape, dtype) -> bytes:
    """``data.pkl`` of ``torch.save(t)`` for a contiguous CPU tensor ``t`` of ``shape``/``dtype`` that
    owns its storage, exactly as torch's pickler (protocol 2, memoised) writes it:
    ``_rebuild_tensor_v2(<storage '0'>, 0, shape, stride, False, OrderedDict())`` with a typed storage,
    or ``_rebuild_tensor_v3(<untyped storage '0'>, ..., dtype)`` for dtypes without one (float8)."""
    dt = _dtype(dtype)
    shape = tuple(int(x) for x in shape)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    typed = _STORAGE_GLOBAL.get(dt)
    e = _Emit()
    memo = iter(range(256))  # 13 entries at most: BINPUT with a one-byte index

    def put():
        e.w(b"q" + bytes([next(memo)]))

    def tup(vals):
        if not vals:
            e.w(b")")  # the empty tuple is not memoised
            return
        if len(vals) > 3:
            e.w(b"(")
        for v in vals:
            e.i(v)
        e.w(b"t" if len(vals) > 3 else b"\x85\x86\x87"[len(vals) - 1:len(vals)])
        put()

    e.glob("torch._utils", "_rebuild_tensor_v2" if typed else "_rebuild_tensor_v3")
    put()
    e.w(b"((")
    e.s("storage")
    put()
    if typed:
        e.glob("torch", typed)
    else:
        e.glob("torch.storage", "UntypedStorage")
    put()
    for s in ("0", "cpu"):
        e.s(s)
        put()
    e.i(math.prod(shape) * (1 if typed else dt.itemsize))  # elements of a typed storage, else bytes
    e.w(b"t")
    put()
    e.w(b"Q")
    e.i(0)
    tup(shape)
    tup(stride)
    e.w(b"\x89")
    e.glob("collections", "OrderedDict")
    put()
    e.w(b")R")
    put()
    if not typed:
        e.glob("torch", dt)
        put()
    e.w(b"t")
    put()
    e.w(b"R")
    put()
    return e.bytes()


def torch_save_parts(pkl: bytes, data_nbytes: int | None, archive: str = "archive") -> tuple[bytes, bytes] | None:
    """``(head, tail)``: ``head + <data_nbytes bytes of the storage> + tail`` is what ``torch.save``
    (CRC32 off) writes for an object whose pickle is ``pkl`` and which holds one storage of
    ``data_nbytes`` bytes (None: no storage; then ``head + tail`` is the whole file). ``archive`` is
    the zip's top folder (torch uses the file name's stem, or "archive" for streams).
    None when the archive would need zip64 fields (>= 4 GiB), or for an empty storage (torch lays
    those out differently): callers then use torch.save itself."""
    if data_nbytes == 0:
        return None
    records = [("data.pkl", pkl), (".format_version", b"1"), (".storage_alignment", b"64"),
               ("byteorder", b"little")]
    if data_nbytes is not None:
        records.append(("data/0", data_nbytes))
    records += [("version", b"3\n"), (".data/serialization_id", _SERIALIZATION_ID[data_nbytes is not None])]
    out, cut, pos, central = [], None, 0, []
    for name, data in records:
        full = f"{archive}/{name}".encode()
        size = data if isinstance(data, int) else len(data)
        if pos + size >= _ZIP32_LIMIT:
            return None
        pad = -(pos + 30 + len(full) + 4) % _ALIGN
        hdr = (struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, 0x0808, 0, 0, 0, 0, 0, 0, len(full), 4 + pad)
               + full + b"FB" + struct.pack("<H", pad) + b"Z" * pad)
        central.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, 0x0808, 0, 0, 0, 0, size, size,
                                   len(full), 0, 0, 0, 0, 0, pos) + full)
        out.append(hdr)
        pos += len(hdr)
        if isinstance(data, int):
            cut = len(out)
        else:
            out.append(data)
        pos += size
        out.append(struct.pack("<IIII", 0x08074B50, 0, size, size))
        pos += 16
        if pos >= _ZIP32_LIMIT:
            return None
    cd = b"".join(central)
    n = len(records)
    out += [cd, struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, n, n, len(cd), pos),
            struct.pack("<IIQI", 0x07064B50, 0, pos + len(cd), 1),
            struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(cd), pos, 0)]
    if pos + len(cd) >= _ZIP32_LIMIT:
        return None
    if cut is None:
        return b"".join(out), b""
    return b"".join(out[:cut]), b"".join(out[cut:])


@functools.lru_cache(maxsize=1024)
def _tensor_parts(shape: tuple, dtype: str, _limit: int):
    """``torch_save_parts`` of a tensor (MoE checkpoints repeat a few shapes thousands of times)."""
    dt = DType(dtype)
    return torch_save_parts(tensor_pickle(shape, dt), math.prod(shape) * dt.itemsize)


def _plain(obj) -> bool:
    """Built-in values only (what ``pickle`` and torch's pickler serialise identically)."""
    if type(obj) in (type(None), bool, int, float, str, bytes):
        return True
    if type(obj) in (list, tuple):
        return all(_plain(x) for x in obj)
    if type(obj) is dict:
        return all(_plain(k) and _plain(v) for k, v in obj.items())
    return False


def torch_save_bytes(obj, archive: str = "archive") -> bytes:
    """``torch.save(obj)`` (CRC32 off) for an object of built-in values (e.g. ``[None]``, ``{}``)."""
    parts = torch_save_parts(pickle.dumps(obj, protocol=2), None, archive) if _plain(obj) else None
    if parts is None:  # torch's own pickler (its zip then says "archive/": torch.load ignores the name)
        import torch

        buf = io.BytesIO()
        with _TORCH_SAVE_LOCK, no_crc32():
            torch.save(obj, buf)
        return buf.getvalue()
    return parts[0] + parts[1]


@contextlib.contextmanager
def no_crc32():
    """torch.save without the zip CRC32 (10x faster here; torch.load does not need it)."""
    import torch

    old = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(old)


# ------------------------------------------------------------------------------------------ byte moving
# How chunk bytes move from the safetensors files into a .distcp file: chunks of at least
# SPLICE_MIN_BYTES are copied by the kernel (copy_file_range, as cp does, in calls of at most
# COPY_CALL_BYTES); zip records and smaller chunks are packed into COPY_BUFFER-sized writes. Measured
# here (ext4, Linux 6.18 in a 2-core VM, page-cached 2.9 GB input, interleaved runs):
#  * reading everything through a 512 KiB buffer was ~30% faster than copy_file_range in a clean state
#    but 2-4x slower right after another process had written and deleted a few GB; copy_file_range
#    stays close to cp -r in both states;
#  * the kernel copy costs ~10% more when the data's destination offset is not congruent to its source
#    offset modulo the page size (PHASE_BYTES): each kernel-copied chunk's blob is placed so that it is,
#    leaving a hole of < 4 KiB before it (DCP addresses blobs by offset and length; gaps are never read);
#  * calls of 1 GB were slower than calls of 1-64 MiB; files of <= 1 GiB faster to append to than
#    multi-GB ones (see hf_to_mcore.FILE_BYTES).
COPY_BUFFER = 512 << 10
SPLICE_MIN_BYTES = 64 << 10
COPY_CALL_BYTES = 64 << 20
PHASE_BYTES = 4096


def copy_range(src_fd: int, src_off: int, dst_fd: int, nbytes: int) -> None:
    """Append ``nbytes`` of ``src_fd`` at ``src_off`` to ``dst_fd`` (at its position) inside the kernel,
    as ``cp`` does: the bytes never enter this process."""
    while nbytes > 0:
        n = os.copy_file_range(src_fd, dst_fd, min(nbytes, COPY_CALL_BYTES), src_off)
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


def read_segments(segments, into: memoryview) -> None:
    """``segments`` (as in ``write_segments``) read one after the other into ``into``."""
    at = 0
    for src, off, n in segments:
        if src is None:
            into[at:at + n] = bytes(n)
        elif os.preadv(src, [into[at:at + n]], off) != n:
            raise ConversionError(f"short read of {n} bytes at offset {off}")
        at += n


class _SpliceStream(io.RawIOBase):
    """What ``torch.save`` writes into (the fallback of ``ItemFile``): everything passes through to
    ``fd``, except the single write of the tensor's bytes (``nbytes`` long; torch writes a storage in
    one call), which is replaced by ``segments`` (None: no replacement)."""

    def __init__(self, fd: int, nbytes: int, segments):
        self.fd, self.nbytes, self.segments, self.done = fd, nbytes, segments, False
        self.start = os.lseek(fd, 0, os.SEEK_CUR)

    def writable(self):
        return True

    def tell(self):
        return os.lseek(self.fd, 0, os.SEEK_CUR) - self.start

    def write(self, b):
        mv = memoryview(b).cast("B")
        if self.segments is not None and not self.done and len(mv) == self.nbytes:
            write_segments(self.fd, self.segments)
            self.done = True
        else:
            write_all(self.fd, mv)
        return len(mv)


_TORCH_SAVE_LOCK = threading.Lock()  # no_crc32 is a process-wide switch


# ----------------------------------------------------------------------------------------------- writer
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
        with open(os.path.join(self.dir, ".metadata"), "wb", buffering=1 << 20) as f:
            dump_metadata(self.tensors, self.objects, self.storage, self.dir, out=f)
        with open(os.path.join(self.dir, "metadata.json"), "w") as f:
            json.dump(MEGATRON_METADATA, f)
        with open(os.path.join(self.dir, "common.pt"), "wb") as f:
            f.write(torch_save_bytes({}, archive="common"))  # == torch.save({}, ".../common.pt")


class _Appender:
    """Appends to ``fd`` through a ``COPY_BUFFER``-byte buffer: zip records and file ranges (read
    straight into the buffer with ``preadv``) are packed into full-buffer writes."""

    def __init__(self, fd: int):
        self.fd, self.n = fd, 0
        self.buf = memoryview(bytearray(COPY_BUFFER))

    def put(self, data) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            k = min(len(data), len(self.buf) - self.n)
            self.buf[self.n:self.n + k] = data[:k]
            self.n += k
            data = data[k:]
            if self.n == len(self.buf):
                self.flush()

    def put_range(self, src: int | None, off: int, nbytes: int) -> None:
        """``nbytes`` of file ``src`` at ``off`` (None: zeros)."""
        while nbytes > 0:
            k = min(nbytes, len(self.buf) - self.n)
            if src is None:
                self.buf[self.n:self.n + k] = bytes(k)
            else:
                k = os.preadv(src, [self.buf[self.n:self.n + k]], off)
                if k <= 0:
                    raise ConversionError(f"short read: {nbytes} bytes left at offset {off}")
            self.n += k
            off += k
            nbytes -= k
            if self.n == len(self.buf):
                self.flush()

    def flush(self) -> None:
        if self.n:
            write_all(self.fd, self.buf[:self.n])
            self.n = 0

    def skip(self, nbytes: int) -> None:
        """Leave ``nbytes`` unwritten (a hole; reads as zeros) before what is appended next."""
        self.flush()
        os.lseek(self.fd, nbytes, os.SEEK_CUR)


class ItemFile:
    """One ``.distcp`` file; items are appended. Not thread-safe: one per worker."""

    def __init__(self, writer: DistcpWriter, name: str):
        self.w, self.name = writer, name
        self.fd = os.open(os.path.join(writer.dir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        self.out = _Appender(self.fd)
        self.pos = 0  # bytes appended, holes included (the fd's position once ``out`` is flushed)
        self.blobs: dict[str, bytes] = {}

    def tell(self) -> int:
        return self.pos

    def write_tensor(self, key, global_shape, offset, t) -> int:
        """A torch tensor, as ``torch.save`` writes it."""
        t = t.detach().contiguous()
        if t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone()  # torch.save writes the whole storage of a view
        return self._write_chunk(key, global_shape, offset, tuple(t.shape), t.dtype, tensor=t)

    def write_spliced(self, key, global_shape, offset, shape, dtype, segments) -> int:
        """Write a chunk whose bytes are ``segments`` of other files (see ``write_segments``) without
        materialising it: the zip records around them are built here, and the bytes are copied by the
        kernel (chunks under ``SPLICE_MIN_BYTES``: read into the ``COPY_BUFFER`` with the records)."""
        return self._write_chunk(key, global_shape, offset, tuple(shape), dtype, segments=segments)

    def _write_chunk(self, key, global_shape, offset, shape, dtype, segments=None, tensor=None) -> int:
        dt = _dtype(dtype)
        nbytes = math.prod(shape) * dt.itemsize
        parts = _tensor_parts(tuple(int(x) for x in shape), str(dt), _ZIP32_LIMIT)
        if parts is None:
            return self._write_via_torch(key, global_shape, offset, shape, dt, segments, tensor)
        head, tail = parts
        if tensor is None and nbytes >= SPLICE_MIN_BYTES:  # a kernel copy: match the source's offset phase
            src_off = next((off for src, off, _ in segments if src is not None), None)
            if src_off is not None:
                gap = (src_off - (self.pos + len(head))) % PHASE_BYTES
                if gap:
                    self.out.skip(gap)
                    self.pos += gap
        self.out.put(head)
        if tensor is not None:
            import torch

            self.out.put(tensor.reshape(-1).view(torch.uint8).numpy())
        elif nbytes < SPLICE_MIN_BYTES:
            for src, off, n in segments:
                self.out.put_range(src, off, n)
        else:
            self.out.flush()
            write_segments(self.fd, segments)
        self.out.put(tail)
        length = len(head) + nbytes + len(tail)
        self.w._record_tensor(key, global_shape, offset, shape, dt, (self.name, self.pos, length))
        self.pos += length
        return length

    def _write_via_torch(self, key, global_shape, offset, shape, dt, segments, tensor) -> int:
        """What ``torch_save_parts`` leaves to torch (archives of >= 4 GiB, which need zip64 records;
        empty tensors): ``torch.save`` itself. Segments are spliced in: torch serialises an untouched
        placeholder (its pages are never touched, so it uses no memory) and its single write of the
        data is replaced by the kernel copies."""
        import torch

        self.out.flush()
        stream = _SpliceStream(self.fd, None, None)
        if tensor is None:
            tensor = torch.empty(shape, dtype=dt.torch())
            if tensor.nbytes >= 4096:  # far longer than any of torch's other records: never mistaken
                stream = _SpliceStream(self.fd, tensor.nbytes, segments)
            elif tensor.nbytes:
                read_segments(segments, memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        with _TORCH_SAVE_LOCK, no_crc32():
            torch.save(tensor, stream)
        if stream.segments is not None and not stream.done:
            raise ConversionError(f"{key}: torch.save did not write the tensor data in one piece")
        end = os.lseek(self.fd, 0, os.SEEK_CUR)
        length = end - self.pos
        self.w._record_tensor(key, global_shape, offset, shape, dt, (self.name, self.pos, length))
        self.pos = end
        return length

    def write_object(self, unique_key: str, obj) -> None:
        """A ShardedObject as megatron stores it: torch.save([obj]) (serialised once per distinct obj)."""
        blob = self.blobs.get(repr(obj))
        if blob is None:
            blob = self.blobs[repr(obj)] = torch_save_bytes([obj])
        self.out.put(blob)
        self.w._record_object(unique_key, (self.name, self.pos, len(blob)))
        self.pos += len(blob)

    def close(self) -> None:
        if self.fd >= 0:
            try:
                self.out.flush()
            finally:
                os.close(self.fd)
                self.fd = -1


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
        path = os.path.join(ckpt_dir, ".metadata")
        try:
            self.md = load_metadata(path)
            if self.md is None:  # metadata with more than DCP's plain classes: DCP's own reader
                from torch.distributed.checkpoint.filesystem import FileSystemReader

                self.md = FileSystemReader(ckpt_dir).read_metadata()
            # (key, chunk offsets or None) -> (relative path, byte offset, length)
            self.storage = {(i.fqn, None if getattr(i, "offset", None) is None else tuple(int(x) for x in i.offset)):
                            (s.relative_path, s.offset, s.length) for i, s in self.md.storage_data.items()}
        except Exception as e:  # noqa: BLE001  (pickle, EOF, attribute errors alike: a damaged file)
            raise ConversionError(f"{path}: not a readable torch_dist metadata file ({type(e).__name__}: {e}); "
                                  f"the checkpoint is truncated or damaged") from None
        self._check_files()
        self.files: dict[str, object] = {}
        self.cache: OrderedDict = OrderedDict()
        self.cache_chunks = cache_chunks
        self.contiguous_chunks = contiguous_chunks
        self.data_starts: dict[tuple, tuple[int, int]] = {}

    def _check_files(self) -> None:
        """Every file ``.metadata`` names exists and holds the byte ranges it places there: a truncated or
        incomplete checkpoint is named here, before any output is written."""
        ends: dict[str, tuple[int, str]] = {}
        for (key, _), (rel, off, length) in self.storage.items():
            if off + length > ends.get(rel, (-1, ""))[0]:
                ends[rel] = (off + length, key)
        for rel, (end, key) in sorted(ends.items()):
            path = os.path.join(self.dir, rel)
            if not os.path.isfile(path):
                raise ConversionError(f"{path} is missing (.metadata stores {key} in it): the checkpoint is incomplete")
            size = os.path.getsize(path)
            if size < end:
                raise ConversionError(f"{path} has {size} bytes, .metadata places {key} up to byte {end}: the "
                                      f"checkpoint is truncated")

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
        import zipfile

        f = self._file(path)
        try:
            z = zipfile.ZipFile(_FileView(f, off, length))
            zi = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
        except (zipfile.BadZipFile, StopIteration, ValueError) as e:
            raise ConversionError(f"{os.path.join(self.dir, path)}: chunk of {key} at byte {off} is not a torch.save "
                                  f"blob ({e or 'no data/0 record'}); the checkpoint is damaged") from None
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

    def dtype_name(self, key: str) -> DType:
        """The dtype without importing torch (``DType``: name + ``itemsize``; ``ShardWriter`` takes it)."""
        return _dtype(self.md.state_dict_metadata[key].properties.dtype)

    def _load_chunk(self, key: str, offsets: tuple) -> torch.Tensor:
        ck = (key, offsets)
        if ck in self.cache:
            self.cache.move_to_end(ck)
            return self.cache[ck]
        import torch

        path, off, length = self.storage[(key, tuple(offsets))]
        try:
            t = torch.load(_FileView(self._file(path), off, length), map_location="cpu", weights_only=True)
        except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as e:
            raise ConversionError(f"{os.path.join(self.dir, path)}: chunk of {key} at byte {off} cannot be read "
                                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); the checkpoint "
                                  f"is damaged") from None
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
        import torch

        out = torch.empty(shape, dtype=self.dtype(key))
        filled = 0
        for c in md.chunks:
            ov = overlap(offset, shape, tuple(c.offsets), tuple(c.sizes))
            if ov is None:
                continue
            src = self._load_chunk(key, tuple(c.offsets))
            out[box_slices(*ov, offset)] = src[box_slices(*ov, tuple(c.offsets))]
            filled += math.prod(ov[1])
        if filled != out.numel():
            raise ConversionError(f"{key}: the checkpoint chunks cover {filled} of {out.numel()} elements of "
                                  f"region {offset}+{shape}")
        return out

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.cache.clear()

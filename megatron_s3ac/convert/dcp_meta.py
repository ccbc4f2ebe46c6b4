"""PyTorch DCP ``.metadata`` files written and read without importing ``torch.distributed.checkpoint``.

Importing DCP costs ~0.7 s (more on a busy machine), a large share of the converter's start-up. The
file is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``; this module writes exactly the
opcodes ``pickle.dump`` produces for it (classes referenced by module and name, so the reader
needs nothing from us) and reads it back with an unpickler that maps those classes to plain records.
Files holding anything else (e.g. planner data of some trainer) make ``load_metadata`` return None;
the caller then uses DCP's own reader.

Dtypes are passed in as names (``"bfloat16"``); nothing here imports torch.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import struct

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"


class _Emit:
    """A protocol-2 pickle written opcode by opcode (no memo: every object is written once), into a
    binary file ``out`` as it goes (memory stays flat however many chunks a checkpoint has: a list
    of small bytes objects would take ~10x the pickle's size) or into memory (``bytes()``)."""

    def __init__(self, out=None):
        self.own = out is None
        self.buf = io.BytesIO() if out is None else out
        self.w = self.buf.write
        self.w(b"\x80\x02")

    def glob(self, module: str, name: str) -> None:
        self.w(b"c" + f"{module}\n{name}\n".encode())

    def s(self, v: str) -> None:
        b = v.encode("utf-8")
        self.w(b"X" + struct.pack("<I", len(b)) + b)

    def i(self, v: int) -> None:
        if 0 <= v < 256:
            self.w(b"K" + bytes([v]))
        elif 0 <= v < 65536:
            self.w(b"M" + struct.pack("<H", v))
        elif -(1 << 31) <= v < (1 << 31):
            self.w(b"J" + struct.pack("<i", v))
        else:
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            self.w(b"\x8a" + bytes([len(raw)]) + raw)

    def ints(self, t) -> None:
        self.w(b"(")
        for v in t:
            self.i(int(v))
        self.w(b"t")

    def size(self, t) -> None:
        """torch.Size(t): REDUCE(torch.Size, (tuple,))."""
        self.glob("torch", "Size")
        self.ints(t)
        self.w(b"\x85R")

    def none(self) -> None:
        self.w(b"N")

    def obj(self, module: str, name: str, items) -> None:
        """A dataclass instance: NEWOBJ(cls) + BUILD(state dict). ``items``: [(field, writer fn)]."""
        self.glob(module, name)
        self.w(b")\x81}")
        if items:
            self.w(b"(")
            for k, fn in items:
                self.s(k)
                fn()
            self.w(b"u")
        self.w(b"b")

    def bytes(self) -> bytes | None:
        """End the pickle; its bytes when written into memory."""
        self.w(b".")
        return self.buf.getvalue() if self.own else None


def dump_metadata(tensors: dict, objects: list[str], storage: dict, checkpoint_id: str, out=None) -> bytes | None:
    """The ``.metadata`` pickle of a checkpoint (written into the binary file ``out`` if given, else returned).

    ``tensors``: key -> (global shape, dtype name, [(chunk offsets, chunk sizes)]);
    ``objects``: keys of byte (ShardedObject) items; ``storage``: (key, offsets or None) ->
    (relative path, byte offset, length), offsets None for objects.
    """
    e = _Emit(out)

    def tensor_md(shape, dtype, chunks):
        def props():  # TensorProperties.__getstate__: (dtype, layout, requires_grad, mem format enc, pin)
            e.glob(_MD, "TensorProperties")
            e.w(b")\x81(")
            e.glob("torch", dtype)
            e.glob("torch.serialization", "_get_layout")
            e.s("torch.strided")
            e.w(b"\x85R\x89")
            e.glob(_MD, "_MEM_FORMAT_ENCODING")
            e.i(0)
            e.w(b"\x85R\x89tb")

        def chunk_list():
            e.w(b"](")
            for off, sz in chunks:
                e.obj(_MD, "ChunkStorageMetadata", [("offsets", lambda o=off: e.size(o)),
                                                     ("sizes", lambda s=sz: e.size(s))])
            e.w(b"e")

        e.obj(_MD, "TensorStorageMetadata", [("properties", props), ("size", lambda: e.size(shape)),
                                             ("chunks", chunk_list)])

    def sd_md():
        e.w(b"}(")
        for key, (shape, dtype, chunks) in tensors.items():
            e.s(key)
            tensor_md(shape, dtype, chunks)
        for key in objects:
            e.s(key)
            e.obj(_MD, "BytesStorageMetadata", [])
        e.w(b"u")

    def storage_data():
        e.w(b"}(")
        for (key, off), (path, start, length) in storage.items():
            e.obj(_MD, "MetadataIndex", [("fqn", lambda k=key: e.s(k)), ("index", e.none),
                                         ("offset", (lambda o=off: e.size(o)) if off is not None else e.none)])
            e.obj(_FS, "_StorageInfo", [("relative_path", lambda p=path: e.s(p)), ("offset", lambda s=start: e.i(s)),
                                        ("length", lambda n=length: e.i(n))])
        e.w(b"u")

    def storage_meta():
        e.obj(_MD, "StorageMeta", [("checkpoint_id", lambda: e.s(checkpoint_id)), ("save_id", e.none),
                                   ("load_id", e.none), ("modules", lambda: e.w(b"]"))])

    e.obj(_MD, "Metadata", [("state_dict_metadata", sd_md), ("planner_data", e.none),
                            ("storage_data", storage_data), ("storage_meta", storage_meta), ("version", e.none)])
    return e.bytes()


# ---------------------------------------------------------------------------------------------- reading
class _Foreign(pickle.UnpicklingError):
    """The metadata holds more than DCP's plain classes (not a defect: DCP's own reader is used then)."""


class Record:
    """Stand-in for a DCP metadata dataclass: the pickled state becomes attributes."""

    _name = "Record"

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif self._name == "TensorProperties":  # (dtype, layout, requires_grad, mem format, pin)
            self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state
        else:
            raise _Foreign(f"unexpected state of {self._name}")

    def __repr__(self):
        return f"{self._name}({self.__dict__})"


_RECORDS = {n: type(n, (Record,), {"_name": n}) for n in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_StorageInfo")}


class DType(str):
    """A torch dtype by name (``DType("bfloat16")``) with its ``itemsize``; compares equal to the name."""

    SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}

    @property
    def itemsize(self) -> int:
        return self.SIZES[self]

    def torch(self):
        import torch

        return getattr(torch, self)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module in (_MD, _FS) and name in _RECORDS:
            return _RECORDS[name]
        if module == _MD and name == "_MEM_FORMAT_ENCODING":
            return int
        if module == "torch" and name == "Size":
            return tuple
        if module == "torch" and name in DType.SIZES:
            return DType(name)
        if module == "torch.serialization" and name == "_get_layout":
            return str
        if module in ("builtins", "collections") and name in ("list", "dict", "tuple", "set", "OrderedDict"):
            return super().find_class(module, name)
        raise _Foreign(f"{module}.{name}")


def load_metadata(path: str):
    """The metadata with plain records in place of DCP's classes, or None if the file holds anything else.
    A truncated or damaged file raises (pickle.UnpicklingError, EOFError, ...): it is not "anything else"."""
    with open(path, "rb") as f:
        try:
            md = _Unpickler(f).load()
        except _Foreign:
            return None
    return md if isinstance(md, _RECORDS["Metadata"]) else None


def check_torch_dist(ckpt_dir: str) -> None:
    """ValueError naming the file when ``ckpt_dir`` is not a complete megatron torch_dist checkpoint: no
    ``metadata.json`` / ``.metadata``, a ``.metadata`` cut short, or a ``.distcp`` file that is missing or shorter
    than the byte ranges ``.metadata`` places in it (a copy cut short). Reads headers and sizes only; a
    ``.metadata`` holding more than DCP's plain classes (``load_metadata`` None) is left to DCP's reader."""
    if not os.path.isdir(ckpt_dir):
        raise ValueError(f"{ckpt_dir}: not a directory (a torch_dist checkpoint is one)")
    cfg = os.path.join(ckpt_dir, "metadata.json")
    try:
        with open(cfg, encoding="utf-8") as f:
            ok = isinstance(json.load(f), dict)
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{cfg}: missing or not JSON: {ckpt_dir} is not a megatron torch_dist checkpoint")
    meta = os.path.join(ckpt_dir, ".metadata")
    if not os.path.isfile(meta):
        raise ValueError(f"{meta}: missing: {ckpt_dir} is not a complete torch_dist checkpoint")
    try:
        with open(meta, "rb") as f:
            md = _Unpickler(f).load()
    except pickle.UnpicklingError as err:
        if "truncated" not in str(err):  # a class beyond DCP's plain ones (find_class): DCP's reader decides
            return
        md = err
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as err:
        md = err
    if isinstance(md, Exception) or not isinstance(md, _RECORDS["Metadata"]):
        raise ValueError(f"{meta}: unreadable ({type(md).__name__}: {md}); the checkpoint is truncated or "
                         f"damaged")
    need: dict[str, int] = {}
    for s in getattr(md, "storage_data", {}).values():
        need[s.relative_path] = max(need.get(s.relative_path, 0), int(s.offset) + int(s.length))
    for rel, end in sorted(need.items()):
        path = os.path.join(ckpt_dir, rel)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size is None or size < end:
            got = "missing" if size is None else f"{size} bytes, .metadata places data up to byte {end}"
            raise ValueError(f"{path}: {got}; the checkpoint is truncated or damaged")

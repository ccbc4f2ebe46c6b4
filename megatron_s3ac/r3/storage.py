"""Routed experts at rest and on the wire: the smallest integer dtype that holds an expert id.

A sample's routes are ``[P + R - 1, num_layers, top_k]`` (SGLang's R3 layout, see rollout/base.py).
SGLang ships them as base64 of int32: 4 bytes per id, x4/3 for base64. Expert ids need
ceil(log2(num_experts)) bits, so uint8 covers <= 256 experts (1 byte) and int16 <= 32768 (2 bytes):
4x-5.3x less in the rollout buffer, between processes and on the host, which is where R3's memory
goes (a 32K-token sample of a 48-layer top-8 model is 50 MB as int32, 12.6 MB as uint8).

``pack_routes`` / ``unpack_routes`` add a 16-byte header (dtype code + shape) so a routes blob is
self-describing; the payload is the raw little-endian array, no base64.
"""
from __future__ import annotations

import struct

import numpy as np

from megatron_s3ac.rollout.base import routed_experts_dtype

_DTYPES = {1: np.dtype("u1"), 2: np.dtype("<i2"), 4: np.dtype("<i4")}
_CODES = {v: k for k, v in _DTYPES.items()}
_HEADER = struct.Struct("<4sIII")  # magic, dtype code (= itemsize), rows, (num_layers << 16) | top_k
_MAGIC = b"R3r1"


def compact_routes(routes, num_experts: int) -> np.ndarray:
    """Any integer array of expert ids -> the same values in ``routed_experts_dtype(num_experts)``.

    Raises if an id is outside [0, num_experts) (a narrowing cast would wrap it silently).
    """
    arr = np.asarray(routes)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"expert ids must be integers, got {arr.dtype}")
    dtype = routed_experts_dtype(num_experts)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= num_experts):
        raise ValueError(f"expert ids outside [0, {num_experts}): min {arr.min()}, max {arr.max()}")
    return arr.astype(dtype, copy=False)


def pack_routes(routes: np.ndarray) -> bytes:
    """[rows, num_layers, top_k] compact array -> bytes (16-byte header + raw little-endian ids)."""
    if routes.ndim != 3:
        raise ValueError(f"routes must be [rows, num_layers, top_k], got shape {routes.shape}")
    dtype = routes.dtype.newbyteorder("<") if routes.dtype.itemsize > 1 else routes.dtype
    if dtype not in _CODES:
        raise TypeError(f"routes must be uint8/int16/int32 (see compact_routes), got {routes.dtype}")
    rows, layers, top_k = routes.shape
    if layers >= 1 << 16 or top_k >= 1 << 16:
        raise ValueError(f"num_layers {layers} / top_k {top_k} do not fit the header")
    header = _HEADER.pack(_MAGIC, _CODES[dtype], rows, (layers << 16) | top_k)
    return header + np.ascontiguousarray(routes, dtype=dtype).tobytes()


def unpack_routes(blob: bytes | memoryview) -> np.ndarray:
    """Inverse of ``pack_routes``: a read-only array viewing ``blob`` (no copy)."""
    magic, code, rows, lk = _HEADER.unpack_from(blob, 0)
    if magic != _MAGIC or code not in _DTYPES:
        raise ValueError("not a packed routes blob")
    layers, top_k = lk >> 16, lk & 0xFFFF
    arr = np.frombuffer(blob, dtype=_DTYPES[code], offset=_HEADER.size)
    if arr.size != rows * layers * top_k:
        raise ValueError(f"routes blob holds {arr.size} ids, header says {rows}x{layers}x{top_k}")
    return arr.reshape(rows, layers, top_k)


def routes_bytes_per_token(num_layers: int, top_k: int, num_experts: int) -> int:
    """Bytes one token's routes take in our compact storage (all layers, as SGLang returns them)."""
    return num_layers * top_k * routed_experts_dtype(num_experts).itemsize


def sglang_bytes_per_token(num_layers: int, top_k: int) -> float:
    """Bytes per token of SGLang's wire format: base64 (4/3) of int32 ids."""
    return num_layers * top_k * 4 * 4 / 3

"""Offline HF safetensors -> megatron-core torch_dist checkpoint, streamed chunk by chunk.

No model is built and no process group is started: the plan says which HF rows form which region
of which checkpoint tensor. Every part is a contiguous byte range of a safetensors file, so each chunk
is written as a ``torch.save`` blob (the format DCP reads) whose zip records are built by hand
(``dcp_io.torch_save_parts``) around the chunk's byte ranges (the fused QKV interleave is a list of
row-block ranges), which the kernel copies file-to-file (``copy_file_range``, like ``cp``; small
chunks and the zip records go through one 512 KiB buffer per worker): a chunk is never materialised,
memory stays flat whatever the model size, and ``workers`` threads write separate ``.distcp`` files
in parallel. This path imports neither torch nor numpy nor megatron (start-up is a large part of
converting a few GB). Like ``cp``, nothing is fsynced: the data is in the page cache when the command
returns. The result loads with
``dist_checkpointing.load(model.sharded_state_dict(), dir)`` at any TP/PP/EP/ETP.

Carried tensors (``plan.carried_prefixes``: Qwen3.5's vision tower and MTP head) are copied the same
way, as is, under ``s3ac_carried.<HF name>`` (``plan.with_carried``); ``mcore-to-hf`` writes them back.

The checkpoint directory also holds ``s3ac_convert.json`` (the HF config and what the converter
derived from it) and ``hf_config/`` (config, tokenizer and generation config files), so
``mcore-to-hf`` and ``verify`` know the architecture.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass

from megatron_s3ac.convert.dcp_io import DistcpWriter
from megatron_s3ac.convert.dcp_meta import DType
from megatron_s3ac.convert.outdir import check_absent, copy_side_files, staged_output
from megatron_s3ac.convert.plan import Chunk, ConversionError, Plan, build_plan, with_carried
from megatron_s3ac.convert.qwen import layers_are_stacked
from megatron_s3ac.convert.safetensors_io import HFCheckpoint
from megatron_s3ac.models.registry import model_info

META_FILE = "s3ac_convert.json"
HF_CONFIG_DIR = "hf_config"
# Start a new .distcp file after this many bytes. Copying 2.9 GB into one file cost ~35% more kernel
# time here than into files of <= 1 GiB (like cp's ~1 GB shards; micro-benchmark of copy_file_range):
# presumably write-back, once past its background threshold, then works on the file being appended to.
FILE_BYTES = 1 << 30


@dataclass
class ConvertStats:
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9

    def summary(self, what: str) -> str:
        return f"{what}: {self.bytes / 1e9:.3f} GB in {self.seconds:.2f} s = {self.gbps:.2f} GB/s"


def validate_hf(plan: Plan, ckpt: HFCheckpoint) -> None:
    """Every tensor the plan needs exists with the expected shape; nothing unknown is dropped silently."""
    for name, shape in plan.hf_shapes.items():
        if name not in ckpt.where:
            raise ConversionError(f"missing tensor {name} (expected shape {list(shape)}) in the HF checkpoint "
                                  f"{ckpt.dir}")
        if ckpt.shape(name) != shape:
            raise ConversionError(f"{ckpt.where[name].path}: tensor {name} has shape {list(ckpt.shape(name))}, "
                                  f"expected {list(shape)} from config.json")
    unknown = sorted(set(ckpt.where) - set(plan.hf_shapes) - plan.ignorable_hf)
    if unknown:
        more = f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise ConversionError(f"HF checkpoint {ckpt.dir} has tensors the {plan.info.model_type} mapping does not "
                              f"know: {', '.join(unknown[:5])}{more}")


def key_dtypes(plan: Plan, ckpt: HFCheckpoint) -> dict[str, DType]:
    """Checkpoint key -> dtype (that of its HF sources; a key's sources must agree)."""
    out: dict[str, DType] = {}
    for ch in plan.chunks:
        for p in ch.parts:
            dt = ckpt.dtype(p.hf)
            if out.setdefault(ch.key, dt) != dt:
                raise ConversionError(f"HF tensors feeding {ch.key} have different dtypes ({out[ch.key]} and {dt} "
                                      f"for {p.hf})")
    return out


def chunk_segments(ch: Chunk, ckpt: HFCheckpoint, dtype: DType) -> list[tuple]:
    """The chunk's bytes as [(fd, offset, nbytes)] ranges of the safetensors files (None fd: zeros).
    Every part is a row range, hence one contiguous byte range: the chunk is never materialised."""
    segs = [ckpt.row_range(p.hf, p.start, p.stop) for p in ch.parts]
    pad = ch.numel * dtype.itemsize - sum(n for _, _, n in segs)
    return segs + ([(None, 0, pad)] if pad else [])


def _split(chunks: list[Chunk], n: int) -> list[list[Chunk]]:
    """Greedy balance by size, keeping each worker's chunks in plan order (sequential reads)."""
    loads, out = [0] * n, [[] for _ in range(n)]
    for ch in sorted(chunks, key=lambda c: -c.numel):
        i = loads.index(min(loads))
        loads[i] += ch.numel
        out[i].append(ch)
    order = {id(c): k for k, c in enumerate(chunks)}
    return [sorted(lst, key=lambda c: order[id(c)]) for lst in out]


class _Progress:
    """tqdm bar (imported only when shown) behind a lock; a no-op when progress is off."""

    def __init__(self, total: int, show: bool):
        self.bar, self.lock = None, threading.Lock()
        if show:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="hf-to-mcore")

    def update(self, n: int) -> None:
        if self.bar is not None:
            with self.lock:
                self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def hf_to_mcore(hf_dir: str, out_dir: str, workers: int = 1, progress: bool = True) -> ConvertStats:
    """Convert ``hf_dir`` into a new torch_dist checkpoint directory ``out_dir``."""
    check_absent(out_dir)
    info = model_info(hf_dir)
    plan = build_plan(info)
    ckpt = HFCheckpoint(hf_dir)
    try:
        plan = with_carried(plan, carried_in(plan, ckpt))
        validate_hf(plan, ckpt)
        dtypes = key_dtypes(plan, ckpt)
        total = sum(ch.numel * dtypes[ch.key].itemsize for ch in plan.chunks)
        t0 = time.time()
        with staged_output(out_dir) as tmp:
            writer = DistcpWriter(tmp)
            bar = _Progress(total, progress)
            errors: list[BaseException] = []

            def work(chunks: list[Chunk], first: bool) -> None:
                f = None
                try:
                    f = writer.open_file()
                    if first:
                        for uk in plan.objects:
                            f.write_object(uk, None)  # _extra_state: None, as the local spec saves it
                    for ch in chunks:
                        if errors:
                            return  # another worker failed: stop early
                        dt = dtypes[ch.key]
                        segs = chunk_segments(ch, ckpt, dt)
                        for key in (ch.key, *ch.aliases):
                            f.write_spliced(key, ch.global_shape, ch.offset, ch.shape, dt, segs)
                        bar.update(ch.numel * dt.itemsize)
                        if f.tell() > FILE_BYTES:
                            f.close()
                            f = writer.open_file()
                except BaseException as e:  # noqa: BLE001  (re-raised in the main thread)
                    errors.append(e)
                finally:
                    if f is not None:
                        f.close()

            shares = [s for s in _split(plan.chunks, max(1, workers)) if s] or [[]]
            if len(shares) == 1:
                work(shares[0], True)  # no thread for a single worker
            else:
                threads = [threading.Thread(target=work, args=(s, i == 0)) for i, s in enumerate(shares)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            bar.close()
            if errors:
                raise errors[0]
            writer.finish()
            write_metadata(tmp, plan, hf_dir)
        return ConvertStats(total, time.time() - t0)
    finally:
        ckpt.close()


def carried_in(plan: Plan, ckpt: HFCheckpoint) -> dict[str, tuple[tuple[int, ...], int]]:
    """The HF checkpoint's tensors the plan carries as is: {name: (shape, itemsize)}, by name."""
    if not plan.carried_prefixes:
        return {}
    return {n: (ckpt.shape(n), ckpt.dtype(n).itemsize) for n in sorted(ckpt.where) if n.startswith(plan.carried_prefixes)}


def write_metadata(ckpt_dir: str, plan: Plan, hf_dir: str | None) -> None:
    info = plan.info
    carried = [n for n in plan.hf_shapes if n.startswith(plan.carried_prefixes)] if plan.carried_prefixes else []
    meta = {"format": "megatron_s3ac.convert/1", "model_type": info.model_type, "hf_config": info.hf,
            "padded_vocab_size": info.padded_vocab_size, "layers_stacked": layers_are_stacked(info),
            "tie_embeddings": info.tie_embeddings, "carried_tensors": len(carried)}
    with open(os.path.join(ckpt_dir, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    if hf_dir:
        copy_side_files(hf_dir, os.path.join(ckpt_dir, HF_CONFIG_DIR))

"""Offline megatron-core torch_dist checkpoint -> HF safetensors shards, streamed tensor by tensor.

Accepts a checkpoint written by ``hf-to-mcore`` (architecture from its ``s3ac_convert.json``) or an
actor checkpoint saved by training with ``dist_checkpointing.save(actor.sharded_state_dict(), dir)``
at any layout (architecture from ``--hf-config``). Every HF tensor is assembled from the regions
the plan names and appended to a shard whose header was written up front; vocab padding is dropped,
a tied model gets no ``lm_head.weight``. In our own checkpoints every region is a contiguous byte
range of a ``.distcp`` file and is copied file-to-file by the kernel; other chunkings are read
(``torch.load``, weights only) by a prefetch thread, overlapping the writes. torch is imported only
for that second path: converting our own checkpoints starts in a bare interpreter (~0.1 s).

Carried tensors (``s3ac_carried.<HF name>``: Qwen3.5's vision tower and MTP head, from ``hf-to-mcore`` or
carried through training by ``carried.py``) are written back under their HF names, bit for bit (never
quantized by ``--dtype fp8``), with the checkpoint's config and processor / tokenizer files: the output is
the complete model. A vision-language config whose checkpoint carries no vision tower (e.g. an actor
trained from a random init) gets the language model only, with a warning on stderr.
"""
from __future__ import annotations

import json
import math
import os
import queue
import sys
import threading
import time

from megatron_s3ac.convert.dcp_io import DistcpCheckpoint
from megatron_s3ac.convert.hf_to_mcore import HF_CONFIG_DIR, META_FILE, ConvertStats
from megatron_s3ac.convert.outdir import check_absent, copy_side_files, staged_output
from megatron_s3ac.convert.plan import (CARRIED_KEY_PREFIX, ConversionError, Plan, build_plan, is_carried_key,
                                        part_region, with_carried)
from megatron_s3ac.convert.safetensors_io import INDEX, ShardWriter
from megatron_s3ac.models.registry import ModelInfo, check_config_types, load_hf_config, model_info

# ModelInfo fields that decide tensor names and shapes; a config that differs in any is another model.
ARCH_FIELDS = ("model_type", "num_layers", "hidden_size", "ffn_hidden_size", "num_heads", "num_kv_heads",
               "head_dim", "vocab_size", "tie_embeddings", "qkv_bias", "qk_norm", "num_experts", "top_k",
               "moe_ffn_hidden_size", "moe_layers", "shared_expert_size")


def stored_config(mcore_dir: str) -> dict | None:
    """The HF config ``hf-to-mcore`` recorded in ``mcore_dir``, None if it recorded none."""
    path = os.path.join(mcore_dir, META_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ConversionError(f"{path}: not JSON ({e}); the checkpoint is damaged") from None
    cfg = cfg.get("hf_config") if isinstance(cfg, dict) else None
    if not isinstance(cfg, dict):
        raise ConversionError(f"{path}: no hf_config object (not written by hf-to-mcore?)")
    check_config_types(cfg, f"{path} (hf_config)")
    return cfg


def resolve_config(mcore_dir: str, hf_config: str | None) -> tuple[dict, ModelInfo]:
    """The HF config of the checkpoint: ``hf_config`` if given (checked against the stored one)."""
    stored = stored_config(mcore_dir)
    if hf_config is None:
        if stored is None:
            raise ConversionError(f"{mcore_dir} has no {META_FILE} (a training checkpoint?); pass --hf-config DIR "
                                  f"with the model's config.json")
        return stored, model_info(stored)
    cfg = load_hf_config(hf_config)
    info = model_info(cfg)
    if stored is not None:
        mine = model_info(stored)
        bad = [f"{f}: checkpoint {getattr(mine, f)!r} vs --hf-config {getattr(info, f)!r}"
               for f in ARCH_FIELDS if getattr(mine, f) != getattr(info, f)]
        if bad:
            raise ConversionError(f"the checkpoint's config disagrees with --hf-config {hf_config}: " + "; ".join(bad))
    return cfg, info


def resolve_keys(plan: Plan, ck: DistcpCheckpoint) -> dict[int, str]:
    """id(chunk) -> the key (or alias) the checkpoint stores it under; shapes must match the plan."""
    out = {}
    for ch in plan.chunks:
        key = next((k for k in (ch.key, *ch.aliases) if ck.has(k)), None)
        if key is None:
            raise ConversionError(f"checkpoint {ck.dir} lacks tensor {ch.key} (shape {list(ch.global_shape)})")
        if ck.global_shape(key) != ch.global_shape:
            raise ConversionError(f"checkpoint tensor {key} has global shape {list(ck.global_shape(key))}, the config "
                                  f"implies {list(ch.global_shape)}: config and checkpoint disagree")
        out[id(ch)] = key
    return out


def plan_shards(names: list[tuple[str, tuple, object]], max_bytes: int) -> list[list]:
    """(name, shape, dtype with ``itemsize``) in order -> shards of at most ``max_bytes`` (one tensor may exceed it)."""
    shards, cur, size = [], [], 0
    for name, shape, dtype in names:
        n = math.prod(shape) * dtype.itemsize
        if cur and size + n > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape, dtype))
        size += n
    if cur:
        shards.append(cur)
    return shards


def prefetch(ck: DistcpCheckpoint, regions: list[tuple[str, tuple, tuple]], depth: int = 2):
    """Yield ``ck.read_region(*r)`` for each region, read by a background thread at most ``depth``
    regions ahead, so reading the checkpoint overlaps writing the shards (memory: depth + 1 regions)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():  # the consumer may have stopped early: never block forever
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def reader():
        try:
            for r in regions:
                if not put(ck.read_region(*r)):
                    return
        except BaseException as e:  # noqa: BLE001  (handed to the consumer)
            put(e)

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    try:
        for _ in regions:
            item = q.get()
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        th.join()


def _plan_tensors(ck: DistcpCheckpoint, mcore_dir: str, hf_config: str | None):
    """The conversion plan of ``ck``: (HF config dict, checkpoint key per chunk id, ``plan.sources()``,
    [(hf name, shape, stored DType)] in plan order)."""
    cfg, info = resolve_config(mcore_dir, hf_config)
    plan = build_plan(info)
    carried = carried_in(ck)
    if "vision_config" in cfg and not any(n.startswith("model.visual.") for n in carried):
        print(f"mcore-to-hf: warning: {mcore_dir} carries no vision tower (model.visual.*): writing the language "
              f"model only under the vision-language config", file=sys.stderr)
    plan = with_carried(plan, carried)
    keys = resolve_keys(plan, ck)
    sources = plan.sources()
    tensors = [(n, s, ck.dtype_name(keys[id(sources[n][0][0])])) for n, s in plan.hf_shapes.items()]
    return cfg, keys, sources, tensors, set(carried)


def _carried_root(name: str) -> str:
    """The sub-model a carried tensor belongs to: ``model.visual`` or ``mtp``."""
    return "model.visual" if name.startswith("model.visual.") else name.split(".", 1)[0]


def carried_in(ck: DistcpCheckpoint) -> dict[str, tuple[tuple[int, ...], int]]:
    """The carried tensors a torch_dist checkpoint stores: {HF name: (shape, itemsize)}, by name."""
    keys = sorted(k for k in ck.md.state_dict_metadata if is_carried_key(k) and ck.has(k))
    return {k[len(CARRIED_KEY_PREFIX):]: (ck.global_shape(k), ck.dtype_name(k).itemsize) for k in keys}


def mcore_to_hf(mcore_dir: str, out_dir: str, hf_config: str | None = None, max_shard_bytes: int = 5 << 30,
                progress: bool = True, dtype: str = "auto", fp8_keep=None) -> ConvertStats:
    """Write HF safetensors shards + index + config/tokenizer files of ``mcore_dir`` into new ``out_dir``.

    ``dtype``: "auto" keeps the checkpoint's dtypes; "fp8" writes block-scaled e4m3 weights +
    ``weight_scale_inv`` and a ``quantization_config`` (convert/fp8.py; ``fp8_keep``: the module
    patterns kept unquantized, default ``fp8.DEFAULT_KEEP``)."""
    from tqdm import tqdm

    if dtype not in ("auto", "fp8"):
        raise ConversionError(f"unknown --dtype {dtype!r} (auto or fp8)")
    check_absent(out_dir)
    if dtype == "fp8":
        return _mcore_to_hf_fp8(mcore_dir, out_dir, hf_config, max_shard_bytes, progress, fp8_keep)
    # Our own checkpoints store every chunk contiguous, so HF rows are byte ranges of .distcp files.
    ck = DistcpCheckpoint(mcore_dir, contiguous_chunks=stored_config(mcore_dir) is not None)
    try:
        cfg, keys, sources, tensors, _ = _plan_tensors(ck, mcore_dir, hf_config)
        total = sum(math.prod(s) * d.itemsize for _, s, d in tensors)
        shards = plan_shards(tensors, max_shard_bytes)
        t0 = time.time()
        with staged_output(out_dir) as tmp:
            bar = tqdm(total=total, unit="B", unit_scale=True, desc="mcore-to-hf", disable=not progress)
            weight_map = {}
            regions = [(keys[id(ch)], *part_region(ch, row, part.rows))
                       for name, _, _ in tensors for ch, row, part in sources[name]]
            ranges = [ck.byte_range(*r) for r in regions]
            if all(ranges):  # kernel copies only (our checkpoints)
                pieces = iter(ranges)
            else:  # any other chunking (e.g. a training save): read, assemble, write
                pieces = prefetch(ck, regions)
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                w = ShardWriter(os.path.join(tmp, fname), shard)
                for name, shape, _ in shard:
                    for ch, row, part in sources[name]:
                        piece = next(pieces)
                        if isinstance(piece, tuple):
                            bar.update(w.copy_from(*piece))
                        else:
                            bar.update(w.write(piece.reshape(part.rows, *shape[1:])))
                    weight_map[name] = fname
                w.close()
            bar.close()
            with open(os.path.join(tmp, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            _write_side_files(tmp, mcore_dir, hf_config, cfg)
        return ConvertStats(total, time.time() - t0)
    finally:
        ck.close()


def _write_side_files(out: str, mcore_dir: str, hf_config: str | None, cfg: dict) -> None:
    """config / tokenizer / generation config: from --hf-config, else those stored at conversion."""
    src = hf_config if hf_config and os.path.isdir(hf_config) else os.path.join(mcore_dir, HF_CONFIG_DIR)
    if os.path.isdir(src):
        copy_side_files(src, out)
    if not os.path.exists(os.path.join(out, "config.json")):
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)


def _mcore_to_hf_fp8(mcore_dir: str, out_dir: str, hf_config: str | None, max_shard_bytes: int, progress: bool,
                     keep) -> ConvertStats:
    """``mcore_to_hf`` with block-FP8 weights: each HF tensor is assembled in memory (read path, torch),
    quantized when ``fp8.will_quantize`` says so, and written as (name fp8, name_scale_inv fp32)."""
    import sys

    import torch
    from tqdm import tqdm

    from megatron_s3ac.convert import fp8
    from megatron_s3ac.convert.dcp_meta import DType

    try:
        keep = fp8.check_keep(fp8.DEFAULT_KEEP if keep is None else keep)
    except fp8.Fp8Error as e:
        raise ConversionError(f"--fp8-keep: {e}") from None
    ck = DistcpCheckpoint(mcore_dir, contiguous_chunks=stored_config(mcore_dir) is not None)
    try:
        cfg, keys, sources, src, carried = _plan_tensors(ck, mcore_dir, hf_config)
        quant = {n for n, s, d in src if n not in carried and fp8.will_quantize(n, s, d, keep)}
        tensors = []  # output entries: a quantized weight is followed by its scales
        for n, s, d in src:
            if n in quant:
                tensors += [(n, s, DType("float8_e4m3fn")), (n + fp8.SCALE_SUFFIX, fp8.scale_shape(s), DType("float32"))]
            else:
                tensors.append((n, s, d))
        problems = fp8.sglang_block_problems([t for t in src if t[0] not in carried], keep)
        if problems and progress:
            print(f"mcore-to-hf --dtype fp8: warning: SGLang 0.5.23 would refuse {len(problems)} tensor(s) of this "
                  f"model (transformers and the CPU engine load them): {problems[:3]}", file=sys.stderr)
        total = sum(math.prod(s) * d.itemsize for _, s, d in tensors)
        shards = plan_shards(tensors, max_shard_bytes)
        t0 = time.time()
        with staged_output(out_dir) as tmp:
            bar = tqdm(total=total, unit="B", unit_scale=True, desc="mcore-to-hf fp8", disable=not progress)
            regions = [(keys[id(ch)], *part_region(ch, row, part.rows))
                       for name, _, _ in src for ch, row, part in sources[name]]
            pieces = prefetch(ck, regions)
            weight_map, scale = {}, None
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                w = ShardWriter(os.path.join(tmp, fname), shard)
                for name, shape, _ in shard:
                    weight_map[name] = fname
                    if name.endswith(fp8.SCALE_SUFFIX) and name[: -len(fp8.SCALE_SUFFIX)] in quant:
                        bar.update(w.write(scale))
                        continue
                    rows = [next(pieces).reshape(part.rows, *shape[1:]) for _, _, part in sources[name]]
                    t = rows[0] if len(rows) == 1 else torch.cat(rows)
                    if name in quant:
                        try:
                            t, scale = fp8.quantize_blockwise(t)
                        except fp8.Fp8Error as e:
                            raise ConversionError(f"{mcore_dir}: tensor {name}: {e}") from None
                    bar.update(w.write(t))
                w.close()
            bar.close()
            with open(os.path.join(tmp, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            _write_side_files(tmp, mcore_dir, hf_config, cfg)
            path = os.path.join(tmp, "config.json")
            with open(path) as f:
                out_cfg = json.load(f)
            qc = fp8.quantization_config([t for t in src if t[0] not in carried], keep)
            # carried sub-models (vision tower, MTP) stay in their stored dtype: loaders must not expect scales
            qc["modules_to_not_convert"] += sorted({_carried_root(n) for n in carried})
            out_cfg["quantization_config"] = qc
            with open(path, "w") as f:
                json.dump(out_cfg, f, indent=2)
        return ConvertStats(total, time.time() - t0)
    finally:
        ck.close()

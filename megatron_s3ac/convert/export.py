"""In-memory export of a live, sharded megatron model as HF tensors (rollout weight sync).

The model's own ``sharded_state_dict()`` says where every local tensor sits in the global,
layout-independent checkpoint tensors (TP shards, experts, layers, the swiglu [gate; up] split are
all global offsets there). The conversion plan says which global regions make each HF tensor. So
the export is: exchange the metadata of all main-replica pieces inside the pipeline stage, then, bucket
by bucket, every rank sends the parts of its pieces that the bucket needs to the stage leader,
which assembles the HF tensors. There is no TP/EP/ETP/PP-specific code: every layout works the same
way (main replicas only, so DP copies are never sent).

Collective: every rank of a pipeline stage (``get_tensor_and_data_parallel_group(with_context_parallel=True)``:
all ranks with that PP rank) must iterate the generator to the end, in lockstep. The stage leader
(rank 0 of that group: tp = ep = dp = 0) yields lists of full ``(hf_name, tensor)``; every other rank
yields an empty list per bucket. Each stage emits only its own layers (the first stage the embedding,
the last the final norm and, when untied, ``lm_head``). Tensors keep the model's dtype and device.
Names are the plan's, i.e. those of the HF checkpoint layout of ``info.model_type`` (for a
vision-language checkpoint such as ``qwen3_5_moe``: ``model.language_model.*``; no vision tensors).
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_s3ac.convert.plan import Plan, box_slices, build_plan, overlap, part_region
from megatron_s3ac.models.registry import ModelInfo


def local_pieces(model_chunks) -> list[tuple[str, tuple, tuple, torch.Tensor]]:
    """(key, global offset, shape, data) of every main-replica tensor this rank holds."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    out = []
    for m in model_chunks:
        sd = m.sharded_state_dict()
        apply_factories(sd)
        for st in nested_values(sd):
            if isinstance(st, ShardedTensor) and is_main_replica(st.replica_id):
                if st.flattened_range is not None:
                    raise NotImplementedError(f"{st.key}: flattened (optimizer-style) shards are not exported")
                # prepended axes (layer / expert) have size 1 in the global box
                shape = (1,) * st.prepend_axis_num + tuple(st.data.shape)
                out.append((st.key, tuple(st.global_offset), shape, st.data.detach().reshape(shape)))
    return out


def _pad8(n: int) -> int:
    return n + (-n % 8)


def _padded_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat bytes of ``t``, zero-padded to a multiple of 8 so every piece in a buffer stays aligned
    for ``.view(dtype)`` on the receiving side, whatever dtypes a bucket mixes."""
    b = t.contiguous().view(torch.uint8).reshape(-1)
    pad = -b.numel() % 8
    return torch.cat([b, b.new_zeros(pad)]) if pad else b


def _owned_names(plan: Plan, sources, index) -> tuple[list[str], dict]:
    """HF tensors whose every region is held in this stage, and the key chosen for each chunk."""
    keys, names = {}, []
    for name in plan.hf_shapes:
        ok = True
        for ch, _, _ in sources[name]:
            key = next((k for k in (ch.key, *ch.aliases) if k in index), None)
            if key is None:
                ok = False
                break
            have = sum(math.prod(ov[1]) for (_, off, shp, _, _) in index[key]
                       if (ov := overlap(ch.offset, ch.shape, off, shp)) is not None)
            if have != ch.numel:
                ok = False
                break
            keys[id(ch)] = key
        if ok:
            names.append(name)
    return names, keys


def _buckets(plan: Plan, names: list[str], itemsize: dict, bucket_bytes: int) -> list[list[str]]:
    out, cur, size = [], [], 0
    for n in names:
        b = math.prod(plan.hf_shapes[n]) * itemsize[n]
        if cur and size + b > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += b
    return out + ([cur] if cur else [])


def export_hf_weights(model_chunks, info: ModelInfo, bucket_bytes: int = 1 << 30,
                      group=None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets (each at most ``bucket_bytes``, or one tensor) of ``(hf_name, tensor)``.

    ``model_chunks``: this rank's model chunks (a list, one per virtual pipeline stage). The leader of
    each pipeline stage yields the full HF tensors of that stage; the other ranks yield ``[]``.
    """
    from megatron.core import parallel_state as ps

    if group is None:
        group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    me, n = dist.get_rank(group), dist.get_world_size(group)
    leader = dist.get_global_rank(group, 0)
    plan = build_plan(info)
    sources = plan.sources()
    pieces = local_pieces(model_chunks)
    metas = [None] * n
    dist.all_gather_object(metas, [(k, o, s, p.dtype) for k, o, s, p in pieces], group=group)
    index: dict[str, list] = {}  # key -> [(group rank, offset, shape, dtype, piece index on that rank)]
    for r, lst in enumerate(metas):
        for i, (k, o, s, dt) in enumerate(lst):
            index.setdefault(k, []).append((r, o, s, dt, i))
    names, keys = _owned_names(plan, sources, index)
    dtypes = {nm: index[keys[id(sources[nm][0][0])]][0][3] for nm in names}
    itemsize = {nm: dt.itemsize for nm, dt in dtypes.items()}
    device = pieces[0][3].device if pieces else torch.device("cpu")

    for bucket in _buckets(plan, names, itemsize, bucket_bytes):
        # The global boxes the bucket needs, and which rank's piece overlaps each (same order everywhere).
        regions = [(nm, ch, part_region(ch, row, part.rows), part) for nm in bucket for ch, row, part in sources[nm]]
        transfers = [(r, ri, ov, pi) for ri, (_, ch, (off, shp), _) in enumerate(regions)
                     for (r, o, s, _, pi) in index[keys[id(ch)]]
                     if (ov := overlap(off, shp, o, s)) is not None]
        if me != 0:
            mine = [pieces[pi][3][box_slices(*ov, pieces[pi][1])] for (r, _, ov, pi) in transfers if r == me]
            if mine:
                buf = torch.cat([_padded_bytes(t) for t in mine])
                dist.send(buf, dst=leader, group=group)
            yield []
            continue
        out = {}
        for ri, (nm, _, (off, shp), _) in enumerate(regions):
            out[ri] = (off, torch.empty(shp, dtype=dtypes[nm], device=device))
        for r in range(n):
            lst = [(ri, ov, pi) for (rr, ri, ov, pi) in transfers if rr == r]
            if not lst:
                continue
            if r == 0:
                chunks = [pieces[pi][3][box_slices(*ov, pieces[pi][1])] for ri, ov, pi in lst]
            else:
                sizes = [math.prod(ov[1]) * out[ri][1].element_size() for ri, ov, _ in lst]
                buf = torch.empty(sum(_pad8(sz) for sz in sizes), dtype=torch.uint8, device=device)
                dist.recv(buf, src=dist.get_global_rank(group, r), group=group)
                chunks, at = [], 0
                for (ri, ov, _), sz in zip(lst, sizes):
                    chunks.append(buf[at:at + sz].view(out[ri][1].dtype).view(ov[1]))
                    at += _pad8(sz)
            for (ri, ov, _), t in zip(lst, chunks):
                off, dst = out[ri]
                dst[box_slices(*ov, off)] = t
        result = []
        for nm in bucket:
            rows = [out[ri][1].reshape(part.rows, *plan.hf_shapes[nm][1:])
                    for ri, (n2, _, _, part) in enumerate(regions) if n2 == nm]
            result.append((nm, rows[0] if len(rows) == 1 else torch.cat(rows)))
        yield result

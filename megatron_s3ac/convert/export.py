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
vision-language checkpoint such as ``qwen3_5_moe``: ``model.language_model.*``; the vision tower only when it
trains, as ``model.visual.*``, after the language model's buckets).
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


def _pad8(n: int) -> int:
    return n + (-n % 8)


def attach_shared(name: str, nbytes: int) -> torch.Tensor:
    """Another process's POSIX shared-memory segment (multiprocessing.shared_memory name) as a uint8 tensor, mapped
    shared (writes by its owner are seen), Linux /dev/shm."""
    return torch.from_file(f"/dev/shm/{name.lstrip('/')}", shared=True, size=int(nbytes), dtype=torch.uint8)


def group_device(group) -> torch.device:
    """Where every tensor a collective or message of ``group`` carries lives: the current CUDA device on an NCCL
    group, the host otherwise (gloo). One answer per group, from its backend, the same on every rank: a rank's
    own tensors cannot decide it, since a rank may hold none (megatron gives the main replicas to DP rank 0 only,
    so every DP rank > 0 exports nothing) and would take another path than the rank that holds them."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _signature(model_chunks) -> tuple:
    """Identity of the parameters an export plan holds views of (a re-assigned ``p.data`` changes it)."""
    return tuple((id(p), p.data_ptr()) for m in model_chunks for p in m.parameters())


class _ExportPlan:
    """Everything about an export that does not change between syncs: this rank's pieces (views of the
    live parameters), the stage's metadata, the HF names, buckets and per-bucket transfers. Built
    once (collective: one ``all_gather_object`` per stage) and reused while the parameters are the same
    tensors (``_signature``): an optimizer step updates them in place, so later syncs skip
    ``sharded_state_dict`` and the metadata exchange."""

    def __init__(self, model_chunks, info: ModelInfo, bucket_bytes: int, group, shm: bool = False):
        self.signature = _signature(model_chunks)
        me, n = dist.get_rank(group), dist.get_world_size(group)
        plan = build_plan(info)
        sources = plan.sources()
        self.pieces = local_pieces(model_chunks)
        # Reusable only if every piece is a view of a parameter (a factory that copies would go stale).
        owned = {p.untyped_storage().data_ptr() for m in model_chunks for p in m.parameters()}
        self.reusable = all(t.untyped_storage().data_ptr() in owned for _, _, _, t in self.pieces)
        metas = [None] * n
        dist.all_gather_object(metas, [(k, o, s, p.dtype) for k, o, s, p in self.pieces], group=group)
        index: dict[str, list] = {}  # key -> [(group rank, offset, shape, dtype, piece index on that rank)]
        for r, lst in enumerate(metas):
            for i, (k, o, s, dt) in enumerate(lst):
                index.setdefault(k, []).append((r, o, s, dt, i))
        names, keys = _owned_names(plan, sources, index)
        self.dtypes = {nm: index[keys[id(sources[nm][0][0])]][0][3] for nm in names}
        itemsize = {nm: dt.itemsize for nm, dt in self.dtypes.items()}
        # the transfers' and the leader's assembly device, and so whether the shared-memory path applies (host only)
        self.device = group_device(group)
        self.hf_shapes = plan.hf_shapes
        self.buckets = []
        for bucket in _buckets(plan, names, itemsize, bucket_bytes):
            # The global boxes the bucket needs (in HF row order), and which rank's piece overlaps
            # each; the same order on every rank, so sends and receives pair up.
            regions = [(nm, keys[id(ch)], part_region(ch, row, part.rows))
                       for nm in bucket for ch, row, part in sources[nm]]
            transfers = [(r, ri, ov, pi) for ri, (_, key, (off, shp)) in enumerate(regions)
                         for (r, o, s, _, pi) in index[key] if (ov := overlap(off, shp, o, s)) is not None]
            by_rank = {r: [(ri, ov, pi) for (rr, ri, ov, pi) in transfers if rr == r] for r in range(n)}
            self.buckets.append((bucket, regions, by_rank))
        self.me = me
        self._share(group, me, n, shm)
        # gloo/NCCL open a point-to-point connection on first use: open them now (one tiny message
        # per sender), so the first sync does not pay it inside its transfers.
        leader = dist.get_global_rank(group, 0)
        senders = sorted(r for r in range(1, n) if any(by_rank.get(r) for _, _, by_rank in self.buckets))
        ping = torch.zeros(1, device=self.device)
        if me in senders:
            dist.send(ping, dst=leader, group=group)
        elif me == 0:
            for r in senders:
                dist.recv(ping, src=dist.get_global_rank(group, r), group=group)

    def _share(self, group, me: int, n: int, shm: bool) -> None:
        """CPU ranks on the leader's host hand their pieces over in shared memory: each writes a bucket's pieces into
        a POSIX segment of its own (one copy) and sends a one-word "ready"; the leader copies them into place straight
        from the segment (one copy) and acknowledges. No bytes cross a socket; on a shared, busy host gloo's loopback
        transfers were the sync's largest cost. On by default (``shm_default``; S3AC_EXPORT_SHM=0 turns it off); never
        on an NCCL group (``group_device``: decided from the group's backend, the same on every rank, so all of them
        join or skip the hand-shake below) or for ranks on other hosts. Each plan has its own segments, so every
        rank of the stage must run the same plan (``_plan_for`` checks): a rank on another plan once left the leader reading a stale segment."""
        import socket

        self.shm, self.shm_buf, self.peers = None, None, {}
        if self.device.type != "cpu" or n == 1 or not shm:
            return
        need = 0
        if me != 0:
            need = max((sum(_pad8(math.prod(ov[1]) * self.pieces[pi][3].element_size()) for _, ov, pi in
                            by_rank.get(me, ())) for _, _, by_rank in self.buckets), default=0)
        if need:
            from multiprocessing.shared_memory import SharedMemory

            self.shm = SharedMemory(create=True, size=need)
            self.shm_buf = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=need)
            self.shm_buf.zero_()  # allocate every page now (plan build), not on the first sync's writes
        # (host, size, segment name) of every rank as one fixed-size tensor each (no object collective)
        import zlib

        mine = torch.zeros(64, dtype=torch.uint8)
        mine[:16].view(torch.int64)[:] = torch.tensor([zlib.crc32(socket.gethostname().encode()), need])
        name = (self.shm.name if self.shm else "").encode()
        assert len(name) <= 48, name
        mine[16:16 + len(name)] = torch.frombuffer(bytearray(name), dtype=torch.uint8) if name else mine[16:16]
        got = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(got, mine, group=group)
        rows = [(int(g[:8].view(torch.int64)), int(g[8:16].view(torch.int64)),
                 bytes(g[16:].numpy()).rstrip(b"\0").decode()) for g in got]
        rows = [(h, nm or None, size) for h, size, nm in rows]
        if me != 0 and self.shm is not None and rows[me][0] != rows[0][0]:
            self._unshare()  # the leader is on another host: gloo messages
        if me == 0:
            for r, (host, name, size) in enumerate(rows):
                if r and name and host == rows[0][0]:
                    # mapped without multiprocessing's resource tracker (which would unlink it at exit): its owner does
                    self.peers[r] = (name, attach_shared(name, size))
        for _, seg in self.peers.values():  # its owner allocated the pages before the all_gather: map them now
            int(seg[::4096].sum())
        dist.barrier(group=group)
        if self.shm is not None:  # mapped by the leader: the name can go now (nothing leaks if a rank is killed)
            self.shm.unlink()

    def _unshare(self) -> None:
        if self.shm is not None:
            self.shm_buf = None
            try:
                self.shm.close()
                self.shm.unlink()
            except (BufferError, FileNotFoundError):
                pass
            self.shm = None

    def __del__(self):
        try:
            self._unshare()
        except Exception:
            pass

    def piece_slice(self, ov, pi) -> torch.Tensor:
        return self.pieces[pi][3][box_slices(*ov, self.pieces[pi][1])]


def shm_default() -> bool:
    """Whether exports hand TP/EP pieces over in shared memory when not told: yes (CPU ranks on the leader's host
    only; elsewhere it never applies), unless the environment says S3AC_EXPORT_SHM=0."""
    import os

    return os.environ.get("S3AC_EXPORT_SHM", "1") != "0"


def _plan_for(model_chunks, info, bucket_bytes, group, shm: bool) -> _ExportPlan:
    """The cached plan of these chunks, rebuilt (collectively) when any rank's parameters changed."""
    cache = model_chunks[0].__dict__.setdefault("_s3ac_export_plans", {})
    key = (bucket_bytes, id(group), len(model_chunks), info.model_type, bool(shm))
    plan = cache.get(key)
    # stale anywhere -> rebuilt everywhere; and every rank must ask for the same plan: a rank exporting with other
    # buckets would pair its pieces with the wrong transfers (with the shared-memory handoff: a stale segment read)
    ask = (int(bucket_bytes), int(bool(shm)), len(model_chunks))
    stale = torch.tensor([plan is None or not plan.reusable or plan.signature != _signature(model_chunks),
                          *ask, *(-x for x in ask)], dtype=torch.int64)
    stale = stale.to(group_device(group))
    dist.all_reduce(stale, op=dist.ReduceOp.MAX, group=group)
    hi, lo = stale[1:4].tolist(), [-x for x in stale[4:7].tolist()]
    if hi != lo:
        raise ValueError(f"export_hf_weights: the ranks of a pipeline stage disagree on (bucket_bytes, shm, model "
                         f"chunks): from {tuple(lo)} to {tuple(hi)}; rank {dist.get_rank()} asked for {ask}")
    if int(stale[0].item()):
        plan = cache[key] = _ExportPlan(model_chunks, info, bucket_bytes, group, shm)
    return plan


def prepare_export(model_chunks, info: ModelInfo, bucket_bytes: int = 1 << 30, group=None,
                   shm: bool | None = None) -> None:
    """Build (collectively) the export plan ``export_hf_weights`` with the same arguments would build on its first
    call: pieces, metadata exchange, buckets, point-to-point connections and shared-memory segments (pages touched).
    Call it at start-up so the first sync costs what the later ones do."""
    from megatron.core import parallel_state as ps

    if group is None:
        group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    _plan_for(list(model_chunks), info, bucket_bytes, group, shm_default() if shm is None else shm)


def export_hf_weights(model_chunks, info: ModelInfo, bucket_bytes: int = 1 << 30,
                      group=None, into=None, shm: bool | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets (each at most ``bucket_bytes``, or one tensor) of ``(hf_name, tensor)``.

    ``model_chunks``: this rank's model chunks (a list, one per virtual pipeline stage). The leader of
    each pipeline stage yields the full HF tensors of that stage; the other ranks yield ``[]``.

    Each rank sends exactly the pieces it owns, one message per piece, straight from the parameter's
    memory when contiguous; the leader receives each piece directly into its place in the final HF
    tensor when that place is contiguous (row splits), else via one temporary (column splits), and
    an HF tensor that is one contiguous piece of its own is yielded as a view without any copy
    (consumers copy it; they must not modify it).

    ``into(hf_name, shape, dtype) -> tensor | None`` (leader only; e.g. ``CPUEngine.weight_buffer``):
    memory to assemble an HF tensor in (the consumer's own), instead of a new tensor or a view.
    """
    from megatron.core import parallel_state as ps

    if group is None:
        group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    plan = _plan_for(list(model_chunks), info, bucket_bytes, group, shm_default() if shm is None else shm)
    me = plan.me
    leader = dist.get_global_rank(group, 0)
    word = torch.ones(1, dtype=torch.int64, device=plan.device)
    for bucket, regions, by_rank in plan.buckets:
        if me != 0 and plan.shm is not None:
            at = 0
            for ri, ov, pi in by_rank.get(me, ()):
                src = plan.piece_slice(ov, pi)
                nb = src.numel() * src.element_size()
                plan.shm_buf[at:at + nb].view(src.dtype).view(src.shape).copy_(src)
                at = _pad8(at + nb)
            if by_rank.get(me):
                dist.send(word, dst=leader, group=group)
                # the leader has read the bucket out of the segment; taken before yielding, so this pair's
                # messages never interleave with what the consumer exchanges between buckets (weight_sync)
                dist.recv(word, src=leader, group=group)
            yield []
            continue
        if me != 0:
            # every piece of the bucket posted at once (one wait per bucket, not a round trip per piece: on a busy
            # host each blocking send waited for the leader to be scheduled again)
            parts = [plan.piece_slice(ov, pi).contiguous() for ri, ov, pi in by_rank.get(me, ())]
            works = [dist.isend(t, dst=leader, group=group) for t in parts]
            for w in works:
                w.wait()
            del parts
            yield []
            continue
        yield _assemble(plan, bucket, regions, by_rank, group, into)
    yield from _vision_buckets(model_chunks, bucket_bytes, me)


def _vision_buckets(model_chunks, bucket_bytes: int, me: int):
    """A trainable vision tower (models/vision.py; replicated on the first stage) as ``model.visual.*`` HF
    tensors, from the stage leader (the others yield ``[]`` per bucket, in lockstep). A frozen tower is not
    a submodule and sends nothing: the engine keeps its copy."""
    from megatron_s3ac.models.vision import VISION_ATTR, unwrap_gpt

    for m in model_chunks:
        tower = unwrap_gpt(m)._modules.get(VISION_ATTR)
        if tower is None:
            continue
        bucket, size = [], 0
        for name, p in tower.hf_named_parameters():
            nb = p.numel() * p.element_size()
            if bucket and size + nb > bucket_bytes:
                yield bucket if me == 0 else []
                bucket, size = [], 0
            bucket.append((name, p.detach()))
            size += nb
        if bucket:
            yield bucket if me == 0 else []


def _assemble(plan: _ExportPlan, bucket, regions, by_rank, group, into=None) -> list[tuple[str, torch.Tensor]]:
    """Leader: the bucket's full HF tensors. A region's destination is a view of the final tensor
    (regions of one HF tensor are consecutive row blocks, so their flat concatenation is the tensor)."""
    result, dest = [], {}
    local = by_rank.get(0, [])
    for nm in bucket:
        ris = [ri for ri, (n2, _, _) in enumerate(regions) if n2 == nm]
        full = into(nm, plan.hf_shapes[nm], plan.dtypes[nm]) if into is not None else None
        if full is None and len(ris) == 1:  # zero-copy: one local piece that is exactly this tensor, contiguous
            only = [(ri, ov, pi) for ri, ov, pi in local if ri == ris[0]]
            if len(only) == 1 and all(r == 0 or not any(x[0] == ris[0] for x in lst) for r, lst in by_rank.items()):
                _, ov, pi = only[0]
                t = plan.piece_slice(ov, pi)
                if t.is_contiguous() and t.numel() == math.prod(plan.hf_shapes[nm]):
                    result.append((nm, t.view(plan.hf_shapes[nm])))
                    dest[ris[0]] = None
                    continue
        if full is None:
            full = torch.empty(plan.hf_shapes[nm], dtype=plan.dtypes[nm], device=plan.device)
        flat, at = full.view(-1), 0
        for ri in ris:
            off, shp = regions[ri][2]
            k = math.prod(shp)
            dest[ri] = (off, flat[at:at + k].view(shp))
            at += k
        assert at == full.numel(), f"{nm}: regions cover {at} of {full.numel()} elements"
        result.append((nm, full))
    # Post every receive of the bucket first (in each sender's order: point-to-point messages between two ranks
    # match in order), copy the local pieces while they arrive, then wait once.
    works, staged, local, shared = [], [], [], {}
    for r, lst in sorted(by_rank.items()):
        for ri, ov, pi in lst:
            if dest[ri] is None:
                continue
            off, buf = dest[ri]
            dst = buf[box_slices(*ov, off)]
            if r == 0:
                local.append((dst, ov, pi))
            elif r in plan.peers:  # read from that rank's shared memory once it says ready
                shared.setdefault(r, []).append(dst)
            elif dst.is_contiguous():
                works.append(dist.irecv(dst, src=dist.get_global_rank(group, r), group=group))
            else:  # a column block of the HF tensor: received whole, then placed
                tmp = torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
                works.append(dist.irecv(tmp, src=dist.get_global_rank(group, r), group=group))
                staged.append((dst, tmp))
    for dst, ov, pi in local:
        dst.copy_(plan.piece_slice(ov, pi))
    word = torch.ones(1, dtype=torch.int64, device=plan.device)
    for r, dsts in shared.items():
        src_rank = dist.get_global_rank(group, r)
        dist.recv(word, src=src_rank, group=group)
        seg, at = plan.peers[r][1], 0
        for dst in dsts:  # the sender's order and offsets
            nb = dst.numel() * dst.element_size()
            dst.copy_(seg[at:at + nb].view(dst.dtype).view(dst.shape))
            at = _pad8(at + nb)
        dist.send(word, dst=src_rank, group=group)
    for w in works:
        w.wait()
    for dst, tmp in staged:
        dst.copy_(tmp)
    return result

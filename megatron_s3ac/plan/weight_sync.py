"""Weight-sync time, trainer -> rollout engines on their own GPUs, from the transfer this project runs.

What moves, per bucket (``rollout.engines.sglang.broadcast.StageBroadcastSync``; ``rollout.engines.vllm.sync.
VLLMStageSync`` has the same shape):

1. gather: each pipeline stage's leader (tp = dp = ep = 0) receives the TP / EP / ETP shards of the bucket's HF
   tensors from the ranks that own them (``convert.export.export_hf_weights``: main replicas only, point to point
   inside the stage). Owners of a TP-split tensor are the stage's offsets 0..TP-1 (megatron's tp-cp-ep-dp-pp rank
   order), of an expert tensor offsets 0..EP*ETP-1; replicated tensors (norms, router, shared-expert gate) are the
   leader's own. Shards on the leader's node cross NVLink, the others its one NIC; all receives are posted at once:
   max(NVLink bytes / NVLink, IB bytes / NIC).
2. broadcast: the leader broadcasts the flat bucket (NCCL) to every engine TP rank, whole HF tensors. One GPU
   sends, through its one NIC (the engines are on other nodes): bytes / NIC. Each engine node takes each byte in
   once (NCCL rings forward inside a node on NVLink), on up to ``NICS_PER_NODE`` NICs.
3. engine load (the engine side's TP/EP re-sharding): every engine rank narrows its shard out of the full
   tensors and copies it into its parameters (2 x shard bytes of HBM traffic) plus a per-tensor loader cost,
   before it answers.
4. RPC: the controller's two round trips to the engines per bucket.

The export generator is lazy and every bucket waits for the engines' answer, so the terms of a bucket add; the
controller serves stage 0, then stage 1, ..., so stages add. ``variant`` switches on what the code does not do
today (stages in parallel, the next bucket gathered during the broadcast, every shard owner sending its own shard,
the trainer cutting the engine's shards, FP8 on the wire) to say what would reach a target.

Units: bytes, seconds; bandwidths in bytes/s (constants in GB/s, cited in ``plan.constants``).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace

from megatron_s3ac.plan import constants as C

_SHAPES: dict[str, dict] = {}  # HF config -> {HF name: shape} of the converter's plan
_LAYER = re.compile(r"\.layers\.(\d+)\.")
# HF tensors megatron keeps whole on every TP rank (plan.params._REPLICATED, in HF names): the leader holds them
_REPLICATED = re.compile(r"(norm\.weight|norm$|\.mlp\.gate\.weight|shared_expert_gate\.weight)$")


@dataclass(frozen=True)
class Links:
    """Effective bandwidths (bytes/s): one GPU's NVLink, one NIC, one GPU's HBM; NICs per node."""

    nvlink: float = C.NVLINK_PEAK_GBPS * 1e9 * C.NVLINK_EFFICIENCY
    nic: float = C.NIC_PEAK_GBPS * 1e9 * C.NIC_EFFICIENCY
    hbm: float = C.HBM_TBPS * 1e12 * C.HBM_EFFICIENCY
    nics_per_node: int = C.NICS_PER_NODE
    rpc_s: float = C.ENGINE_RPC_S
    load_s_per_tensor: float = C.ENGINE_LOAD_S_PER_TENSOR


@dataclass(frozen=True)
class Variant:
    """What the sync does. The default is the code as it is (``AS_BUILT``)."""

    stages_parallel: bool = False  # leaders broadcast their stages at once (each already has its own group)
    overlap_gather: bool = False  # bucket k+1 is gathered while bucket k is broadcast (double-buffered export)
    owners_send: bool = False  # every shard owner sends its own shard: no gather, TP*EP NICs per stage send
    trainer_reshard: bool = False  # each engine rank receives only its shard (NeMo-RL's NCCL reshard)
    fp8: bool = False  # block-FP8 on the wire (rollout.weights_dtype: fp8; convert.fp8's keep list stays bf16)

    @property
    def name(self) -> str:
        on = [k for k in ("stages_parallel", "overlap_gather", "owners_send", "trainer_reshard", "fp8")
              if getattr(self, k)]
        return "+".join(on) or "as_built"


AS_BUILT = Variant()


@dataclass
class Bucket:
    """One export bucket of one stage (bytes on the wire; gathered bytes by link)."""

    bytes: float
    tensors: int
    dense: float  # TP-split bytes (leader holds 1/TP)
    expert: float  # expert bytes (leader holds 1/(EP*ETP))
    gather_nvlink: float = 0.0
    gather_ib: float = 0.0


@dataclass
class StageSync:
    """One pipeline stage's sync: its bytes and buckets, and each term in seconds (summed over its buckets)."""

    stage: int
    layers: range
    bytes: float = 0.0
    tensors: int = 0
    buckets: int = 0
    gather_nvlink_bytes: float = 0.0
    gather_ib_bytes: float = 0.0
    gather_s: float = 0.0
    broadcast_s: float = 0.0
    load_s: float = 0.0
    rpc_s: float = 0.0
    total_s: float = 0.0  # what the stage takes (the terms add, or overlap with ``overlap_gather``)
    engine_node_bytes: float = 0.0  # bytes each engine node takes in for this stage


@dataclass
class WeightSync:
    """The whole sync: per-stage terms, the total, and what it was computed for."""

    variant: Variant
    stages: list[StageSync]
    total_s: float
    bytes: float
    layout: dict
    engine_tp: int
    bucket_bytes: int
    links: Links = field(default_factory=Links)

    def terms(self) -> dict:
        """Each term summed over stages (seconds), the total and the bytes (what ``--json`` shows)."""
        s = self.stages
        return {"variant": self.variant.name, "total_s": round(self.total_s, 3), "bytes": int(self.bytes),
                "buckets": sum(x.buckets for x in s), "tensors": sum(x.tensors for x in s),
                "gather_s": round(sum(x.gather_s for x in s), 3),
                "broadcast_s": round(sum(x.broadcast_s for x in s), 3),
                "engine_load_s": round(sum(x.load_s for x in s), 3), "rpc_s": round(sum(x.rpc_s for x in s), 3),
                "stages_in_parallel": self.variant.stages_parallel,
                "per_stage": [{"stage": x.stage, "layers": [x.layers.start, x.layers.stop], "bytes": int(x.bytes),
                               "buckets": x.buckets, "gather_nvlink_bytes": int(x.gather_nvlink_bytes),
                               "gather_ib_bytes": int(x.gather_ib_bytes), "gather_s": round(x.gather_s, 3),
                               "broadcast_s": round(x.broadcast_s, 3), "engine_load_s": round(x.load_s, 3),
                               "rpc_s": round(x.rpc_s, 3), "total_s": round(x.total_s, 3)} for x in s]}


def _stage_of(name: str, stages: list[range]) -> int:
    m = _LAYER.search(name)
    if m:
        i = int(m.group(1))
        for k, r in enumerate(stages):
            if i in r:
                return k
        raise ValueError(f"{name}: layer {i} is in no pipeline stage ({[f'{r.start}-{r.stop - 1}' for r in stages]}):"
                         f" the layout's stages do not cover the model's layers")
    return 0 if "embed_tokens" in name else len(stages) - 1  # final norm, lm_head: the last stage


def _greedy_buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Indices per bucket: tensors in order, a new bucket when the next would pass ``bucket_bytes`` (a tensor larger
    than a bucket is one bucket of its own) -- ``convert.export._buckets``' rule."""
    out, cur, size = [], [], 0
    for i, b in enumerate(sizes):
        if cur and size + b > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += b
    return out + ([cur] if cur else [])


def _same_node_owners(owners: int, leader: int, gpn: int) -> int:
    """Owners other than the leader (stage offsets 1..owners-1 from global rank ``leader``) on the leader's node."""
    node_end = (leader // gpn + 1) * gpn
    return max(0, min(owners, node_end - leader) - 1)


def stage_buckets(info, layout, train_gpus: int, gpus_per_node: int, bucket_bytes: int, dtype_bytes: int = 2,
                  fp8: bool = False) -> list[tuple[range, list[Bucket]]]:
    """Per pipeline stage: its layers and its buckets, from the converter's plan (HF names and shapes, the export's
    order and bucket rule at the model's dtype; FP8 quantizes each bucket after it is cut, as the leaders do)."""
    from megatron_s3ac.convert.plan import build_plan
    from megatron_s3ac.plan.params import stage_layers

    stages = stage_layers(info.num_layers, layout.pp, layout.first_stage_layers, layout.last_stage_layers)
    key = json.dumps(info.hf, sort_keys=True, default=str)
    if key not in _SHAPES:  # the 397B's plan takes ~0.5 s to build: once per model
        _SHAPES[key] = dict(build_plan(info).hf_shapes)
    shapes = _SHAPES[key]
    per: list[list[tuple[str, tuple]]] = [[] for _ in stages]
    for name, shape in shapes.items():
        per[_stage_of(name, stages)].append((name, tuple(shape)))
    stage_size = train_gpus // layout.pp
    out = []
    for s, items in enumerate(per):
        leader = s * stage_size
        tp_owners, ep_owners = layout.tp, layout.ep * layout.etp
        tp_near = _same_node_owners(tp_owners, leader, gpus_per_node)
        ep_near = _same_node_owners(ep_owners, leader, gpus_per_node)
        sizes = [math.prod(sh) * dtype_bytes for _, sh in items]
        buckets = []
        for idx in _greedy_buckets(sizes, bucket_bytes):
            dense = expert = wire = 0.0
            for i in idx:
                name, sh = items[i]
                n = _wire_bytes(name, sh, dtype_bytes, fp8)
                wire += n
                if ".experts." in name:
                    expert += n
                elif not _REPLICATED.search(name):
                    dense += n
            # what the leader receives: every shard but its own, split by where its owner sits
            nv = dense * tp_near / tp_owners + expert * ep_near / ep_owners
            ib = (dense * (tp_owners - 1 - tp_near) / tp_owners
                  + expert * (ep_owners - 1 - ep_near) / ep_owners)
            buckets.append(Bucket(bytes=wire, tensors=len(idx), dense=dense, expert=expert, gather_nvlink=nv,
                                  gather_ib=ib))
        out.append((stages[s], buckets))
    return out


def _wire_bytes(name: str, shape: tuple, dtype_bytes: int, fp8: bool) -> float:
    if fp8:
        from megatron_s3ac.convert import fp8 as F

        if F.will_quantize(name, shape, "bfloat16"):
            return float(F.fp8_nbytes(shape))
    return float(math.prod(shape) * dtype_bytes)


def weight_sync(info, layout, train_gpus: int, engine_tp: int, *, engine_ep: int = 0, gpus_per_node: int = 8,
                bucket_bytes: int = 512 << 20, dtype_bytes: int = 2, variant: Variant = AS_BUILT,
                links: Links = Links()) -> WeightSync:
    """Seconds of one whole-model sync (``info``: ModelInfo; ``layout``: the actor's ParallelLayout on
    ``train_gpus``; engines of ``engine_tp`` GPUs, experts over ``engine_ep`` of them (0 = engine_tp))."""
    v = variant
    ep_e = engine_ep or engine_tp
    span = max(1, math.ceil(engine_tp / gpus_per_node))  # nodes one engine spans
    ingress = links.nics_per_node * links.nic  # one engine node, all its NICs
    stages = []
    for s, (layers, buckets) in enumerate(stage_buckets(info, layout, train_gpus, gpus_per_node, bucket_bytes,
                                                        dtype_bytes, v.fp8)):
        st = StageSync(stage=s, layers=layers)
        for b in buckets:
            node_bytes = b.bytes / span if v.trainer_reshard else b.bytes
            if v.owners_send:  # the busiest owner's shard through its own NIC; no gather
                g = 0.0
                owner = (b.dense / layout.tp + b.expert / (layout.ep * layout.etp)
                         + (b.bytes - b.dense - b.expert))  # replicated tensors: sent by offset 0
                bc = max(owner / links.nic, node_bytes / ingress)
            else:
                g = max(b.gather_nvlink / links.nvlink, b.gather_ib / links.nic)
                bc = max(b.bytes / links.nic, node_bytes / ingress)
            # each engine rank copies its shard (dense / TP_e, experts / EP_e) out of what it received
            shard = (b.bytes - b.expert) / engine_tp + b.expert / ep_e
            load = 2 * shard / links.hbm + b.tensors * links.load_s_per_tensor
            rpc = 2 * links.rpc_s
            st.total_s += max(g, bc + load + rpc) if v.overlap_gather else g + bc + load + rpc
            st.gather_s += g
            st.broadcast_s += bc
            st.load_s += load
            st.rpc_s += rpc
            st.bytes += b.bytes
            st.tensors += b.tensors
            st.buckets += 1
            st.gather_nvlink_bytes += b.gather_nvlink
            st.gather_ib_bytes += b.gather_ib
            st.engine_node_bytes += node_bytes
        stages.append(st)
    if v.stages_parallel:  # the stages share each engine node's NICs
        total = max(max(x.total_s for x in stages), sum(x.engine_node_bytes for x in stages) / ingress)
    else:
        total = sum(x.total_s for x in stages)
    lay = {k: getattr(layout, k) for k in ("tp", "pp", "ep", "etp")}
    return WeightSync(variant=v, stages=stages, total_s=total, bytes=sum(x.bytes for x in stages), layout=lay,
                      engine_tp=engine_tp, bucket_bytes=bucket_bytes, links=links)


def for_estimate(info, e, bucket_bytes: int | None = None, variant: Variant = AS_BUILT) -> WeightSync | None:
    """The sync of a ``memory.Estimate`` with separate engines (None otherwise); bucket from its knobs."""
    g = e.engine
    if g is None or e.knobs.placement != "separate" or not g.engines:
        return None
    bb = bucket_bytes or int(getattr(e.knobs, "sync_bucket_mb", 512)) << 20
    return weight_sync(info, e.layout, e.train_gpus, g.tp, engine_ep=g.ep, gpus_per_node=e.cluster.gpus_per_node,
                       bucket_bytes=bb, dtype_bytes=C.DTYPE_BYTES[e.knobs.dtype],
                       variant=replace(variant, fp8=variant.fp8 or getattr(e.knobs, "sync_fp8", False)))


# the variants the docs table walks through, each adding one change to the previous
LADDER: tuple[Variant, ...] = (
    AS_BUILT,
    Variant(stages_parallel=True),
    Variant(stages_parallel=True, overlap_gather=True),
    Variant(stages_parallel=True, owners_send=True),
    Variant(stages_parallel=True, owners_send=True, trainer_reshard=True),
    Variant(stages_parallel=True, owners_send=True, trainer_reshard=True, fp8=True),
)


def table(ws: WeightSync) -> str:
    """The per-stage table of one sync (GB = 1e9 bytes; seconds)."""
    hdr = ("stage", "layers", "GB", "buckets", "gather NVL GB", "gather IB GB", "gather s", "bcast s", "load s",
           "rpc s", "stage s")
    rows = [(str(x.stage), f"{x.layers.start}-{x.layers.stop - 1}", f"{x.bytes / 1e9:.1f}", str(x.buckets),
             f"{x.gather_nvlink_bytes / 1e9:.1f}", f"{x.gather_ib_bytes / 1e9:.1f}", f"{x.gather_s:.2f}",
             f"{x.broadcast_s:.2f}", f"{x.load_s:.3f}", f"{x.rpc_s:.3f}", f"{x.total_s:.2f}") for x in ws.stages]
    widths = [max(len(r[i]) for r in (hdr, *rows)) for i in range(len(hdr))]
    fmt = "  ".join("{:>%d}" % w_ for w_ in widths)
    lines = [fmt.format(*hdr)] + [fmt.format(*r) for r in rows]
    how = "stages in parallel (max, or the engine nodes' NICs)" if ws.variant.stages_parallel else "stages in turn (sum)"
    lines.append(f"weight sync ({ws.variant.name}): {ws.total_s:.2f} s for {ws.bytes / 1e9:.1f} GB, {how}; "
                 f"NVLink {ws.links.nvlink / 1e9:.0f} GB/s, NIC {ws.links.nic / 1e9:.0f} GB/s effective")
    return "\n".join(lines)


def ladder_table(info, layout, train_gpus: int, engine_tp: int, **kw) -> str:
    """Total seconds of each ``LADDER`` variant (what would reach a target), one line each."""
    lines = []
    for v in LADDER:
        ws = weight_sync(info, layout, train_gpus, engine_tp, variant=v, **kw)
        t = ws.terms()
        lines.append(f"{v.name:<58} {ws.total_s:6.2f} s  (gather {t['gather_s']:.2f}, broadcast "
                     f"{t['broadcast_s']:.2f}, load {t['engine_load_s']:.2f}, rpc {t['rpc_s']:.2f}; summed over stages)")
    return "\n".join(lines)


__all__ = ["AS_BUILT", "LADDER", "Links", "StageSync", "Variant", "WeightSync", "for_estimate", "ladder_table",
           "stage_buckets", "table", "weight_sync"]

"""Layout enumeration: every legal (TP, CP, PP, EP, ETP) for a model on a cluster, estimated and ranked.

Legality is ``ParallelLayout.validate`` (the trainer's own rules) plus ``rules.extra_layout_errors``
(rules megatron-core enforces later, at build time). Ranking: layouts that fit first, by the
throughput proxy (higher first), ties by headroom; then those that do not fit, by peak (lower first).
"""
from __future__ import annotations

from megatron_s3ac.models.parallel import LayoutError, ParallelLayout
from megatron_s3ac.models.registry import ModelInfo
from megatron_s3ac.plan import constants as C
from megatron_s3ac.plan.memory import Cluster, Estimate, Knobs, Workload, estimate
from megatron_s3ac.plan.rules import extra_layout_errors


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_errors(info: ModelInfo, layout: ParallelLayout, world: int | None) -> list[str]:
    """Every rule ``layout`` breaks: world-size-free ones always, world-size ones when ``world`` is given."""
    errs = []
    # validate stops at the first broken rule: check the world-free rules at a neutral world size first,
    # so a world-size error does not hide them
    for ws in (_neutral_world(layout), world):
        if ws is None:
            continue
        try:
            layout.validate(info, ws)
        except LayoutError as e:
            if str(e) not in errs:
                errs.append(str(e))
    return errs + [e for e in extra_layout_errors(info, layout) if e not in errs]


def _neutral_world(layout: ParallelLayout) -> int:
    """A world size every divisibility rule of ``layout`` holds for (checks the world-free rules only)."""
    import math

    return math.lcm(layout.tp * layout.cp * layout.pp, layout.etp * layout.ep * layout.pp)


def candidates(info: ModelInfo, world: int, gpus_per_node: int, cps=None) -> list[ParallelLayout]:
    """Legal layouts with TP inside a node (TP across nodes is never worth it), ETP in {1, TP} and
    CP in ``cps`` (default: the powers of two up to ``MAX_CP``) where it divides the rest."""
    out = []
    for tp in _divisors(world):
        if tp > gpus_per_node:
            continue
        allowed = cps if cps is not None else [c for c in _divisors(C.MAX_CP) if c & (c - 1) == 0]
        for cp in (c for c in _divisors(world // tp) if c in allowed):
            for pp in _divisors(world // (tp * cp)):
                if pp > info.num_layers:
                    continue
                eps = [d for d in _divisors(info.num_experts) if d * pp <= world] if info.is_moe else [1]
                for ep in eps:
                    for etp in sorted({1, tp} if ep > 1 else {tp}):
                        lay = ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp)
                        if not layout_errors(info, lay, world):
                            out.append(lay)
    return out


def rank(estimates: list[Estimate]) -> list[Estimate]:
    """Fits with a safe margin (``SAFE_HEADROOM`` of the GPU and of the host) by throughput proxy, then
    tight fits by headroom, then the rest by peak."""
    def safe(e: Estimate) -> bool:
        c = e.cluster
        return (e.headroom >= C.SAFE_HEADROOM * c.gpu_mem_gib * C.GIB
                and e.host_per_node <= (1 - C.SAFE_HEADROOM) * c.host_mem_gib * C.GIB)

    fits = [e for e in estimates if e.fits]
    good = sorted((e for e in fits if safe(e)), key=lambda e: (-round(e.throughput, 6), -e.headroom))
    tight = sorted((e for e in fits if not safe(e)), key=lambda e: -e.headroom)
    rest = sorted((e for e in estimates if not e.fits), key=lambda e: e.peak)
    return good + tight + rest


def search(info: ModelInfo, cluster: Cluster, w: Workload, knobs: Knobs,
           fixed: ParallelLayout | None = None, critic_layout: ParallelLayout | None = None,
           cps=None) -> list[Estimate]:
    """Estimates for ``fixed`` (validated) or for every candidate layout (CP sizes ``cps``), ranked."""
    world = cluster.gpus
    if knobs.placement == "separate":
        world = cluster.gpus - (knobs.engine_gpus or cluster.gpus // 2)
    layouts = [fixed] if fixed is not None else candidates(info, world, cluster.gpus_per_node, cps)
    return rank([estimate(info, lay, cluster, w, knobs, critic_layout) for lay in layouts])


CLUSTER_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def smallest_cluster(info: ModelInfo, template: Cluster, w: Workload, knobs: Knobs,
                     sizes=CLUSTER_SIZES, cps=None) -> list[Estimate] | None:
    """Ranked estimates on the smallest GPU count (nodes of ``template.gpus_per_node``) where a layout fits."""
    import dataclasses

    for n in sizes:
        cl = dataclasses.replace(template, gpus=n, gpus_per_node=min(template.gpus_per_node, n))
        res = search(info, cl, w, knobs, cps=cps)
        if res and res[0].fits:
            return res
    return None

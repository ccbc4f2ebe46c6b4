"""SGLang's launch plan and argument rules for ``s3ac-train rehearse`` (rollout/rehearsal.py), on a CPU machine.

``launch_plan`` starts the trainer's own ``EnginePool`` on a fake Ray cluster of the job's nodes (up to
``MAX_FAKE_NODES``; ``ray.cluster_utils.Cluster``, each node advertising the GPUs launch.sh gives that node's
``ray start``: fake GPUs, megatron_s3ac.rollout.engines.fake_gpus), with sglang 0.5.23's start-up stand-in
(megatron_s3ac.rollout.engines.sglang.startup_stand_in) in place of ``sglang.Engine`` asking Ray for the GPUs a real
engine would; so Ray really places the placement groups over the nodes, and each actor (each node's part of an
engine spanning nodes too) reports the GPUs Ray gave it; its node is read from the placement group's bundles.
Engines that would land beyond the fake nodes are listed as not rehearsed. TP rank r of an engine runs on its
visible GPU ``base_gpu_id + r * gpu_id_step`` (sglang ``entrypoints/engine.py:928-939``; per node for an engine
spanning nodes).

``rules`` (sglang 0.5.23, paths inside ``sglang/srt/``): the engine's TP x PP GPUs must be among those it sees;
attention data parallelism splits the TP group (``tp_size % attn_dp_size == 0``,
``arg_groups/parallel_hook.py:162,326``); weight updates need ``dp_size == 1`` (replicas;
``managers/tokenizer_control_mixin.py:451``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megatron_s3ac.rollout.rehearsal import ClusterShape, EngineProcess


# fake Ray nodes at most (each is a raylet on this machine, some seconds and ~100 MB apiece): engines that would
# land beyond them are listed as not rehearsed
MAX_FAKE_NODES = 4


def _fake_cluster(shape: ClusterShape, n: int, cpus: int):
    """Ray with ``n`` fake nodes, node r advertising node r's Ray GPUs (launch.sh's split of that node) and a
    resource ``s3ac_node_<r>`` that names it; one node: a plain local Ray. Returns the cluster (None for one node)."""
    import ray

    from megatron_s3ac.rollout.engines.fake_gpus import start_ray

    if n == 1:
        start_ray(num_gpus=len(shape.ray_devices(0)), num_cpus=cpus)
        return None
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=cpus, num_gpus=len(shape.ray_devices(0)), resources={"s3ac_node_0": 1}, include_dashboard=False))
    try:
        for r in range(1, n):
            cluster.add_node(num_cpus=cpus, num_gpus=len(shape.ray_devices(r)), resources={f"s3ac_node_{r}": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def _node_ranks() -> dict:
    """Ray node id -> fake node rank (its ``s3ac_node_<r>`` resource; a plain local Ray is node 0)."""
    import ray

    out = {}
    for n in ray.nodes():
        names = [k for k in n.get("Resources", {}) if k.startswith("s3ac_node_")]
        out[n["NodeID"]] = int(names[0].rsplit("_", 1)[1]) if names else 0
    return out


def launch_plan(factory: Any, shape: ClusterShape) -> list[EngineProcess]:
    import ray
    from ray.util.placement_group import placement_group_table

    from megatron_s3ac.rollout.engines.pool import EnginePool
    from megatron_s3ac.rollout.engines.fake_gpus import stand_ins_request_gpus
    from megatron_s3ac.rollout.engines.sglang.startup_stand_in import StartupEngine

    s = factory.settings
    g, num = int(s.gpus_per_engine), int(s.num_engines)
    span = g // shape.gpus_per_node if g > shape.gpus_per_node else 1  # nodes per engine (EnginePool: whole nodes)
    per_bundle = g // span
    ray_n = min(len(shape.ray_devices(r)) for r in range(min(shape.nodes, MAX_FAKE_NODES)))
    skip = lambda i, why: EngineProcess(f"sglang engine {i}", -1, [], {}, how=why, rehearsed=False)
    if span > shape.nodes:
        return [skip(i, f"{g} GPUs span {span} nodes, the cluster has {shape.nodes}") for i in range(num)]
    if span > MAX_FAKE_NODES:
        return [skip(i, f"spans {span} nodes; this machine fakes at most {MAX_FAKE_NODES} Ray nodes") for i in range(num)]
    if per_bundle > ray_n or not g:
        return [EngineProcess(f"sglang engine {i}", 0, [], {}, how=f"a node's Ray has {ray_n} GPUs, an engine needs "
                              f"{per_bundle} on each of its {span} node(s)") for i in range(num)]
    per_node = ray_n // per_bundle  # engine parts a node holds
    fake = min(shape.nodes, MAX_FAKE_NODES, -(-num * span // per_node))
    n = min(num, fake // span * per_node if span > 1 else fake * per_node)
    local = dataclasses.replace(factory, engine_cls=StartupEngine,
                                settings=dataclasses.replace(s, num_engines=n, gpus_per_node=shape.gpus_per_node))
    owns = not ray.is_initialized()
    cluster = _fake_cluster(shape, fake, cpus=per_node + 1) if owns else None
    pool = None
    try:
        with stand_ins_request_gpus(EnginePool, start_timeout_s=120.0):
            pool = EnginePool(local, n, gpus_per_engine=0, gpus_per_node=shape.gpus_per_node,
                              cpus_per_engine=1, timeout_s=120.0)
        ranks = _node_ranks()
        leaders = [pool.wait([pool.submit(e, "engine.startup_record")], "startup_record")[0] for e in range(n)]
        # the other nodes' parts of a spanning engine (EnginePool.followers: engine-major, node ranks 1..span-1)
        rest = ray.get([f.call.remote("engine.startup_record", (), {}) for f in pool.followers], timeout=120.0)
        rest_info = ray.get([f.ready.remote() for f in pool.followers], timeout=120.0)
        out = []
        for e in range(n):
            nodes = placement_group_table(pool.placement_groups[e])["bundles_to_node_id"]
            for part in range(span):
                node = ranks.get(nodes[part], -1)
                ray_devices = shape.ray_devices(node)
                j = e * (span - 1) + part - 1
                info, rec = (pool.info[e], leaders[e]) if part == 0 else (rest_info[j], rest[j])
                visible = [ray_devices[int(i)] for i in info["gpu_ids"]]  # Ray's slots -> the node's GPUs
                a = rec["server_args"]
                tp, base, step = int(a.get("tp_size", 1)), int(a.get("base_gpu_id", 0)), int(info["gpu_id_step"])
                idx = [base + r * step for r in range(tp // span)]  # this node's TP ranks (engine.py:928-939)
                devices = [visible[i] for i in idx if i < len(visible)]
                name = f"sglang engine {e}" + (f" node part {part} of {span}" if span > 1 else "")
                out.append(EngineProcess(name, node, devices, {**a, "_visible": visible, "_span": span, "_part": part}, rec["env"],
                                         f"Ray placed it on GPUs {visible} of node {node}"))
        return out + [skip(i, f"would land beyond the {fake} Ray nodes faked here (at most {MAX_FAKE_NODES}); "
                              f"the nodes are alike") for i in range(n, num)]
    finally:
        if pool is not None:
            pool.close()
        if owns:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()


def rules(p: EngineProcess, shape: ClusterShape) -> list[str]:
    a, out = p.args, []
    if not a:
        return out
    tp, pp = int(a.get("tp_size", 1)), int(a.get("pp_size", 1) or 1)
    span = int(a.get("_span", 1))
    visible = a.get("_visible", [])
    idx = [int(a.get("base_gpu_id", 0)) + r * int(a.get("gpu_id_step", 1)) for r in range(tp // span)]
    if tp * pp > len(visible) * span or max(idx) >= len(visible):
        out.append(f"{p.name}: TP {tp} x PP {pp} on visible GPUs {idx} but Ray gave it {len(visible)} "
                   f"(sglang entrypoints/engine.py:928-939)")
    if span > 1 and (int(a.get("nnodes", 1)) != span or int(a.get("node_rank", 0)) != a.get("_part")
                     or not a.get("dist_init_addr")):
        out.append(f"{p.name}: started with nnodes={a.get('nnodes')} node_rank={a.get('node_rank')} dist_init_addr="
                   f"{a.get('dist_init_addr')} for part {a.get('_part')} of an engine over {span} nodes (sglang "
                   f"server_args nnodes / node_rank / dist_init_addr)")
    attn_dp = int(a.get("attn_dp_size", 1) or 1)
    if tp % attn_dp:
        out.append(f"{p.name}: attn_dp_size {attn_dp} does not divide tp_size {tp} (attention DP splits the TP group: "
                   f"sglang arg_groups/parallel_hook.py:162,326)")
    dp = int(a.get("dp_size", 1) or 1)
    if dp > 1:
        out.append(f"{p.name}: dp_size {dp} replicas in one engine: sglang's weight updates need dp_size 1 "
                   f"(managers/tokenizer_control_mixin.py:451); more replicas are rollout.sglang.num_engines")
    return out

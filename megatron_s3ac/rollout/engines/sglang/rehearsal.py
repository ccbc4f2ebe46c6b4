"""SGLang's launch plan and argument rules for ``s3ac-train rehearse`` (rollout/rehearsal.py), on a CPU machine.

``launch_plan`` starts the trainer's own ``EnginePool`` on a local Ray that advertises one node's engine GPUs (the
ones launch.sh gives ``ray start``: fake GPUs, megatron_s3ac.rollout.engines.fake_gpus), with sglang 0.5.23's start-up
stand-in (megatron_s3ac.rollout.engines.sglang.startup_stand_in) in place of ``sglang.Engine`` asking Ray for the GPUs a real engine
would; so Ray really places the placement groups, and each actor reports the GPUs Ray gave it. A node holds
``gpus_per_node // gpus_per_engine`` engines; every node is alike, so one node's engines are rehearsed and the
other nodes' are the same (an engine spanning nodes is not rehearsed: said in the plan's ``how``). TP rank r of an
engine runs on its visible GPU ``base_gpu_id + r * gpu_id_step`` (sglang ``entrypoints/engine.py:928-939``).

``rules`` (sglang 0.5.23, paths inside ``sglang/srt/``): the engine's TP x PP GPUs must be among those it sees;
attention data parallelism splits the TP group (``tp_size % attn_dp_size == 0``,
``arg_groups/parallel_hook.py:162,326``); weight updates need ``dp_size == 1`` (replicas;
``managers/tokenizer_control_mixin.py:451``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megatron_s3ac.rollout.rehearsal import ClusterShape, EngineProcess


def launch_plan(factory: Any, shape: ClusterShape) -> list[EngineProcess]:
    import ray

    from megatron_s3ac.rollout.engines.pool import EnginePool
    from megatron_s3ac.rollout.engines.fake_gpus import stand_ins_request_gpus, start_ray
    from megatron_s3ac.rollout.engines.sglang.startup_stand_in import StartupEngine

    s = factory.settings
    ray_devices = shape.ray_devices()
    g = int(s.gpus_per_engine)
    if g > shape.gpus_per_node:
        return [EngineProcess(f"sglang engine {i}", -1, [], {}, how=f"spans {g // shape.gpus_per_node} nodes: "
                              f"not rehearsed") for i in range(int(s.num_engines))]
    per_node = min(int(s.num_engines), len(ray_devices) // g) if g else 0
    if per_node < 1:
        return [EngineProcess(f"sglang engine {i}", 0, [], {}, how=f"a node's Ray has {len(ray_devices)} GPUs "
                              f"({ray_devices}), an engine needs {g}") for i in range(int(s.num_engines))]
    local = dataclasses.replace(factory, engine_cls=StartupEngine,
                                settings=dataclasses.replace(s, num_engines=per_node, gpus_per_node=shape.gpus_per_node))
    owns = not ray.is_initialized()
    if owns:
        start_ray(num_gpus=len(ray_devices), num_cpus=per_node + 1)
    pool = None
    try:
        with stand_ins_request_gpus(EnginePool, start_timeout_s=120.0):
            pool = EnginePool(local, per_node, gpus_per_engine=0, gpus_per_node=shape.gpus_per_node,
                              cpus_per_engine=1, timeout_s=120.0)
        records = [pool.wait([pool.submit(e, "engine.startup_record")], "startup_record")[0] for e in range(per_node)]
        out = []
        for e, (info, rec) in enumerate(zip(pool.info, records)):
            visible = [ray_devices[int(i)] for i in info["gpu_ids"]]  # Ray's slots -> the node's GPUs
            a = rec["server_args"]
            tp, base, step = int(a.get("tp_size", 1)), int(a.get("base_gpu_id", 0)), int(info["gpu_id_step"])
            idx = [base + r * step for r in range(tp)]
            devices = [visible[i] for i in idx if i < len(visible)]
            out.append(EngineProcess(f"sglang engine {e}", 0, devices, {**a, "_visible": visible}, rec["env"],
                                     f"Ray placed it on GPUs {visible} of node 0"))
        return out
    finally:
        if pool is not None:
            pool.close()
        if owns:
            ray.shutdown()


def rules(p: EngineProcess, shape: ClusterShape) -> list[str]:
    a, out = p.args, []
    if not a:
        return out
    tp, pp = int(a.get("tp_size", 1)), int(a.get("pp_size", 1) or 1)
    visible = a.get("_visible", [])
    idx = [int(a.get("base_gpu_id", 0)) + r * int(a.get("gpu_id_step", 1)) for r in range(tp)]
    if tp * pp > len(visible) or max(idx) >= len(visible):
        out.append(f"{p.name}: TP {tp} x PP {pp} on visible GPUs {idx} but Ray gave it {len(visible)} "
                   f"(sglang entrypoints/engine.py:928-939)")
    attn_dp = int(a.get("attn_dp_size", 1) or 1)
    if tp % attn_dp:
        out.append(f"{p.name}: attn_dp_size {attn_dp} does not divide tp_size {tp} (attention DP splits the TP group: "
                   f"sglang arg_groups/parallel_hook.py:162,326)")
    dp = int(a.get("dp_size", 1) or 1)
    if dp > 1:
        out.append(f"{p.name}: dp_size {dp} replicas in one engine: sglang's weight updates need dp_size 1 "
                   f"(managers/tokenizer_control_mixin.py:451); more replicas are rollout.sglang.num_engines")
    return out

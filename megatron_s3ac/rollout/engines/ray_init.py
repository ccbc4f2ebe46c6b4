"""Ray for the rollout engines: join the job's cluster when there is one, else start a local instance.

The launch scripts (examples/paper/launch.sh) start Ray on every node and export RAY_ADDRESS. Ray 2.x refuses
``ray.init(num_cpus=..., num_gpus=...)`` against an existing cluster ("When connecting to an existing cluster,
num_cpus and num_gpus must not be provided", ray/_private/worker.py), so resources are passed only when this
process starts its own Ray.

Ray actors take the environment of the raylet of their node (the ``ray start`` that made it), not the driver's:
on a cluster started before the job, variables the trainer's shell exported never reach the engines.
``engine_runtime_env`` is what every engine actor is started with instead: the driver's variables that configure
the engines and their collectives (``ENGINE_ENV_PREFIXES``) plus those the engine factory needs.
"""
from __future__ import annotations

import math
import os
from typing import Optional


def init_ray(num_cpus: float, num_gpus: float = 0, ray_init_kwargs: Optional[dict] = None) -> bool:
    """Initialise Ray unless it already is. Returns True when this call initialised it.

    RAY_ADDRESS set: ``ray.init(address="auto", **ray_init_kwargs)`` (connect; the cluster's resources are its own).
    Otherwise a new local instance (``address="local"``, ray/_private/worker.py:1522-1533: without it Ray joins the
    cluster a ``ray start`` left on this machine, and then refuses the resources below) with ``max(1, ceil(num_cpus))``
    CPUs, no GPUs when ``num_gpus`` is 0 (Ray would otherwise claim every visible GPU), no dashboard;
    ``ray_init_kwargs`` override these.
    """
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto", **(ray_init_kwargs or {}))
        return True
    kwargs = dict(address="local", num_cpus=max(1, math.ceil(num_cpus)), include_dashboard=False)
    if not num_gpus:
        kwargs["num_gpus"] = 0
    kwargs.update(ray_init_kwargs or {})
    ray.init(**kwargs)
    return True


# the driver's variables passed to engine actors: sglang's own settings and the collectives' (NCCL, torch's NCCL
# watchdog); never CUDA_VISIBLE_DEVICES and the like, which Ray sets per actor
ENGINE_ENV_PREFIXES = ("SGLANG_", "NCCL_", "TORCH_NCCL_")


def engine_runtime_env(factory=None) -> dict:
    """Ray ``runtime_env`` for an engine actor: {"env_vars": the driver's ENGINE_ENV_PREFIXES variables, plus
    ``factory.env_vars()`` (what its engines need, e.g. sglang's longer-context switch) where the driver has no
    value of its own}. Empty dict when there is nothing to pass."""
    env = {k: v for k, v in os.environ.items() if k.startswith(ENGINE_ENV_PREFIXES)}
    needs = getattr(factory, "env_vars", None)
    for k, v in (needs() if callable(needs) else {}).items():
        env.setdefault(k, str(v))
    return {"env_vars": env} if env else {}

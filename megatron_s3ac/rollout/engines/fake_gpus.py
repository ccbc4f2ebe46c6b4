"""Ray with fake GPU resources for the engine-pool tests and ``s3ac-train rehearse``, so placement is real on a
CPU machine.

``ray.init(num_gpus=N)`` makes a local Ray advertise N GPUs it does not have; Ray's scheduler then places
placement groups and actors against them exactly as on a GPU node (a bundle that asks for more GPUs than are free
stays pending). ``stand_ins_request_gpus()`` makes an ``EnginePool`` of stand-in engines (a factory with
``engine_cls`` set) ask Ray for the GPUs a real sglang engine would, ``rollout.sglang.gpus_per_engine`` each
(``rollout.factory.build_rollout_engine`` gives a stand-in none), and bounds the pool's start so a pool that can
never be placed fails in seconds instead of after 900 s. Only names that exist since commit 2c164be are used.
"""
from __future__ import annotations

import contextlib
import functools


def start_ray(num_gpus: int, num_cpus: int = 4, by_value=()) -> None:
    """A local Ray advertising ``num_gpus`` fake GPUs; ``by_value``: modules the actors receive pickled by value
    (test stand-ins that are not importable there). Retried: Ray gives its raylet 30 s to register, which an
    overloaded CI box can miss."""
    import ray

    for m in by_value:
        ray.cloudpickle.register_pickle_by_value(m)
    for attempt in range(3):
        try:
            ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False)
            return
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise


def free_gpus() -> float:
    """GPUs Ray can still hand out (placement groups hold theirs even while their engine sleeps)."""
    import ray

    return float(ray.available_resources().get("GPU", 0.0))


@contextlib.contextmanager
def stand_ins_request_gpus(pool_cls, start_timeout_s: float = 60.0):
    """Within: ``pool_cls(factory, ...)`` (``rollout.engines.pool.EnginePool``, passed in) with ``gpus_per_engine=0``
    and a stand-in factory requests ``factory.settings.gpus_per_engine`` GPUs per engine; every pool's start waits at
    most ``start_timeout_s``."""
    orig = pool_cls.__init__

    @functools.wraps(orig)
    def init(self, factory, num_engines, *args, gpus_per_engine=0, **kw):
        settings = getattr(factory, "settings", None)
        if not gpus_per_engine and getattr(factory, "engine_cls", None) is not None and settings is not None:
            gpus_per_engine = int(settings.gpus_per_engine)
        kw["start_timeout_s"] = min(float(kw.get("start_timeout_s", start_timeout_s)), start_timeout_s)
        orig(self, factory, num_engines, *args, gpus_per_engine=gpus_per_engine, **kw)

    pool_cls.__init__ = init
    try:
        yield
    finally:
        pool_cls.__init__ = orig

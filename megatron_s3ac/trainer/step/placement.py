"""Where the models' states live between phases (``train.offload_idle``; docs/trainer.md "GPU residency").

One small object the trainer owns (``Trainer.placement``): ``place`` moves a model's params / grads / optimizer
states to host memory and back, ``offload_colocated`` says whether the models must leave whenever a colocated engine
is awake, ``before_engine_wake`` / ``after_weights_loaded`` are the weight sync's two hand-overs, and ``resident``
marks work outside a step during which both stay on the device. Every call is a no-op without ``offload_idle``.
"""
from __future__ import annotations

import contextlib


def release_device_cache() -> None:
    """Hand the memory torch's caching allocator holds but no tensor uses back to the CUDA driver, so another process
    on this GPU (a colocated SGLang engine's weights and KV cache) can take it; a no-op on CPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def held_towers(module) -> list:
    """The vision towers a model holds outside its parameters: ``models.vision.attach_vision`` keeps a frozen tower
    (and a later pipeline stage's spare) as a plain attribute, so that it is neither trained nor saved, yet its
    weights sit on the device like the model's."""
    from megatron_s3ac.models.vision import VISION_ATTR, unwrap_gpt

    gpt = unwrap_gpt(module)
    return [t for t in (gpt.__dict__.get(VISION_ATTR), gpt.__dict__.get("s3ac_vision_spare")) if t is not None]


class Placement:
    """``models``: {"actor" | "critic": (ddp module, optimizer)} (the critic absent without one); ``offload_idle``,
    ``colocated``: the config's ``train.offload_idle`` and ``rollout.placement == colocated``.

    A frozen vision tower is one object shared by the actor and the critic (trainer.step.build copies only a
    trainable one), so it is a resident of its own: its weights leave once every model holding it has its params
    off, and come back as soon as one of them needs its params."""

    def __init__(self, models: dict, offload_idle: bool, colocated: bool):
        self.models, self.offload_idle, self.colocated = models, bool(offload_idle), bool(colocated)
        self._offloaders: dict | None = None
        self._resident = False
        self.sync_metrics: dict = {}  # the last weight sync's own moves (time/offload, mem/*), taken by the step
        self.towers: dict = {}  # id(tower) -> (tower, names of the models holding it)
        for name, (ddp, _) in models.items():
            for t in held_towers(ddp):
                self.towers.setdefault(id(t), (t, []))[1].append(name)
        self._tower_offloaders: dict | None = None

    @classmethod
    def of(cls, tr) -> "Placement":
        """The trainer's placement (its models, ``train.offload_idle``, ``rollout.placement``)."""
        from megatron_s3ac.config import Placement as Where

        models = {"actor": (tr.actor_ddp, tr.actor_opt)}
        if tr.critic_ddp is not None:
            models["critic"] = (tr.critic_ddp, tr.critic_opt)
        return cls(models, tr.cfg.train.offload_idle, tr.cfg.rollout.placement == Where.colocated)

    def _handles(self) -> dict:
        if self._offloaders is None:
            from megatron_s3ac.models.offload import HostOffload

            self._offloaders = {k: HostOffload([ddp], opt) for k, (ddp, opt) in self.models.items()}
        return self._offloaders

    def place(self, m: dict, on=(), off=(), kinds=("params", "grads", "optimizer")) -> None:
        """Models in ``off`` to host memory, those in ``on`` back; ``kinds``: which of their states move. Seconds and
        bytes go to ``m`` (time/offload, mem/offload_gb, mem/<model>_<kind>_gb). Freed device memory is handed back
        to the driver (release_device_cache)."""
        if not self.offload_idle:
            return
        handles, freed = self._handles(), False
        for name in off:
            h = handles.get(name)
            if h is not None and not h.offloaded_kinds() >= set(kinds):
                st = h.offload(kinds)
                freed = True
                m["time/offload"] = m.get("time/offload", 0.0) + st.seconds
                m["mem/offload_gb"] = m.get("mem/offload_gb", 0.0) + st.total_bytes / 2**30
                m.update({k: v for k, v in st.metrics(name).items() if k.startswith("mem/")})
        for name in on:
            h = handles.get(name)
            if h is not None and h.offloaded_kinds() & set(kinds):
                m["time/offload"] = m.get("time/offload", 0.0) + h.onload(kinds).seconds
        freed |= self._follow_towers(m, handles)
        if freed:
            release_device_cache()

    def _follow_towers(self, m: dict, handles: dict) -> bool:
        """Each held tower off when every model holding it has its params off, else on; True if one left."""
        if not self.towers:
            return False
        from megatron_s3ac.models.offload import HostOffload

        if self._tower_offloaders is None:
            self._tower_offloaders = {k: HostOffload([t]) for k, (t, _) in self.towers.items()}
        freed = False
        for k, (_, owners) in self.towers.items():
            h, off = self._tower_offloaders[k], all("params" in handles[o].offloaded_kinds() for o in owners)
            if off and not h.offloaded_kinds():
                st = h.offload(("params",))
                freed = True
                m["time/offload"] = m.get("time/offload", 0.0) + st.seconds
                m["mem/offload_gb"] = m.get("mem/offload_gb", 0.0) + st.total_bytes / 2**30
                m["mem/vision_tower_params_gb"] = st.total_bytes / 2**30
            elif not off and h.offloaded_kinds():
                m["time/offload"] = m.get("time/offload", 0.0) + h.onload(("params",)).seconds
        return freed

    @property
    def offload_colocated(self) -> bool:
        """train.offload_idle with the engine on the trainer's GPUs, outside ``resident``: the models live on the host
        whenever the engine is awake (the same on every rank: decided from the config)."""
        return self.offload_idle and self.colocated and not self._resident

    @property
    def is_resident(self) -> bool:
        return self._resident

    @contextlib.contextmanager
    def resident(self):
        """Both models on the device for the body (the caller sleeps the engine first and syncs after)."""
        self.place({}, on=list(self.models))
        self._resident = True
        try:
            yield
        finally:
            self._resident = False

    # ---- the weight sync's hand-overs (colocated offload) --------------------------------------------
    def before_engine_wake(self) -> None:
        """Before a sync wakes the engine: the critic and the actor's grads and optimizer states to the host, the
        actor's params on the device (the export reads them), the freed memory back to the driver."""
        if self.offload_colocated:
            m = self.sync_metrics = {}
            self.place(m, off=["critic"])
            self.place(m, off=["actor"], kinds=("grads", "optimizer"))
            self.place(m, on=["actor"], kinds=("params",))

    def after_weights_loaded(self) -> None:
        """The engine holds the weights: the actor's params leave too, before the KV cache wakes."""
        if self.offload_colocated:
            self.place(self.sync_metrics, off=["actor"], kinds=("params",))

    def take_sync_metrics(self) -> dict:
        """The last sync's moves (and forget them): added to the step's time/offload and mem/offload_gb."""
        out, self.sync_metrics = self.sync_metrics, {}
        return out


__all__ = ["Placement", "held_towers", "release_device_cache"]

"""The trainer's engine side: the one weight path actor -> engine (the engine kind's registered sync strategy,
FP8 quantizer), colocated sleep, idle-model host offload, and reward scoring (rank 0).
A mixin of ``trainer.loop.Trainer``: it uses the Trainer's engine, models, config and reward pool."""
from __future__ import annotations

import contextlib
from functools import partial


def fp8_quantizer(cfg):
    """rollout.weights_dtype=fp8: the stream quantizer every stage leader applies before the transfer; else None."""
    if cfg.rollout.weights_dtype != "fp8":
        return None
    from megatron_s3ac.convert.fp8 import DEFAULT_KEEP, quantize_stream

    keep = cfg.rollout.fp8_keep
    return partial(quantize_stream, keep=DEFAULT_KEEP if keep is None else tuple(keep))


def sync_strategy_for(cfg, engine=None):
    """The weight-sync strategy ``rollout.engine`` registered for ``rollout.placement`` (``rollout.sync.strategy``),
    around ``engine`` (rank 0) or None (every other rank: the same strategy, derived from the config alone). The
    kind's own config section ``rollout.<kind>`` (e.g. ``rollout.sglang``; None if it has none) is its settings."""
    from megatron_s3ac.rollout.factory import make_sync_strategy

    r = cfg.rollout
    section = getattr(r, str(getattr(r.engine, "value", r.engine)), None)
    return make_sync_strategy(r.engine, r.placement, engine, settings=section, quantize=fp8_quantizer(cfg))


def _strategy(tr):
    """The trainer's weight-sync strategy (built by ``Trainer.__init__``; built here for a stand-in trainer)."""
    s = getattr(tr, "sync_strategy", None)
    if s is None:
        s = tr.sync_strategy = sync_strategy_for(tr.cfg, tr.engine)
    return s


def _hook(tr, name: str) -> None:
    """tr.<name>() where the object has it (tests drive sync_weights on stand-ins of the Trainer)."""
    fn = getattr(tr, name, None)
    if callable(fn):
        fn()


def release_device_cache() -> None:
    """Hand the memory torch's caching allocator holds but no tensor uses back to the CUDA driver, so another process
    on this GPU (a colocated SGLang engine's weights and KV cache) can take it; a no-op on CPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class EngineSide:

    def sync_weights(self):
        """The one weight path, actor -> engine. Collective: every rank joins the export. The engine kind's
        registered strategy for ``rollout.placement`` does it (``rollout.sync.strategy``), waking a sleeping engine
        in its own order first: cpu / hf -> rank 0's engine receives every pipeline stage's tensors
        (``rollout.sync.weight_sync``); sglang separate -> each stage's leader broadcasts its stage
        (``rollout.engines.sglang.broadcast.StageBroadcastSync``); sglang colocated -> every rank hands the engine TP rank on its
        GPU a handle to each bucket (``rollout.engines.sglang.colocated.ColocatedIPCSync``), woken weights -> sync ->
        kv_cache + cuda_graph. Returns this rank's stats."""
        chunks = list(self.actor) if isinstance(self.actor, (list, tuple)) else [self.actor]
        _hook(self, "_before_engine_wake")  # colocated offload: only the actor's params stay for the sync
        return _strategy(self).sync(chunks, self.info, weights_loaded=getattr(self, "_after_weights_loaded", None))

    def close_weight_sync(self) -> None:
        """Leave the weight-update groups (stage leaders and engines); before the engines shut down."""
        s = getattr(self, "sync_strategy", None)
        if s is not None:
            s.close()

    def _close_engine(self) -> bool:
        """Rank 0 at the end of a run: shut the engine's processes down if its strategy says it has any (an
        in-process CPU engine has none); True if it did."""
        if getattr(self, "engine", None) is None or not _strategy(self).close_engine():
            return False
        self.engine = None
        return True

    # ---- idle-model offload (train.offload_idle) -------------------------------------------------
    def _place(self, m: dict, on=(), off=(), kinds=("params", "grads", "optimizer")) -> None:
        """Models in ``off`` to host memory, those in ``on`` back (no-op without train.offload_idle); ``kinds``:
        which of their states move. Seconds and bytes go to ``m`` (time/offload, mem/offload_gb,
        mem/<model>_<kind>_gb). Freed device memory is handed back to the driver (release_device_cache)."""
        if not self.cfg.train.offload_idle:
            return
        from megatron_s3ac.models.offload import HostOffload

        if not hasattr(self, "_offloaders"):
            self._offloaders = {"actor": HostOffload([self.actor_ddp], self.actor_opt)}
            if self.critic_ddp is not None:
                self._offloaders["critic"] = HostOffload([self.critic_ddp], self.critic_opt)
        freed = False
        for name in off:
            h = self._offloaders.get(name)
            if h is not None and not h.offloaded_kinds() >= set(kinds):
                st = h.offload(kinds)
                freed = True
                m["time/offload"] = m.get("time/offload", 0.0) + st.seconds
                m["mem/offload_gb"] = m.get("mem/offload_gb", 0.0) + st.total_bytes / 2**30
                m.update({k: v for k, v in st.metrics(name).items() if k.startswith("mem/")})
        for name in on:
            h = self._offloaders.get(name)
            if h is not None and h.offloaded_kinds() & set(kinds):
                m["time/offload"] = m.get("time/offload", 0.0) + h.onload(kinds).seconds
        if freed:
            release_device_cache()

    # ---- what is resident beside a colocated engine (train.offload_idle; docs/trainer.md "GPU residency") ----
    def _offload_colocated(self) -> bool:
        """train.offload_idle with the engine on the trainer's GPUs, outside ``models_resident``: the models live on
        the host whenever the engine is awake (the same on every rank: decided from the config)."""
        from megatron_s3ac.config import Placement

        return bool(self.cfg.train.offload_idle) and self.cfg.rollout.placement == Placement.colocated \
            and not getattr(self, "_resident_depth", 0)

    def _before_engine_wake(self) -> None:
        """Before a sync wakes the engine: the critic and the actor's grads and optimizer states to the host, the
        actor's params on the device (the export reads them), the freed memory back to the driver."""
        if self._offload_colocated():
            m = self._sync_placement = {}
            self._place(m, off=["critic"])
            self._place(m, off=["actor"], kinds=("grads", "optimizer"))
            self._place(m, on=["actor"], kinds=("params",))

    def _after_weights_loaded(self) -> None:
        """The engine holds the weights: the actor's params leave too, before the KV cache wakes."""
        if self._offload_colocated():
            self._place(getattr(self, "_sync_placement", {}), off=["actor"], kinds=("params",))

    def sync_weights_soon(self):
        """``sync_weights`` now, or, inside ``models_resident`` (whose exit syncs, after the models left), then: a sync
        in there would wake the engine beside both models."""
        if getattr(self, "_resident_depth", 0):
            return None
        return self.sync_weights()

    @contextlib.contextmanager
    def models_resident(self):
        """Both models on the device for work outside a step (checkpoint save / load, pipeline stages). With
        colocated offload (``_offload_colocated``) the engine sleeps first (rank 0) and, once the body is done, the
        models leave again and ``sync_weights`` wakes the engine refilled. Collective; a no-op otherwise."""
        if not self._offload_colocated():
            yield
            return
        self._engine_sleep()
        self._place({}, on=["actor", "critic"])
        self._resident_depth = 1
        try:
            yield
        finally:
            self._resident_depth = 0
        self._engine_sleep()  # the body may have synced (woken) it: wake again only in the colocated order
        self.sync_weights()

    def _engine_sleep(self) -> None:
        """Release the engine's memory while the models train (rank 0; the strategies of colocated placements)."""
        _strategy(self).sleep()

    def _reward_pool(self):
        """One verifier pool per run (rank 0), shared by rollouts and evaluation."""
        if self.reward_pool is None:
            from megatron_s3ac.rollout.rewards import RewardPool

            self.reward_pool = RewardPool(num_workers=self.cfg.rollout.reward_workers,
                                          timeout_s=self.cfg.rollout.reward_timeout_s)
        return self.reward_pool

    def _score(self, responses: list[str], references: list[str]) -> list[float]:
        from megatron_s3ac.rollout.rewards import get_reward, score_answers

        name = self.cfg.rollout.reward
        return score_answers(name, responses, references, self._reward_pool() if get_reward(name).isolate else None)

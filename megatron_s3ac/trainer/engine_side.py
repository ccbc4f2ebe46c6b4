"""The trainer's engine side: the one weight path actor -> engine (SGLang sessions, FP8 quantizer,
colocated wake order), colocated sleep, idle-model host offload, and reward scoring (rank 0).
A mixin of ``trainer.loop.Trainer``: it uses the Trainer's engine, models, config and reward pool."""
from __future__ import annotations

from functools import partial


def broadcast_sync(cfg) -> bool:
    """SGLang engines on their own GPUs take the broadcast path (decided from the config: the same on every rank,
    though only rank 0 holds the pool)."""
    r = cfg.rollout
    return str(getattr(r.engine, "value", r.engine)) == "sglang" and \
        str(getattr(r.placement, "value", r.placement)) == "separate"


def colocated_sglang(cfg) -> bool:
    """SGLang engines on the trainer's GPUs take the per-GPU handle path (``rollout.colocated``)."""
    r = cfg.rollout
    return str(getattr(r.engine, "value", r.engine)) == "sglang" and \
        str(getattr(r.placement, "value", r.placement)) == "colocated"


def vllm_session_sync(cfg) -> bool:
    """vLLM engines take one weight-update session around the rank-0 sync (``rollout.vllm_sync``). Interim wiring
    until the engine's registered strategy (rollout.sync_strategy) replaces these predicates."""
    return str(getattr(cfg.rollout.engine, "value", cfg.rollout.engine)) == "vllm"


def fp8_quantizer(cfg):
    """rollout.weights_dtype=fp8: the stream quantizer every stage leader applies before the transfer; else None."""
    if cfg.rollout.weights_dtype != "fp8":
        return None
    from megatron_s3ac.convert.fp8 import DEFAULT_KEEP, quantize_stream

    keep = cfg.rollout.fp8_keep
    return partial(quantize_stream, keep=DEFAULT_KEEP if keep is None else tuple(keep))


class EngineSide:
    def sync_weights(self):
        """The one weight path, actor -> engine. Collective: every rank joins the export.
        SGLang engines on their own GPUs (``rollout.placement: separate``): each pipeline stage's leader broadcasts
        its own stage to the engines (``rollout.broadcast.StageBroadcastSync``). SGLang engines on the trainer's GPUs
        (``colocated``): every rank hands the engine TP rank on its GPU a handle to each bucket
        (``rollout.colocated.ColocatedIPCSync``). In both, rank 0 only drives the engines and each sync is one
        weight-update session per engine, checked complete. CPU / hf engine: rank 0's engine receives every pipeline
        stage's tensors (``rollout.weight_sync``). A colocated engine wakes in sglang's order: weights -> sync ->
        kv_cache + cuda_graph."""
        from megatron_s3ac.rollout.weight_sync import sync_weights

        chunks = list(self.actor) if isinstance(self.actor, (list, tuple)) else [self.actor]
        if broadcast_sync(self.cfg):
            return self._stage_broadcast(chunks)
        if colocated_sglang(self.cfg):
            return self._colocated_sync(chunks)
        if vllm_session_sync(self.cfg):
            return self._vllm_sync(chunks)
        if self.engine is not None and self._engine_asleep:
            self.engine.wake()  # weights re-allocated but stale: the sync below refills every one
            self._engine_asleep = False
        q = fp8_quantizer(self.cfg)  # every rank: stage leaders quantize before the transfer
        return sync_weights(chunks, self.info, self.engine, **({} if q is None else {"quantize": q}))

    def _stage_broadcast(self, chunks):
        """Every rank: the per-stage broadcast sync (connects the stage leaders and the engines on first use)."""
        from megatron_s3ac.rollout.broadcast import StageBroadcastSync

        sg = self.cfg.rollout.sglang
        if getattr(self, "_bsync", None) is None:
            self._bsync = StageBroadcastSync(self.engine, timeout_s=sg.timeout_s)
        return self._bsync.sync(chunks, self.info, sg.bucket_bytes, quantize=fp8_quantizer(self.cfg))

    def _colocated_sync(self, chunks):
        """Every rank: the colocated SGLang sync, between wake(["weights"]) and wake(["kv_cache", "cuda_graph"])."""
        from megatron_s3ac.rollout.colocated import ColocatedIPCSync

        sg = self.cfg.rollout.sglang
        if getattr(self, "_isync", None) is None:
            self._isync = ColocatedIPCSync(self.engine, timeout_s=sg.timeout_s)
        woke = self.engine is not None and self._engine_asleep
        if woke:  # weights re-allocated but stale: the sync below refills every one
            self.engine.wake(["weights"])
            self._engine_asleep = False
        stats = self._isync.sync(chunks, self.info, sg.bucket_bytes, quantize=fp8_quantizer(self.cfg))
        if woke:
            self.engine.wake(["kv_cache", "cuda_graph"])
        return stats

    def _vllm_sync(self, chunks):
        """Every rank: one vLLM weight-update session, checked whole before it opens; colocated: around the rank-0
        sync (``VLLMSessionSync``), separate: each stage's leader sends its own stage (``VLLMStageSync``)."""
        from megatron_s3ac.rollout.vllm_sync import STRATEGIES

        if getattr(self, "_vsync", None) is None:
            cls = STRATEGIES[str(getattr(self.cfg.rollout.placement, "value", self.cfg.rollout.placement))]
            self._vsync = cls(self.engine, settings=self.cfg.rollout.vllm, quantize=fp8_quantizer(self.cfg))
        if self.engine is not None and self._engine_asleep:
            self.engine.wake()
            self._engine_asleep = False
        return self._vsync.sync(chunks, self.info)

    def close_weight_sync(self) -> None:
        """Leave the broadcast groups (stage leaders and engines); before the engines shut down."""
        if getattr(self, "_bsync", None) is not None:
            self._bsync.close()
            self._bsync = None
        if getattr(self, "_isync", None) is not None:
            self._isync.close()
            self._isync = None

    # ---- idle-model offload (train.offload_idle) -------------------------------------------------
    def _place(self, m: dict, on=(), off=()) -> None:
        """Models in ``off`` to host memory, those in ``on`` back (no-op without train.offload_idle);
        seconds and bytes go to ``m`` (time/offload, mem/offload_gb, mem/<model>_<kind>_gb)."""
        if not self.cfg.train.offload_idle:
            return
        from megatron_s3ac.models.offload import HostOffload

        if not hasattr(self, "_offloaders"):
            self._offloaders = {"actor": HostOffload([self.actor_ddp], self.actor_opt)}
            if self.critic_ddp is not None:
                self._offloaders["critic"] = HostOffload([self.critic_ddp], self.critic_opt)
        for name in off:
            h = self._offloaders.get(name)
            if h is not None and not h.on_host:
                st = h.offload()
                m["time/offload"] = m.get("time/offload", 0.0) + st.seconds
                m["mem/offload_gb"] = m.get("mem/offload_gb", 0.0) + st.total_bytes / 2**30
                m.update({k: v for k, v in st.metrics(name).items() if k.startswith("mem/")})
        for name in on:
            h = self._offloaders.get(name)
            if h is not None and h.on_host:
                m["time/offload"] = m.get("time/offload", 0.0) + h.onload().seconds

    def _engine_sleep(self) -> None:
        """Colocated placement: release the engine's weights while the models train (rank 0)."""
        if self.engine is not None and self.cfg.rollout.placement == "colocated":
            self.engine.sleep()
            self._engine_asleep = True

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

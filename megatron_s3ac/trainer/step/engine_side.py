"""The trainer's engine side: the one weight path actor -> engine (the engine kind's registered sync strategy,
FP8 quantizer), colocated sleep, the models' residency around it (``Trainer.placement``, trainer.step.placement), and
reward scoring (rank 0). A mixin of ``trainer.step.trainer.Trainer``: it uses the Trainer's engine, models, config and
reward pool."""
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
        placement = getattr(self, "placement", None)  # None: a stand-in of the Trainer (tests drive the sync alone)
        if placement is not None:
            placement.before_engine_wake()  # colocated offload: only the actor's params stay for the sync
        return _strategy(self).sync(chunks, self.info,
                                    weights_loaded=None if placement is None else placement.after_weights_loaded)

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

    def sync_weights_soon(self):
        """``sync_weights`` now, or, inside ``models_resident`` (whose exit syncs, after the models left), then: a sync
        in there would wake the engine beside both models."""
        if self.placement.is_resident:
            return None
        return self.sync_weights()

    @contextlib.contextmanager
    def models_resident(self):
        """Both models on the device for work outside a step (checkpoint save / load, pipeline stages). With
        colocated offload (``placement.offload_colocated``) the engine sleeps first (rank 0) and, once the body is done, the
        models leave again and ``sync_weights`` wakes the engine refilled. Collective; a no-op otherwise."""
        if not self.placement.offload_colocated:
            yield
            return
        self.engine_sleep()
        with self.placement.resident():
            yield
        self.engine_sleep()  # the body may have synced (woken) it: wake again only in the colocated order
        self.sync_weights()

    def engine_sleep(self) -> None:
        """Release the engine's memory while the models train (rank 0; the strategies of colocated placements)."""
        _strategy(self).sleep()

    def verifier_pool(self):
        """One verifier pool per run (rank 0), shared by rollouts and evaluation."""
        if self.reward_pool is None:
            from megatron_s3ac.rollout.rewards import RewardPool

            self.reward_pool = RewardPool(num_workers=self.cfg.rollout.reward_workers,
                                          timeout_s=self.cfg.rollout.reward_timeout_s)
        return self.reward_pool

    def score(self, responses: list[str], references: list[str]) -> list[float]:
        """The run's reward (``rollout.reward``) of each response against its reference (rank 0)."""
        from megatron_s3ac.rollout.rewards import get_reward, score_answers

        name = self.cfg.rollout.reward
        return score_answers(name, responses, references, self.verifier_pool() if get_reward(name).isolate else None)

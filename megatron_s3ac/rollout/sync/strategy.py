"""One weight-sync strategy per (engine kind, placement), registered by the engine kind; the trainer calls it blindly.

A strategy owns the whole actor -> engine weight path of one engine kind at one placement, and the engine's
lifecycle around it: ``sleep()`` (release the engine's memory while the models train), ``sync(chunks, info)`` (the
collective sync, waking the engine in its own order first), ``close()`` (leave weight-update groups) and
``close_engine()`` (shut the engine's processes down at the end of a run). Every trainer rank builds the same
strategy from the config (only rank 0 holds the engine: ``engine`` is None elsewhere), so every rank takes the same
path without asking rank 0.

Registration (the API a new engine uses; no trainer edit)::

    register_weight_sync("vllm", "separate", "megatron_s3ac.rollout.engines.vllm.engine:VLLMBroadcastSync")
    register_weight_sync("vllm", "colocated", VLLMColocatedSync)   # or the class itself

``engine`` / ``placement`` may be plain strings or ``str`` Enum members (``config.EngineKind.vllm``); a
target given as ``"module:Class"`` is imported on first lookup, so a registration costs no import (vLLM, sglang or
NCCL code is only imported on the ranks of a run that uses it). A class is called as
``cls(engine, settings=..., quantize=...)``: ``engine`` the rollout engine (rank 0) or None, ``settings`` the
engine kind's own config section (``rollout.<kind>``, e.g. ``SGLangSettings``; None if it has none), ``quantize``
the stream transform the stage leaders apply before the transfer (``rollout.weights_dtype: fp8``) or None.

Built in (``_BUILTIN`` below): cpu / hf at either placement -> the rank-0 path (``rollout.sync.weight_sync``),
colocated sleeping between rollouts; sglang separate -> ``rollout.engines.sglang.broadcast.StageBroadcastSync``;
sglang colocated -> ``rollout.engines.sglang.colocated.ColocatedIPCSync``, woken in sglang's order (weights -> sync
-> kv_cache + cuda_graph); vllm -> ``rollout.engines.vllm.sync`` (colocated ``VLLMSessionSync``, separate
``VLLMStageSync``).
"""
from __future__ import annotations

import importlib
from typing import Any, Optional, Union


class UnknownWeightSync(ValueError):
    """No strategy is registered for an (engine kind, placement) pair; the message names both config keys."""


def _key(x: Any) -> str:
    """A kind or placement as its registry key: an Enum member's value, else the string itself."""
    return str(getattr(x, "value", x))


class WeightSyncStrategy:
    """Base class: one engine kind's weight path at one placement (see the module docstring).

    ``sleeps``: the engine is released while the models train (``sleep`` calls ``engine.sleep()``) and woken by the
    next ``sync``. ``shuts_down_engine``: ``close_engine`` shuts the engine's own processes down (False: an
    in-process engine that needs no shutdown). Subclasses implement ``sync``."""

    sleeps = False
    shuts_down_engine = True

    def __init__(self, engine=None, *, settings: Any = None, quantize=None):
        self.engine, self.settings, self.quantize = engine, settings, quantize
        self.asleep = False  # rank 0: the engine's memory is released (set by sleep, cleared by the next sync's wake)

    def sync(self, chunks, info, weights_loaded=None):
        """Collective over every trainer rank: the actor's model ``chunks`` -> the engine. ``weights_loaded()``, if
        given, is called on every rank once the engine holds the new weights and before it wakes anything else
        (the trainer's colocated offload frees the actor's params there, before the KV cache returns). Returns
        this rank's stats (``SyncStats`` or the path's own, with ``.bytes``)."""
        raise NotImplementedError

    def sleep(self) -> None:
        """Rank 0, from the rollout's end to the next sync: release the engine's memory (``sleeps`` only; a no-op
        when it already sleeps)."""
        if self.sleeps and self.engine is not None and not self.asleep:
            self.engine.sleep()
            self.asleep = True

    def attach(self, engine) -> None:
        """Rank 0: a restarted engine replaces the closed one (after ``close``); the next sync connects to it."""
        self.engine, self.asleep = engine, False

    def close(self) -> None:
        """Leave the weight-update groups / shared segments (before the engines they feed shut down)."""

    def close_engine(self) -> bool:
        """Shut the engine's processes down (rank 0); True if it did, so the caller drops its reference."""
        if self.engine is None or not self.shuts_down_engine:
            return False
        close = getattr(self.engine, "close", None)
        (close if callable(close) else self.engine.shutdown)()
        self.engine = None
        return True


_REGISTRY: dict[tuple[str, str], Union[str, type]] = {}


def register_weight_sync(engine: Any, placement: Any, target: Union[str, type]) -> None:
    """Register ``target`` (a ``WeightSyncStrategy`` subclass, or ``"module:Class"`` imported on first lookup) as the
    weight path of engine kind ``engine`` at ``placement`` ("colocated" | "separate"). Re-registering replaces."""
    if not isinstance(target, str) and not (isinstance(target, type) and issubclass(target, WeightSyncStrategy)):
        raise TypeError(f"register_weight_sync({_key(engine)!r}, {_key(placement)!r}): {target!r} is neither a "
                        f"WeightSyncStrategy subclass nor a 'module:Class' path")
    _REGISTRY[(_key(engine), _key(placement))] = target


def registered_weight_syncs() -> dict[tuple[str, str], Union[str, type]]:
    """{(engine kind, placement): target} of every registration."""
    return dict(_REGISTRY)


def weight_sync_class(engine: Any, placement: Any) -> type:
    """The strategy class registered for (engine, placement); ``UnknownWeightSync`` naming both keys if none."""
    key = (_key(engine), _key(placement))
    target = _REGISTRY.get(key)
    if target is None:
        have = sorted(f"{e}/{p}" for e, p in _REGISTRY)
        raise UnknownWeightSync(f"rollout.engine={key[0]!r} with rollout.placement={key[1]!r}: no weight-sync "
                                f"strategy is registered for this pair (registered: {have}; an engine registers "
                                f"its own with rollout.sync.strategy.register_weight_sync)")
    if isinstance(target, str):
        module, _, name = target.partition(":")
        target = getattr(importlib.import_module(module), name)
        if not (isinstance(target, type) and issubclass(target, WeightSyncStrategy)):
            raise TypeError(f"{_REGISTRY[key]} (registered for {key[0]}/{key[1]}) is not a WeightSyncStrategy")
        _REGISTRY[key] = target
    return target


def make_weight_sync(engine_kind: Any, placement: Any, engine=None, *, settings: Any = None,
                     quantize=None) -> WeightSyncStrategy:
    """The registered strategy for (engine_kind, placement), built around ``engine`` (None off rank 0)."""
    return weight_sync_class(engine_kind, placement)(engine, settings=settings, quantize=quantize)


_BUILTIN: dict[tuple[str, str], str] = {
    ("cpu", "colocated"): "megatron_s3ac.rollout.sync.weight_sync:ColocatedRankZeroSync",
    ("cpu", "separate"): "megatron_s3ac.rollout.sync.weight_sync:RankZeroSync",
    ("hf", "colocated"): "megatron_s3ac.rollout.sync.weight_sync:ColocatedRankZeroSync",
    ("hf", "separate"): "megatron_s3ac.rollout.sync.weight_sync:RankZeroSync",
    ("sglang", "separate"): "megatron_s3ac.rollout.engines.sglang.broadcast:SGLangBroadcastSync",
    ("sglang", "colocated"): "megatron_s3ac.rollout.engines.sglang.colocated:SGLangColocatedSync",
    ("vllm", "colocated"): "megatron_s3ac.rollout.engines.vllm.sync:VLLMSessionSync",
    ("vllm", "separate"): "megatron_s3ac.rollout.engines.vllm.sync:VLLMStageSync",
}
for (_e, _p), _t in _BUILTIN.items():
    register_weight_sync(_e, _p, _t)

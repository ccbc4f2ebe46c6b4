"""The residency audit: at each phase of a trainer step, the bytes of params / grads / optimizer states each model
really keeps on its device, beside the planner's figures for the same config (plan.memory).

``resident_bytes(chunks, optimizer, device)``: {params, grads, optimizer} bytes of the distinct storages of the
model's tensors on ``device`` that hold memory (an offloaded storage is resized to 0 bytes: models.offload), each
storage counted once under the first kind that reaches it, the optimizer's 0-dim step counters left out (the
planner does not count them). ``ResidencyAudit(tr)`` wraps the trainer's phase entry points on the instance and
records a snapshot of both models at each: ``rollout`` (the engine is asked to generate), ``values`` (the critic's
forward), ``old_logprobs`` (the actor's forward), ``actor_update`` / ``critic_update`` (the update starts),
``engine_wake`` (the engine is woken) and ``weight_sync`` (the engine is handed its first bucket of a sync).
The planner's side, {phase: {model: {kind: bytes}}} for the same config, is ``plan.memory.residency`` (the tests
compare the two). Only names that exist since 2c164be
are required.
"""
from __future__ import annotations

import functools

KINDS = ("params", "grads", "optimizer")


def resident_bytes(chunks, optimizer, device) -> dict:
    import torch

    from megatron_s3ac.models.offload import _tensors

    device = torch.device(device)
    seen, out = set(), dict.fromkeys(KINDS, 0)
    for kind, t in _tensors(list(chunks), optimizer):
        if t.device != device or (kind == "optimizer" and t.dim() == 0):
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        out[kind] += st.nbytes()
    return out


def snapshot(tr) -> dict:
    """{"actor" | "critic": {kind: bytes}} resident now (the critic's all 0 without one)."""
    dev = next(p.device for p in tr.actor_ddp.parameters())  # an offloaded storage keeps its device
    out = {"actor": resident_bytes([tr.actor_ddp], tr.actor_opt, dev), "critic": dict.fromkeys(KINDS, 0)}
    if getattr(tr, "critic_ddp", None) is not None:
        out["critic"] = resident_bytes([tr.critic_ddp], tr.critic_opt, dev)
    return out


class ResidencyAudit:
    """Records ``self.log``: [(phase, snapshot)] in the order the phases ran (see the module docstring)."""

    def __init__(self, tr):
        self.tr, self.log = tr, []
        self._wrap(tr, "_forward_only", lambda which, batch, what, *a, **k: {"values": "values", "logp": "old_logprobs"}
                   .get(what))
        self._wrap(tr, "_update", lambda which, *a, **k: f"{which}_update")
        self._wrap(tr, "rollout", lambda *a, **k: "rollout")
        if tr.engine is not None:
            self._wrap(tr.engine, "wake", lambda *a, **k: "engine_wake")
            self._sync_open = False
            orig_sync = tr.sync_weights

            @functools.wraps(orig_sync)
            def sync(*a, **k):
                self._sync_open = True
                try:
                    return orig_sync(*a, **k)
                finally:
                    self._sync_open = False

            tr.sync_weights = sync
            self._wrap(tr.engine, "update_weights", lambda *a, **k: "weight_sync" if self._first_bucket() else None)

    def _first_bucket(self) -> bool:
        first, self._sync_open = self._sync_open, False
        return first

    def _wrap(self, obj, name: str, phase_of) -> None:
        orig = getattr(obj, name)

        @functools.wraps(orig)
        def wrapped(*a, **k):
            phase = phase_of(*a, **k)
            if phase is not None:
                self.log.append((phase, snapshot(self.tr)))
            return orig(*a, **k)

        setattr(obj, name, wrapped)

    def last(self, phase: str) -> dict | None:
        hits = [s for p, s in self.log if p == phase]
        return hits[-1] if hits else None

"""The residency audit: at each phase of a trainer step, the bytes of params / grads / optimizer states each model
really keeps on its device, for comparison with the planner's figures for the same config (plan.memory.residency).

``resident_bytes(chunks, optimizer, device)``: {params, grads, optimizer} bytes of the distinct storages of the
model's tensors on ``device`` that hold memory (an offloaded storage is resized to 0 bytes: models.offload), each
storage counted once under the first kind that reaches it, the optimizer's 0-dim step counters left out (the
planner does not count them). ``ResidencyAudit(tr)`` wraps the trainer's phase entry points on the instance and
records a snapshot of both models at each: ``rollout`` (the engine is asked to generate), ``values`` (the critic's
forward), ``old_logprobs`` (the actor's forward), ``actor_update`` / ``critic_update`` (the update starts),
``engine_wake`` (the engine is woken) and ``weight_sync`` (the engine is handed its first bucket of a sync).
``audit_every(cls)`` installs one on every instance of the trainer class built meanwhile (the rehearsal's ranks);
``peaks(log)`` is the most each (phase, model, kind) held over a log and ``compare(measured, planned, tol)`` the
rows and defects of measured peaks against the planner's {phase: {model: {kind: bytes}}} (trainer/rehearse_run.py
gives it the planner's figures: this floor does not import plan/). Only names that exist since 2c164be are
required of the trainer.
"""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def audit_every(cls, then=None):
    """Within: every ``cls`` instance built gets a ``ResidencyAudit`` once its ``__init__`` returns (then
    ``then(audit)``, while the instance is fresh: its parallel state is still up); yields the list of audits (in
    build order). ``cls.__init__`` is restored on exit."""
    audits, orig = [], cls.__init__

    @functools.wraps(orig)
    def init(self, *a, **k):
        orig(self, *a, **k)
        audits.append(ResidencyAudit(self))
        if then is not None:
            then(audits[-1])

    cls.__init__ = init
    try:
        yield audits
    finally:
        cls.__init__ = orig


def peaks(log) -> dict:
    """{phase: {model: {kind: bytes}}}: the most each kind of each model held at any snapshot of that phase in
    ``log`` ([(phase, snapshot)]; a phase that never ran is absent). The peak, not the last: the first step's
    optimizer states do not exist before its update."""
    out: dict = {}
    for phase, snap in log:
        ph = out.setdefault(phase, {})
        for model, kinds in snap.items():
            m = ph.setdefault(model, dict.fromkeys(KINDS, 0))
            for kind, b in kinds.items():
                m[kind] = max(m[kind], int(b))
    return out


def merge_peaks(*many: dict) -> dict:
    """The elementwise maximum of several ``peaks`` (ranks of one pipeline stage, or two jobs)."""
    return peaks([(ph, snap) for p in many for ph, snap in p.items()])


# the audit's phase -> the planner's phase it is held to: the engine wakes beside what the weight sync keeps
PLANNED_AS = {"engine_wake": "weight_sync"}


def compare(measured: dict, planned: dict, tolerance: float, where: str = "") -> tuple[list, list]:
    """(rows, defects) of ``measured`` peaks against ``planned`` ({phase: {model: {kind: bytes}}}, the planner's for
    the same config and layout). A row per measured (phase, model, kind): {phase, model, kind, measured, planned,
    ratio} (ratio None where the planner has 0). A defect where measured > planned x (1 + tolerance), and
    always where the planner has 0 bytes (the model offloaded in that phase, or no such model) but the phase found
    some: a sentence naming ``where`` (e.g. "pipeline stage 0"), the phase, model, kind and both byte counts."""
    rows, defects = [], []
    for phase, models in measured.items():
        plan = planned.get(PLANNED_AS.get(phase, phase))
        if plan is None:
            continue
        for model, kinds in models.items():
            for kind in KINDS:
                got, want = int(kinds.get(kind, 0)), int(plan.get(model, {}).get(kind, 0))
                ratio = got / want if want else None
                rows.append({"phase": phase, "model": model, "kind": kind, "measured": got, "planned": want,
                             "ratio": ratio, **({"where": where} if where else {})})
                at = f"{where}: " if where else ""
                what = "optimizer states" if kind == "optimizer" else kind
                if got and not want:
                    defects.append(f"{at}{phase}: the {model}'s {what} are resident ({got:,} B) where the planner "
                                   f"has 0 B (offloaded in this phase)")
                elif want and got > want * (1 + tolerance):
                    defects.append(f"{at}{phase}: the {model}'s {what} hold {got:,} B, {ratio:.3f} x the planner's "
                                   f"{want:,} B (tolerance {tolerance:.0%})")
    return rows, defects

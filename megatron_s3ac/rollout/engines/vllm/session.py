"""``update_weights`` as one checked weight-update session: what ``VLLMEngine`` and ``VLLMEnginePool`` share.

The caller's (name, tensor) pairs become tensors, every (name, shape) is checked against the served checkpoint
(on every engine) before anything moves, then the buckets go into the caller's open session or one of its own
(begin ... finish); a failure on the way aborts the session, so the engine keeps the weights it had."""
from __future__ import annotations

from typing import Any, Iterable, Optional


def as_pairs(named_tensors) -> list:
    """[(hf_name, torch.Tensor)] from pairs or a {name: tensor} mapping (numpy arrays accepted)."""
    import torch

    if hasattr(named_tensors, "items"):
        named_tensors = named_tensors.items()
    return [(n, torch.as_tensor(t)) for n, t in named_tensors]


class SessionUpdates:
    """Mixin: ``update_weights`` from the class's ``check_weights``, ``begin_weight_update``, ``_send_pairs``,
    ``finish_weight_update``, ``_abort_quietly`` and ``_session_open``."""

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], bucket_bytes: Optional[int] = None) -> None:
        """Load (hf_name, tensor) pairs, all or nothing: every name / shape checked first, then one session (or
        the caller's open one), loaded when it finishes; the prefix cache is flushed after."""
        pairs = as_pairs(named_tensors)
        seen: set = set()
        for n, _ in pairs:  # the worker would refuse the second one after the first loaded
            if n in seen:
                raise ValueError(f"{self.name}: update_weights: tensor {n!r} appears twice in one update; nothing "
                                 f"was loaded")
            seen.add(n)
        own = not self._session_open
        # own session: these pairs are all of it, so its layers are checked whole too (in the caller's session
        # later calls may complete them)
        self.check_weights([n for n, _ in pairs], [tuple(t.shape) for _, t in pairs], session=own)
        if own:
            self.begin_weight_update()
        try:
            self._send_pairs(pairs, bucket_bytes)
        except BaseException:
            self._abort_quietly()
            raise
        if own:
            self.finish_weight_update()

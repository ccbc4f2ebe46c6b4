"""Partial rollout in the asynchronous loop (``rollout.partial_rollout: true``; rollout/partial.py, docs/rollout.md
"Partial rollout", docs/algorithms.md "Off-policy update").

At the end of step s the synchronous-weights loop (trainer/step/async_loop.py) waits for every prefetched batch before
it syncs. With partial rollout it pauses the engine instead (``interrupt``): the batches come back at once, their
unfinished responses with finish_reason "abort" and what they have; after the sync (weights version s + 1)
``resume`` continues them on the new weights, each new token tagged s + 1. When the batch is collected
(``tag_collected``) every rank learns each sample's versions from rank 0: its staleness is its oldest token's
(``"version"``, what ``train.max_staleness`` bounds: unchanged by resumption, since resumed tokens are newer), the
token-weighted staleness uses each token's own version (``"version_mean"``), and ``"n_versions"`` feeds
``async/versions_per_response_*``.

Where a response is cut depends on timing (how far the engine got while the trainer trained), so a run with
partial rollout is not bit-reproducible; a checkpoint still saves the merged responses (``state_dict`` waits for the
continuations) and a resumed run trains exactly those.
"""
from __future__ import annotations

import sys

import torch.distributed as dist


class PartialRollout:
    """The partial-rollout part of an ``AsyncSource`` ``ar`` (one per run)."""

    def __init__(self, ar, max_versions: int):
        self.ar, self.max_versions = ar, int(max_versions)
        self.step_counts = {"async/partial_interrupted": 0, "async/partial_resumes": 0,
                            "async/partial_regenerated": 0, "async/partial_unstarted": 0,
                            "async/partial_kept_tokens": 0}
        self.resumes_total = 0
        self._paused = False
        tr = ar.tr
        if tr.rank == 0 and not getattr(tr.engine, "supports_pause", False):
            from megatron_s3ac.rollout.base import PartialRolloutUnsupported

            raise PartialRolloutUnsupported(f"rollout.partial_rollout=true: the rollout engine {tr.engine!r} cannot "
                                            f"pause generation (a separate CPU engine started pausable can)")

    # ---- at the sync ----------------------------------------------------------------------------
    def interrupt(self) -> None:
        """Every rank (collective through ``ar._await``): rank 0 pauses the engine, then every prefetched batch
        returns at once. A dead engine is left to ``_await`` (restart, re-sync, resubmit)."""
        tr = self.ar.tr
        if tr.rank == 0 and any(not e.collected for e in self.ar.queue):
            try:
                tr.engine.pause_generation()
                self._paused = True
            except Exception as err:  # noqa: BLE001 - a dead engine: _await below learns it and restarts it
                print(f"s3ac: pause_generation failed ({type(err).__name__}: {err}); waiting for the batches",
                      file=sys.stderr, flush=True)
        self.ar._await(list(self.ar.queue))

    def resume(self, version: int) -> None:
        """Rank 0, after the weight sync to ``version``: continue generation and resubmit every aborted response of
        the queued batches as a continuation (or from its prompt, past ``rollout.partial_max_versions``). A batch
        already resumed (its continuation in flight: a restart in this call resubmitted it) is left as it is. May
        raise the engine's death (``engine_death_types``): ``AsyncSource.sync_weights`` shares it and recovers."""
        from megatron_s3ac.rollout.partial import PartialPending, continuation_requests

        ar, tr = self.ar, self.ar.tr
        if tr.rank != 0:
            return
        if self._paused:
            tr.engine.continue_generation()
            self._paused = False
        r = tr.cfg.rollout
        for e in ar.queue:
            if e.pending is None or (not e.collected and isinstance(e.pending, PartialPending)):
                continue  # its continuations are in flight: resumed already (a restart in this call resent them)
            groups, reqs, n = continuation_requests(ar._result(e), e.version, version, r.max_new_tokens,
                                                    self.max_versions, ar._params(e.step).length_tail)
            self.step_counts["async/partial_interrupted"] += len(reqs)
            self.step_counts["async/partial_resumes"] += n.resumed
            self.step_counts["async/partial_regenerated"] += n.regenerated
            self.step_counts["async/partial_unstarted"] += n.unstarted
            self.step_counts["async/partial_kept_tokens"] += n.kept_tokens
            self.resumes_total += n.resumed
            self.send(e, groups, reqs, version)

    def send(self, e, groups, reqs, version: int) -> None:
        """Rank 0: ``e``'s aborted samples ``reqs`` (``continuation_requests``) to the engine as continuations on
        weights ``version``; ``e.pending`` becomes the ``PartialPending`` that merges them into ``groups``."""
        from megatron_s3ac.rollout.partial import PartialPending

        ar, tr = self.ar, self.ar.tr
        pend = None
        if reqs:
            import dataclasses

            # a seed of its own per (batch, version): the continuation draws differ from the first piece's
            p = ar._params(e.step)
            # (and no length_tail: each continuation carries its own budget, what is left of its response's)
            p = dataclasses.replace(p, seed=p.seed + 104_729 * (version + 1), length_tail=())
            # an image prompt's continuation needs its images again (the engine would prefill the image pad
            # tokens as text otherwise: sglang/engine.py generate_continuations); text-only batches pass none
            images = [groups[gi][ki].images for gi, ki, _, _ in reqs]
            kw = {"images": images} if any(im is not None for im in images) else {}
            pend = tr.engine.continue_async([(pre, b) for _, _, pre, b in reqs], p,
                                            return_routed_experts=tr.r3_on, **kw)
        e.pending = PartialPending(groups, reqs, pend, version)
        if reqs:  # streaming rewards scored the pieces: the merged responses are scored at collection instead
            e.rewards = None
        e.collected = not reqs  # its continuation's engine span is this run's engine time

    def resubmit(self, e, version: int) -> bool:
        """Rank 0, after an engine restart (``AsyncSource._restart``): a batch whose continuations the dead engine
        had not returned sends the same continuations to the rebuilt engine (weights ``version``), so its kept
        pieces - tokens, behaviour log-probs and versions of the weights that generated them - and its finished
        samples stay; True if it did (False: not a resumed batch, resubmitted from its prompts). Issue 41, fifth
        review, finding 1: the whole batch was generated again from its prompts, its pieces lost while the step's
        partial-rollout counts still held them."""
        from megatron_s3ac.rollout.partial import PartialPending

        p = e.pending
        if not isinstance(p, PartialPending) or p.pending is None:
            return False
        self.send(e, p.groups, p.reqs, version)
        return True

    def restarted(self) -> None:
        """Every rank: the engine was rebuilt; the new one is not paused (its ``continue_generation`` is not
        called: on SGLang it would refuse while a resubmitted generate runs)."""
        self._paused = False

    # ---- at collection ----------------------------------------------------------------------------
    def tag_collected(self, e, samples: list[dict], groups) -> None:
        """Every rank: set "version" (oldest token's), "version_mean" and "n_versions" on the first round's sample
        dicts (``samples[:n]``, n = K x its groups without an aborted sample, in order: ``Trainer.rollout``'s
        filter) from rank 0's ``groups``."""
        from megatron_s3ac.rollout.partial import sample_versions

        tr = self.ar.tr
        info = [None]
        if tr.rank == 0:
            kept = [g for g in groups if all(s.finish_reason != "abort" for s in g)]
            info = [[v for row in sample_versions(kept, e.version) for v in row]]
        if tr.world > 1:
            dist.broadcast_object_list(info, src=0)
        for d, (oldest, mean, nv) in zip(samples, info[0]):
            d["version"], d["version_mean"], d["n_versions"] = oldest, mean, nv

    def metrics(self) -> dict:
        """This step's counts (rank 0 saw them; other ranks report 0) and the run's resumes so far; reset."""
        m = dict(self.step_counts, **{"async/partial_resumes_total": self.resumes_total})
        for k in self.step_counts:
            self.step_counts[k] = 0
        return m


def versions_metrics(samples: list[dict]) -> dict:
    """``async/versions_per_response_{mean,max}`` over the trained samples (each with "n_versions")."""
    nv = [int(d["n_versions"]) for d in samples if "n_versions" in d]
    if not nv:
        return {}
    return {"async/versions_per_response_mean": sum(nv) / len(nv), "async/versions_per_response_max": float(max(nv))}


def make_partial(ar):
    """A ``PartialRollout`` when ``rollout.partial_rollout`` is on, else None (the loop as without it)."""
    cfg = getattr(ar.tr, "cfg", None)
    r = getattr(cfg, "rollout", None)
    if r is None or not getattr(r, "partial_rollout", False):
        return None
    return PartialRollout(ar, int(r.partial_max_versions))


__all__ = ["PartialRollout", "make_partial", "versions_metrics"]

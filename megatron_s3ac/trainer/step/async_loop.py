"""Bounded-staleness asynchronous rollout (``train.max_staleness: N >= 1``; docs/trainer.md "Asynchronous rollout").

The synchronous step (``Trainer.step``) generates, scores and trains in turn while a separate engine idles during
training. Here the engine (``rollout.placement: separate``: a Ray actor, ``RemoteEngine`` / ``EnginePool``) always
has the next batches queued: at step s the batches for steps s .. s+N are in flight or done, and the one for step
s+N is submitted at the start of step s, before training, with the engine's weights of that moment (version s).
The engine's actor runs its calls in order, so that generation runs while step s trains, and the weight sync at the
end of step s loads after it.

Weights version: the engine holds version v once the weights after trainer step v-1 are synced (v = 0 at start).
A sample generated with version v is trained at step s with staleness s - v: N for a prefetched batch in the
steady state (fewer in the first N steps), 0 for a DAPO refill round (generated now, synchronously). The bound
s - v <= N is checked on every trained sample.

What keeps the update correct off-policy (docs/algorithms.md "Off-policy update"): every response token carries its
behaviour log-prob (the engine's) and its weights version; the old log-probs are recomputed by the current actor
(the proximal policy of decoupled PPO, ``Trainer.old_logprobs``); token IS weights old/behaviour with
``algo.tis_cap``, IcePoP and MIS act on that ratio (``Trainer.advantages``); values and GAE come from the current
critic; R3 replays the routes the generating version chose.

Prompt selection: a batch's prompts are chosen when it is submitted, so DAPS scores them with V(s0) of the critic
of that moment (N steps before they train) and updates its counts when the batch is collected.

Engine failure: rank 0 waits for the engine at two points of a step and broadcasts its verdict; a dead engine is
rebuilt, re-synced (every rank) and its unreturned batches resubmitted, at most ``rollout.max_engine_restarts``
times a step (``rollout/engine_restarts``). The queue is saved with the checkpoint (``state_dict``).

Overlapped weight sync (``rollout.sync.overlap: true``; an engine whose ``EngineSpec.stage_weights`` says it can
stage, the CPU engine's ``RemoteEngine`` here): the sync at the end of step s does not wait for the batches in
flight. Its buckets go to the engine's staging copy while the engine still generates them on version s; the swap
is queued behind them in the engine's call order, so every batch submitted from step s + 1 on is generated with
version s + 1 and the ``Submitted.version`` bookkeeping is the plain loop's. ``time/weight_sync_exposed_s``: the
seconds the trainer blocked in the step's sync (both paths).

Partial rollout (``rollout.partial_rollout: true``; trainer/step/async_partial.py): at the sync the engine is paused
instead of waited for, and the unfinished responses resume on the new weights, each token tagged with its version;
a sample's staleness is then its oldest token's.

This is a rollout source (trainer.step.source): ``Trainer.step`` is the one step frame and calls ``next_batch``,
``sync_weights`` and ``end_step`` here when ``train.max_staleness > 0``; every rank runs them (prompt selection, the
DAPO filter and the training phases are collective); rank 0 owns the engine, submits and waits.
"""
from __future__ import annotations

import collections
import dataclasses
import sys
import time

import torch

from megatron_s3ac.trainer.step.batch import RolloutMeta


@dataclasses.dataclass(eq=False)  # compared by identity (pids is a tensor)
class Submitted:
    """One prefetched batch: the step it trains at, its prompts and selection stats, the weights version that
    generates it, and (rank 0) the engine's pending generation."""

    step: int
    pids: torch.Tensor
    stats: dict
    version: int
    pending: object = None
    collected: bool = False  # rank 0: its samples are back (and its engine span recorded)
    rewards: list | None = None  # rank 0, streaming rewards: each group's rewards (None: an aborted group)
    reserve: torch.Tensor | None = None  # algo.refill_eager: the replacement candidates, chosen with the batch
    eager: object = None  # rank 0, algo.refill_eager: the round and its replacements as streamed (EagerRefill)


def staleness_metrics(samples: list[dict], step: int) -> dict:
    """``async/staleness_*`` over the trained samples (each with "version" and "rlen"): the mean over response
    tokens, the mean over samples and the max, in weight versions (step - version). With partial rollout a sample
    also has "version_mean" (its tokens' mean version): the token mean uses it, the sample mean and max its oldest
    token's "version"."""
    if not samples:
        return {}
    st = torch.tensor([step - int(d["version"]) for d in samples], dtype=torch.float64)
    tok = torch.tensor([step - float(d.get("version_mean", d["version"])) for d in samples], dtype=torch.float64)
    n = torch.tensor([int(d["rlen"]) for d in samples], dtype=torch.float64)
    return {"async/staleness_mean": float((tok * n).sum() / n.sum().clamp(min=1.0)),
            "async/staleness_sample_mean": float(st.mean()), "async/staleness_max": float(st.max()),
            "async/trained_tokens": float(n.sum())}


def engine_death_types() -> tuple:
    """The errors that say a separate engine's process died or stopped answering (RemoteEngine, EnginePool)."""
    from megatron_s3ac.rollout.engines.remote import RemoteEngineDied, RemoteEngineTimeout
    from megatron_s3ac.rollout.engines.pool import EngineDied, EngineTimeout

    return (RemoteEngineDied, RemoteEngineTimeout, EngineDied, EngineTimeout)


class _Floats(list):
    """A list of rewards with ``tolist()`` (as the pool stream's float32 arrays)."""

    def tolist(self):
        return list(self)


def reward_overlap(events: list) -> dict:
    """Streaming rewards' waiting saved, from the ("generated" | "scored", step, group, time) events of one step's
    awaited batches: ``time/reward_overlap_s``, the seconds during which some group was being scored while its
    batch was still generating (scoring the batch path would have done after the slowest group), and
    ``time/reward_tail_s``, the seconds the trainer still waited on scores after each batch's last group arrived."""
    by_step: dict = {}
    for kind, step, i, t in events:
        by_step.setdefault(step, {"generated": {}, "scored": {}})[kind][i] = t
    overlap = tail = 0.0
    for d in by_step.values():
        if not d["generated"]:
            continue
        end = max(d["generated"].values())
        spans = sorted((d["generated"][i], min(d["scored"][i], end)) for i in d["scored"] if i in d["generated"])
        lo = None
        for a, b in spans:  # the union of [arrival, min(scored, generation end)]
            if lo is None or a > hi:
                if lo is not None:
                    overlap += hi - lo
                lo, hi = a, b
            else:
                hi = max(hi, b)
        if lo is not None:
            overlap += max(0.0, hi - lo)
        tail += max(0.0, max(d["scored"].values(), default=end) - end)
    return {"time/reward_overlap_s": overlap, "time/reward_tail_s": tail}


def busy_seconds(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by the union of the (start, end) generation spans (a serial engine's spans do
    not overlap; a continuously batching one's, vLLM's continuations beside the next batch, do)."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in spans):
        if b > end and b > a:
            total += b - max(a, end)
            end = b
    return total


class AsyncSource:
    """The asynchronous rollout source of a ``Trainer`` (see the module docstring). ``tr``: the trainer;
    ``max_staleness``: N >= 1."""

    def __init__(self, tr, max_staleness: int):
        if max_staleness < 1:
            raise ValueError(f"max_staleness={max_staleness} must be >= 1 for the asynchronous loop")
        self.tr, self.n = tr, int(max_staleness)
        self.queue: collections.deque[Submitted] = collections.deque()
        self.spans: list[tuple[float, float]] = []  # rank 0: engine generation spans not yet older than a step
        self.wait_s = 0.0  # rank 0: seconds spent waiting on the engine in the current step
        self.log: list[tuple[int, int, tuple[float, float] | None]] = []  # rank 0: (step, version, engine span)
        self.restarts = 0  # engine restarts in this run (rollout/engine_restarts)
        self.stream = bool(getattr(tr.cfg.rollout, "stream_rewards", False)) if hasattr(tr, "cfg") else False
        algo = getattr(getattr(tr, "cfg", None), "algo", None)  # algo.refill_eager (validated at load)
        self.eager = bool(getattr(algo, "dynamic_sampling_refill", False) and getattr(algo, "refill_eager", False))
        self.reward_events: list = []  # rank 0, streaming rewards: (kind, step, group, time) of the current step
        self.reward_log: collections.deque = collections.deque(maxlen=100_000)  # the same over the run (tests)
        self.eager_log: collections.deque = collections.deque(maxlen=100_000)  # rank 0: (step, EagerRefill events)
        self._step_restarts = 0  # in the current step (bounded by rollout.max_engine_restarts)
        self._trained = False  # the current step's update is done: a re-sync sends version step + 1
        self.version = 0  # the weights version the engine holds (the trainer step whose weights it last received)
        from megatron_s3ac.trainer.step.async_partial import make_partial

        self.partial = make_partial(self)  # rollout.partial_rollout: None unless on
        sync_cfg = getattr(getattr(getattr(tr, "cfg", None), "rollout", None), "sync", None)
        self.overlap = bool(getattr(sync_cfg, "overlap", False))  # rollout.sync.overlap (validated at load)
        if self.overlap and tr.rank == 0 and not getattr(tr.engine, "stageable", False):
            raise RuntimeError(f"rollout.sync.overlap=true: the rollout engine {tr.engine!r} was not started with a "
                               f"staging copy (RemoteEngine(stageable=True))")

    # ---- submission ---------------------------------------------------------------------------
    def _params(self, step: int):
        """The sampling params of ``step``'s first round (trainer.step.rollout_phases.sampling_params: one seed rule)."""
        from megatron_s3ac.trainer.step.rollout_phases import sampling_params

        return sampling_params(self.tr.cfg, step)

    def submit(self, step: int) -> None:
        """Every rank: choose the prompts of ``step``'s batch now (DAPS: the critic of this moment); rank 0 hands
        them to the engine without waiting."""
        tr = self.tr
        pids, stats = tr.select_prompts()
        e = Submitted(step, pids, stats, self.version)
        if self.eager:  # the replacement candidates too, collectively now, so rank 0 submits them mid-round alone
            e.reserve = tr.select_reserve()
        if tr.rank == 0:
            self._send(e)
        self.queue.append(e)

    def _send(self, e: Submitted) -> None:
        """Rank 0: hand ``e``'s prompts to the engine (its sampling seed is the step's, whenever it is sent)."""
        tr = self.tr
        e.collected, e.rewards, e.eager = False, None, None
        # streaming rewards: the engine hands each group back as it finishes (RolloutEngine.generate_stream_async)
        submit = tr.engine.generate_stream_async if self.stream else tr.engine.generate_async
        e.pending = submit([tr.prompts[int(i)].ids for i in e.pids], self._params(e.step),
                           n_samples=tr.cfg.rollout.k, return_routed_experts=tr.r3_on,
                           **tr.image_kwargs(e.pids))  # image prompts: as rollout_phases

    # ---- engine failure: restart, re-sync, resubmit ----------------------------------------------
    def _await(self, entries: list) -> None:
        """Every rank (collective): rank 0 waits for ``entries``' generations; if the engine died (its process
        killed or crashed: ``RemoteEngineDied`` / ``EngineDied``, or timed out), every rank learns it from rank 0,
        the engine is rebuilt and re-synced with the actor's current weights, and every batch it had not returned
        is sent again (then tagged with the re-synced version) - at most ``rollout.max_engine_restarts`` times in
        one step, then a RuntimeError naming the last failure."""
        tr = self.tr
        while True:
            verdict = [None]
            if tr.rank == 0:
                try:
                    for e in entries:
                        self._result(e)
                except engine_death_types() as err:
                    verdict = [(f"{type(err).__name__}: {err}", self.lost_steps(entries))]
            # the other ranks wait for rank 0's wait on the engine on the gloo group with the run's deadline
            # (trainer.step.rank0: never inside a default-group collective that NCCL's watchdog would abort)
            verdict = self._share(verdict[0])
            if verdict is None:
                return
            self.recover(*verdict, entries=entries)

    def lost_steps(self, entries=()) -> list:
        """Rank 0: the steps of the batches the engine had not handed back (to resubmit after a restart)."""
        return ([q.step for q in self.queue if not q.collected]
                + [q.step for q in entries if not q.collected and q not in self.queue])

    def recover(self, why: str, lost, entries=()) -> None:
        """Every rank (collective), once all know the engine died (``why``; ``lost``: the steps of the batches it had
        not returned): count the restart (at most ``rollout.max_engine_restarts`` in one step, then a RuntimeError
        naming the last failure), rebuild the engine, re-sync it with the actor's current weights and resubmit the
        lost batches."""
        tr = self.tr
        self._step_restarts += 1
        if self._step_restarts > tr.cfg.rollout.max_engine_restarts:
            raise RuntimeError(f"the rollout engine died {self._step_restarts} times in step {tr.step_idx} "
                               f"(rollout.max_engine_restarts={tr.cfg.rollout.max_engine_restarts}); last: {why}")
        self._restart(why, set(lost), list(entries))

    def _sync_surviving(self, staged: bool = False) -> None:
        """Every rank: ``Trainer.sync_weights`` that survives the engine dying during it (its process killed while
        it loads a bucket): the sync runs to its end on every rank (``rollout.sync.weight_sync``: a failed engine takes
        no more buckets, the export's collectives go on), rank 0's verdict is shared, and a dead engine is rebuilt
        and synced again (``recover``), its unreturned batches resubmitted. ``staged`` (rollout.sync.overlap):
        rank 0's engine takes the buckets into its staging copy while it generates and swaps them in behind the
        batches in flight (``RemoteEngine.commit_staged``); a rebuilt engine has nothing in flight and is synced
        plainly."""
        tr = self.tr
        while True:
            verdict = None
            engine = tr.engine if staged and tr.rank == 0 else None
            try:
                if engine is not None:
                    engine.staging = True
                try:
                    tr.sync_weights()
                finally:
                    if engine is not None:
                        engine.staging = False
                if engine is not None:
                    engine.commit_staged()
            except engine_death_types() as err:
                if tr.rank != 0:
                    raise
                verdict = (f"{type(err).__name__} during the weight sync: {err}", self.lost_steps())
            verdict = self._share(verdict)
            if verdict is None:
                return
            self.recover(*verdict)
            return  # recover re-synced the rebuilt engine

    def generate(self, fn):
        """Every rank (collective): rank 0's generation ``fn()`` (a refill round's), guarded: if the engine died in it,
        every rank learns so from rank 0, the engine is rebuilt and re-synced (``recover``) and ``fn`` runs again.
        Returns the groups on rank 0, None elsewhere."""
        tr = self.tr
        while True:
            groups, verdict = None, None
            if tr.rank == 0:
                try:
                    groups = fn()
                except engine_death_types() as err:
                    verdict = (f"{type(err).__name__} during a rollout round: {err}", self.lost_steps())
            verdict = tr.rank0.share("rollout generation", verdict)
            if verdict is None:
                return groups
            self.recover(*verdict)

    def _share(self, verdict):
        """Rank 0's engine verdict (None: the engine answered; else (why, lost steps)) on every rank, through
        ``Trainer.rank0`` (``Rank0Phases``: a gloo group whose deadline is ``train.dist_timeout_s``)."""
        tr = self.tr
        return tr.rank0.share("asynchronous rollout's engine wait", verdict) if tr.world > 1 else verdict

    def _restart(self, why: str, lost: set, entries: list) -> None:
        from megatron_s3ac.trainer.step import build as B

        tr = self.tr
        self.restarts += 1
        tr.close_weight_sync()  # every rank: the dead engine's sync sessions / groups (the next sync reconnects)
        if tr.rank == 0:
            print(f"s3ac: the rollout engine died ({why}); restarting it (restart {self._step_restarts} of at most "
                  f"{tr.cfg.rollout.max_engine_restarts} in this step), re-syncing the weights and resubmitting "
                  f"{len(lost)} batch(es)", file=sys.stderr, flush=True)
            try:
                getattr(tr.engine, "close", tr.engine.shutdown)()
            except Exception:  # noqa: BLE001 - already dead; close only releases what is left
                pass
            tr.engine, _ = B.build_engine(tr.cfg, tr.info, multimodal=tr.multimodal)
            tr.sync_strategy.attach(tr.engine)
        self._sync_surviving()  # every rank: the new engine gets the actor's weights of this moment (a death here too
        # is recovered, within the same bound)
        version = tr.step_idx + int(self._trained)  # after this step's update: its next version
        self.version = version  # what the rebuilt engine holds (a later eager replacement is tagged with it)
        # the batch being awaited first: the engine runs its calls in order, and the trainer waits for this one now
        if self.partial is not None:
            self.partial.restarted()
        for e in [q for q in entries if q not in self.queue] + list(self.queue):
            if e.step in lost:
                # partial rollout: a batch whose continuations were lost sends them again (its pieces kept, its
                # version the oldest token's as before); any other batch is generated again, tagged ``version``
                if tr.rank == 0 and self.partial is not None and self.partial.resubmit(e, version):
                    continue
                e.version = version
                if tr.rank == 0:
                    self._send(e)

    def _result(self, e: Submitted):
        """Rank 0: the batch's samples, waiting for them if needed (counted in the trainer's wait time)."""
        if e.pending is None:
            return None
        from megatron_s3ac.rollout.base import StreamingGeneration

        t = time.time()
        # a streamed first piece only: a partial-rollout batch resumed after a sync (PartialPending, whose .groups is
        # its list of pieces) is scored whole at collection
        if self.eager and e.eager is None and isinstance(e.pending, StreamingGeneration):
            e.eager = self._score_eager(e)
        elif self.stream and e.rewards is None and isinstance(e.pending, StreamingGeneration):
            e.rewards = self._score_stream(e)
        groups = e.pending.result()
        self.wait_s += time.time() - t
        if not e.collected:
            e.collected = True
            if e.pending.timing is not None:
                self.spans.append(e.pending.timing)
            self.log.append((e.step, e.version, e.pending.timing))
        return groups

    # ---- streaming rewards ----------------------------------------------------------------------
    def _score_eager(self, e: Submitted):
        """Rank 0, ``algo.refill_eager``: score ``e``'s groups as they stream back and hand the engine a replacement
        (the next of ``e.reserve``, its slot's seed for step ``e.step``) the moment one is scored uninformative
        (``Trainer.eager_generate``). Each replacement is tagged with the weights version the engine holds when it
        is submitted (>= ``e.version``: the staleness bound holds). Records the reward events and engine spans."""
        tr = self.tr
        er = tr.eager_generate(e.pids, e.reserve, first=e.pending, version=lambda: self.version, step=e.step)
        kinds = {"arrived": "generated", "scored": "scored"}
        self.reward_events.extend((kinds[kind], e.step, slot, t) for kind, slot, t in er.events if kind in kinds)
        self.spans.extend(t for t in er.timings if t is not e.pending.timing)  # the round's own: at collection
        self.eager_log.append((e.step, list(er.events)))
        return er

    def _score_stream(self, e: Submitted) -> list:
        """Rank 0: score ``e``'s groups as the engine hands them back (``StreamingGeneration.groups()``): an isolated
        reward goes to the pool's workers at once (``RewardPool.stream``), a cheap one is scored inline; a group is
        complete when its K answers are scored. Returns each group's rewards in prompt order (None for a group with
        an aborted sample, which the rollout drops unscored). Records ("generated" | "scored", step, group index,
        time.time()) in ``self.reward_events``; the scores are ``Trainer.score``'s, whatever the order."""
        from megatron_s3ac.rollout.rewards import get_reward

        tr, ev = self.tr, self.reward_events
        name = tr.cfg.rollout.reward
        stream = tr.verifier_pool().stream(name) if get_reward(name).isolate else None
        rewards: dict = {}

        def scored(items):
            for i, r in items:
                rewards[i] = r.tolist()
                ev.append(("scored", e.step, i, time.time()))

        try:
            for i, group in e.pending.groups():
                ev.append(("generated", e.step, i, time.time()))
                if any(smp.finish_reason == "abort" for smp in group):
                    rewards[i] = None
                    continue
                ref = tr.prompts[int(e.pids[i])].reference
                texts = [tr.decode(smp.response_ids) for smp in group]
                if stream is None:
                    scored([(i, _Floats(tr.score(texts, [ref] * len(texts))))])
                else:
                    stream.add(i, texts, [ref] * len(texts))
                    scored(stream.poll(0.0))
        finally:  # the engine died mid-stream too: no answer of this stream is left with the pool's workers
            if stream is not None:
                scored(stream.wait_all())
        return [rewards[i] for i in range(len(e.pids))]

    # ---- the source's part of a step (trainer.step.source) ------------------------------------------------
    def next_batch(self, m: dict):
        """Every rank: keep N batches in flight (submitting the new ones with the engine's current weights), wait for
        this step's (a dead engine is restarted here), then the synchronous rollout phases on it: its groups already
        generated (``FirstRound``), DAPO's refill rounds generated now. Checks the staleness bound on the kept
        samples and adds ``async/staleness_*`` (and partial rollout's ``async/versions_per_response_*``)."""
        from megatron_s3ac.trainer.step.rollout_phases import FirstRound

        tr = self.tr
        s = tr.step_idx
        self.wait_s, self._step_restarts, self._trained = 0.0, 0, False
        self.reward_events = []
        self.version = s  # the engine holds this step's weights (synced at the end of the last step / resume)
        last = max(tr.cfg.train.steps, s + 1)  # no batch for a step that will not run
        while len(self.queue) <= self.n and s + len(self.queue) < last:
            self.submit(s + len(self.queue))
        e = self.queue.popleft()
        if e.step != s:
            raise RuntimeError(f"asynchronous rollout: the next prefetched batch is for step {e.step}, not {s}")
        self._await([e])  # a dead engine is restarted here (every rank joins its re-sync)
        groups = self._result(e)

        def tag(samples: list, round_idx: int) -> None:  # the weights version that generated each sample
            for d in samples:
                d["version"] = e.version if round_idx == 0 else self.version
            if round_idx == 0 and self.partial is not None:  # each token's version: rank 0's groups
                self.partial.tag_collected(e, samples, groups)

        first = FirstRound(e.pids, e.stats, groups, e.rewards, tag, reserve=e.reserve, eager=e.eager)
        if not tr.cfg.algo.dynamic_sampling_refill:
            r = tr.rollout_once(m, first)
        else:
            r = tr.rollout_eager(m, first) if self.eager else tr.rollout_refilled(m, first)
        if r.batch is not None:
            st = staleness_metrics(r.kept, s)
            if st and st["async/staleness_max"] > self.n:
                raise RuntimeError(f"asynchronous rollout: a sample {st['async/staleness_max']:g} weight versions "
                                   f"old would train at step {s}, above train.max_staleness={self.n}")
            r.metrics.update(st)
            if self.partial is not None:
                from megatron_s3ac.trainer.step.async_partial import versions_metrics

                r.metrics.update(versions_metrics(r.kept))
        return r

    def sync_weights(self, m: dict) -> None:
        """Every rank, after the step's update: wait for the batches in flight (the engine loads the new weights after
        them: its calls run in order; waited for here, not inside the sync's collectives) or, with partial rollout,
        pause the engine so that they return at once; sync (an engine killed during it is restarted and re-synced);
        partial rollout resumes the unfinished responses on the new weights."""
        tr = self.tr
        self._trained = True  # from here a re-sync sends the updated weights (version s + 1)
        t0 = time.time()
        if self.overlap:  # the batches in flight finish on version s; the swap waits for them, not the trainer
            t = time.time()
            self._sync_surviving(staged=True)
        else:
            if self.partial is not None:
                self.partial.interrupt()
            else:
                self._await(list(self.queue))
            t = time.time()
            self._sync_surviving()
        m["time/sync"] = time.time() - t
        if self.partial is not None:
            self._resume(tr.step_idx + 1)  # rank 0: the unfinished responses continue on the new weights
        m["time/weight_sync_exposed_s"] = time.time() - t0  # what the trainer waited for: drain + sync, or staging

    def _resume(self, version: int) -> None:
        """Every rank: partial rollout's ``resume`` on rank 0, guarded as ``generate``: an engine that dies while it
        is told to continue or takes the continuations is rebuilt, re-synced and the batches it had not returned
        resubmitted (their continuations again, ``PartialRollout.resubmit``), then the rest resume on the new one.
        Issue 41, fifth review, finding 1: rank 0 raised the death alone, out of the step, the others went on."""
        tr = self.tr
        while True:
            verdict = None
            if tr.rank == 0:
                try:
                    self.partial.resume(version)
                except engine_death_types() as err:
                    verdict = (f"{type(err).__name__} while partial rollout resumed: {err}", self.lost_steps())
            verdict = self._share(verdict)
            if verdict is None:
                return
            self.recover(*verdict)

    def end_step(self, m: dict, t0: float, result) -> None:
        """After the step (``Trainer.step_idx`` advanced): the engine's weights version, ``time/step`` and the
        asynchronous metrics (engine restarts, trainer wait, engine busy / idle, throughput, in flight)."""
        self.version = self.tr.step_idx  # a step without a batch: the weights (and so the version) carry over
        # step_idx now counts this step's update: a re-sync from here (the checkpoint's drain, before_save) sends
        # version step_idx, not step_idx + 1
        self._trained = False
        self._finish(m, t0, result.kept)

    def before_save(self) -> None:
        """Every rank (collective), before a checkpoint is written: collect every queued batch still generating
        (``rollout.sync.overlap`` leaves the batches in flight through the sync, partial rollout its continuations),
        through ``_await``: rank 0's wait is shared on the gloo ``Trainer.rank0`` group and a dead engine is
        rebuilt, re-synced and its batches resubmitted. ``state_dict`` then waits for nothing: it runs on rank 0
        alone inside the save, between default-group barriers (issue 41, fourth review, finding 1)."""
        self._await(list(self.queue))

    def state_dict(self) -> dict:
        return state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        load_state_dict(self, state, self.tr.rank)

    def _finish(self, m: dict, t0: float, kept: list) -> dict:
        t = time.time()
        m["time/step"] = t - t0
        m["rollout/engine_restarts"] = self.restarts
        if self.partial is not None:
            m.update(self.partial.metrics())
        if self.tr.rank == 0:
            busy = busy_seconds(self.spans, t0, t)
            m.update({"time/trainer_wait": self.wait_s, "time/engine_busy_frac": busy / max(t - t0, 1e-9),
                      "time/engine_idle_frac": 1.0 - busy / max(t - t0, 1e-9),
                      "time/tokens_per_s": sum(int(d["rlen"]) for d in kept) / max(t - t0, 1e-9),
                      "time/samples_per_s": len(kept) / max(t - t0, 1e-9), "async/in_flight": len(self.queue)})
            if self.stream:
                m.update(reward_overlap(self.reward_events))
                self.reward_log.extend(self.reward_events)
            self.spans = [sp for sp in self.spans if sp[1] > t]  # later steps only see what is still running
        return m


# ---- checkpoint: the batches generated but not trained yet -----------------------------------------------
def _plain_sample(smp) -> dict:
    """A ``rollout.base.Sample`` as tensors, numbers and strings (``checkpoint.safe_load`` reads it back)."""
    import numpy as np

    return {"prompt_ids": [int(t) for t in smp.prompt_ids], "response_ids": [int(t) for t in smp.response_ids],
            "logprobs": torch.from_numpy(np.asarray(smp.logprobs, dtype=np.float32).copy()),
            "finish_reason": str(smp.finish_reason), "response_text": smp.response_text,
            "token_versions": None if smp.token_versions is None else torch.from_numpy(
                np.asarray(smp.token_versions, dtype=np.int64).copy()),
            "routed_experts": None if smp.routed_experts is None else torch.from_numpy(np.ascontiguousarray(
                smp.routed_experts))}


def _sample(d: dict):
    from megatron_s3ac.rollout.base import Sample

    return Sample(prompt_ids=list(d["prompt_ids"]), response_ids=list(d["response_ids"]),
                  logprobs=d["logprobs"].numpy(), finish_reason=d["finish_reason"],
                  routed_experts=None if d["routed_experts"] is None else d["routed_experts"].numpy(),
                  response_text=d["response_text"],
                  token_versions=None if d.get("token_versions") is None else d["token_versions"].numpy())


def _plain_stats(stats: dict) -> dict:
    # type(), not isinstance: numpy's float64 is a float subclass, and would pickle as a numpy scalar
    return {str(k): (v if type(v) in (bool, int, float, str) or v is None else float(v)) for k, v in stats.items()}


def state_dict(ar: "AsyncSource") -> dict:
    """The queue (rank 0: with every batch's samples; checkpoints are saved after a step, when rank 0 has waited
    for every submitted batch), so a resumed run trains exactly what the uninterrupted one would."""
    out = []
    for e in ar.queue:
        groups = None if e.pending is None else [[_plain_sample(x) for x in g] for g in ar._result(e)]
        er = e.eager  # algo.refill_eager (rank 0): the replacements already generated, with their versions
        eager = None if er is None else {
            "slots": [int(sl) for sl in sorted(er.groups)],
            "groups": [[_plain_sample(x) for x in er.groups[sl]] for sl in sorted(er.groups)],
            "rewards": [None if er.rewards[sl] is None else [float(x) for x in er.rewards[sl]]
                        for sl in sorted(er.groups)],
            "versions": [None if er.versions[sl] is None else int(er.versions[sl]) for sl in sorted(er.groups)]}
        out.append({"step": e.step, "pids": e.pids.clone(), "stats": _plain_stats(e.stats), "version": e.version,
                    "groups": groups, "reserve": None if e.reserve is None else e.reserve.clone(), "eager": eager})
    return {"version": 1, "max_staleness": ar.n, "queue": out, "engine_restarts": ar.restarts}


def load_state_dict(ar: "AsyncSource", state: dict, rank: int) -> None:
    """Restore the queue saved by ``state_dict`` (rank 0 gets the samples back as done generations)."""
    from megatron_s3ac.rollout.base import PendingGeneration

    if state.get("version") != 1:
        raise ValueError(f"unsupported asynchronous-rollout state version {state.get('version')}")
    ar.queue.clear()
    ar.restarts = int(state.get("engine_restarts", 0))
    for q in state["queue"]:
        e = Submitted(int(q["step"]), q["pids"].clone(), dict(q["stats"]), int(q["version"]))
        if q.get("reserve") is not None:  # algo.refill_eager: the candidates and (rank 0) the replacements made
            e.reserve = q["reserve"].clone()
        if rank == 0 and q.get("eager") is not None:
            from megatron_s3ac.trainer.step.rollout_phases import EagerRefill

            d = q["eager"]
            e.eager = EagerRefill({sl: [_sample(x) for x in g] for sl, g in zip(d["slots"], d["groups"])},
                                  dict(zip(d["slots"], d["rewards"])), dict(zip(d["slots"], d["versions"])), [])
        if rank == 0:
            if q["groups"] is None:
                raise ValueError("the checkpoint's asynchronous-rollout queue has no samples (saved by a rank other "
                                 "than 0?)")
            groups = [[_sample(x) for x in g] for g in q["groups"]]
            e.pending = PendingGeneration(lambda g=groups: g)
            e.collected = True  # generated before the checkpoint: not this run's engine time
        ar.queue.append(e)


__all__ = ["AsyncSource", "Submitted", "busy_seconds", "engine_death_types", "load_state_dict", "reward_overlap",
           "staleness_metrics", "state_dict"]

"""The rollout phases of one step: prompt selection (DAPS or the seeded stream), generation and scoring
on rank 0, the DAPO group filter, DAPO refill rounds, and the sharded hand-out of the kept rows.
A mixin of ``trainer.step.trainer.Trainer``: it uses the Trainer's engine, prompts, DAPS sampler and critic, and its
rollout source (``Trainer.source``, trainer.step.source) around every generation: the asynchronous source restarts an
engine that died in it.

Data flow: rank 0 keeps the samples (token ids, log-probs, R3 routes); every rank receives only their
metadata (prompt id, reward, lengths, finish reason: a few numbers per sample, what the filter, DAPS
and the rollout metrics need). After the filter, ``distribute`` sends each rank its own rows
(trainer.step.sharding, trainer.step.scatter) and the step runs on that shard.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from megatron_s3ac import algorithms as A
from megatron_s3ac.algorithms.registry import clamp_values
from megatron_s3ac.trainer.step.batch import RolloutBatch, RolloutMeta, collate


def sampling_params(cfg, step: int, round_idx: int = 0):
    """The engine's sampling parameters for trainer step ``step``'s ``round_idx``-th rollout round (0: the step's
    first; DAPO refills count up). The one seed rule: a batch the asynchronous source prefetches draws as the
    synchronous loop would at the step it trains at."""
    from megatron_s3ac.rollout.base import SamplingParams

    r = cfg.rollout
    lt = r.length_tail
    # rollout.length_tail (rollout/lengths.py): designed per-response budgets, each decoded to its end (ignore_eos)
    tail = (lt.long_frac, lt.short_min, lt.short_max, lt.salt) if lt.long_frac > 0 else ()
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                          seed=cfg.train.seed * 1_000_003 + step + 7919 * round_idx, length_tail=tail,
                          ignore_eos=bool(tail))


@dataclasses.dataclass
class Round:
    """One generation round (``RolloutPhases.rollout``): the samples of its groups without an aborted sample
    (metadata on ranks other than 0) and (aborted samples, aborted groups)."""
    samples: list
    aborted: tuple = (0, 0)


@dataclasses.dataclass
class FirstRound:
    """A step's first round chosen and generated ahead (the asynchronous source's prefetched batch): its prompt
    indices [n], selection statistics, rank 0's groups (None elsewhere), each group's rewards where they were scored
    as they streamed back (None: score at collection), and ``tag(samples, round_idx)``, which the source uses to mark
    every round's samples (weights versions) before the filter sees them."""
    pids: torch.Tensor
    stats: dict
    groups: Optional[list] = None
    rewards: Optional[list] = None
    tag: Optional[Callable[[list, int], None]] = None
    # eager refill (algo.refill_eager): the replacement candidates [budget] chosen with the round, and (rank 0) the
    # replacements the source already generated while the round streamed back (EagerRefill), None: generate here
    reserve: Optional[torch.Tensor] = None
    eager: Optional["EagerRefill"] = None


def informative(rewards) -> bool:
    """The DAPO filter's rule on one group's K rewards (algorithms.filters.dynamic_sampling_filter, atol 0): not
    all equal. None (a group with an aborted sample, which the rollout drops) is not informative."""
    if rewards is None:
        return False
    r = torch.as_tensor([float(x) for x in rewards], dtype=torch.float64)
    keep, _ = A.dynamic_sampling_filter(r, group_size=max(1, len(r)))
    return bool(keep.all()) if len(r) else False


@dataclasses.dataclass
class EagerRefill:
    """Rank 0: one eager-refill round (``eager_refill_stream``): per slot (0..n-1: the round's prompts, n + j: the
    j-th replacement, whose prompt is reserve[j]) its group, its K rewards (None: aborted) and the weights version
    that generated it (None: the source's current one); ``events``: ("arrived" | "scored" | "submitted", slot,
    time.time())
    in the order they happened (tests, timing)."""
    groups: dict
    rewards: dict
    versions: dict
    events: list
    timings: list = dataclasses.field(default_factory=list)  # each stream's engine (start, end), where known


def eager_refill_stream(first, n_first: int, budget: int, submit, score, version=None) -> EagerRefill:
    """Rank 0, DAPO refill as groups stream back (``algo.refill_eager``). ``first``: the round's
    ``StreamingGeneration`` (slots 0..n_first-1, anything with ``groups()`` yielding (index, group) as each finishes);
    ``submit(j)``: hand the engine replacement j's prompt group (reserve[j], its own seed) and return its stream;
    ``score(slot, group)``: its K rewards, or None for a group with an aborted sample; ``version()``: the engine's
    weights version at a submission (None: untracked). Every group scored uninformative (the filter's rule) has a
    replacement submitted at once, while the engine still generates the rest, at most ``budget`` in all.

    Deterministic whatever the arrival order: replacement j always gets reserve[j] and slot n_first + j's seed,
    whichever group's verdict triggered it, and the number submitted is fixed by the groups' outcomes (each
    uninformative group adds one until the budget is spent), so the generated slots and their samples are the same.
    The streams are read in submission order (a serial engine finishes them in that order)."""
    import collections
    import time

    out = EagerRefill({}, {}, {}, [])
    streams = collections.deque([(first, 0, None)])
    sent = 0
    while streams:
        stream, base, ver = streams.popleft()
        for i, group in stream.groups():
            slot = base + int(i)
            out.events.append(("arrived", slot, time.time()))
            out.groups[slot], out.versions[slot] = group, ver
            rew = None if any(smp.finish_reason == "abort" for smp in group) else score(slot, group)
            out.rewards[slot] = rew
            out.events.append(("scored", slot, time.time()))
            if not informative(rew) and sent < budget:
                v = version() if version is not None else None
                streams.append((submit(sent), n_first + sent, v))
                out.events.append(("submitted", n_first + sent, time.time()))
                sent += 1
        stream.result()  # the whole stream is in (its timing; an engine error is raised here at the latest)
        if getattr(stream, "timing", None) is not None:
            out.timings.append(stream.timing)
    return out


@dataclasses.dataclass
class RolloutResult:
    """What a step's rollout hands the training phases: every drawn sample (dicts; metadata off rank 0), their
    metadata (None: every group aborted), this rank's shard of the kept batch (None: nothing to train), the phase's
    metrics, the kept (trained) samples and the aborted counts (samples, groups) over every round."""
    samples: list
    drawn: Optional[RolloutMeta]
    batch: Optional[RolloutBatch]
    metrics: dict
    kept: list = dataclasses.field(default_factory=list)
    aborted: tuple = (0, 0)


class RolloutPhases:
    @property
    def device(self) -> torch.device:
        """Where this rank's models and the step's tensors live (trainer.step.device.trainer_device)."""
        from megatron_s3ac.trainer.step.device import trainer_device

        return trainer_device()

    def select_prompts(self, n: int | None = None) -> tuple[torch.Tensor, dict]:
        """Prompt indices [n] (default prompts_per_step) and DAPS statistics."""
        n = n or self.cfg.rollout.prompts_per_step
        if self.daps is None:
            return self.stream.take(n), {}
        v0s = []

        def score(pids: torch.Tensor) -> torch.Tensor:
            v0 = clamp_values(self.critic_v0(pids), self.cfg.algo).cpu()  # the DAPS sampler's state lives on the host
            v0s[:] = [v0]
            return v0

        # small chunks: daps/acceptance_rate = accepted / drawn counts the whole last chunk as considered,
        # so with fill's default chunk (2x batch) it read 0.5 at every step, even when all were accepted
        sel = self.daps.fill(draw=self.stream.take, score=score, batch_size=n, step=self.step_idx,
                             chunk_size=max(1, n // 4))
        stats = dict(sel.stats)
        if v0s:  # the last chunk scored
            stats["daps/v0_mean"] = float(v0s[0].mean())
        return sel.ids, stats

    def image_kwargs(self, pids) -> dict:
        """{"images": [ImageInputs | None per prompt]} for the engine's generate / generate_async when any of
        ``pids`` is an image prompt, else {} (text prompts: the call as before)."""
        images = [getattr(self.prompts[int(i)], "images", None) for i in pids]
        return {"images": images} if any(im is not None for im in images) else {}

    def rollout(self, pids: torch.Tensor, round_idx: int = 0, ready: FirstRound | None = None) -> Round:
        """Rank 0 generates and scores. Returns the round: one dict per kept sample on every rank, its metadata
        ("pid", "reward", "finish", "plen", "rlen"); on rank 0 also the sample itself ("prompt_ids",
        "response_ids", "logprobs", "routes", "images"), which only ``distribute`` sends on.
        round_idx: the refill round within the step (0 = the step's first rollout), for its own seed.
        ready: the round generated ahead (a prefetched batch: rank 0's groups, and each group's rewards where they
        were scored as they streamed back), else None: generate now, through the rollout source (``source.generate``:
        the asynchronous one restarts a dead engine and generates again)."""
        if ready is None:
            params = sampling_params(self.cfg, self.step_idx, round_idx)
            groups, rewards = self.source.generate(lambda: self.engine.generate(
                [self.prompts[int(i)].ids for i in pids], params, n_samples=self.cfg.rollout.k,
                return_routed_experts=self.r3_on, **self.image_kwargs(pids))), None
        else:
            groups, rewards = ready.groups, ready.rewards
        payload, full = None, None
        if self.rank == 0:
            full, meta, aborted = self._round_samples(pids.tolist(), groups, rewards)
            payload = (meta, aborted)
        # metadata only: a few numbers per sample; waited for on the gloo group with the run's deadline
        meta, aborted = self.rank0.share("rollout generation", payload)
        light = [dict(zip(meta, vals)) for vals in zip(*meta.values())]
        samples = light if full is None else [dict(f, plen=m["plen"], rlen=m["rlen"]) for f, m in zip(full, light)]
        return Round(samples, tuple(aborted))

    def _round_samples(self, pids: list, groups: list, rewards: list | None, versions: list | None = None):
        """Rank 0: one round's groups (one per prompt id in ``pids``) -> (sample dicts, their metadata, (aborted
        samples, aborted groups)). ``rewards``: each group's K rewards where already scored (None: score here; an
        entry None: an aborted group). ``versions``: each group's weights version, carried in the metadata (eager
        refill in the asynchronous loop), or None."""
        # an aborted sample (sglang: no routes, partial tokens) drops its whole group: the group baselines
        # need all K samples; counted in rollout/aborted*
        n_aborted = sum(s.finish_reason == "abort" for g in groups for s in g)
        kept = [(gi, pid, g) for gi, (pid, g) in enumerate(zip(pids, groups))
                if all(s.finish_reason != "abort" for s in g)]
        aborted = (n_aborted, len(groups) - len(kept))
        flat = [(pid, s) for _, pid, group in kept for s in group]
        if rewards is not None:  # scored group by group as they came back (trainer.step.async_loop)
            rewards = [float(x) for gi, _, _ in kept for x in rewards[gi]]
        else:
            rewards = self.score([self.decode(s.response_ids) for _, s in flat],
                                 [self.prompts[pid].reference for pid, _ in flat]) if flat else []
        full = [{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids or [0],
                 "logprobs": (s.logprobs.tolist() or [0.0]), "reward": float(rew), "pid": pid,
                 "finish": s.finish_reason, "routes": s.routed_experts,
                 # the prompt's ImageInputs (image prompts): what the trainer recomputes the engine's inputs from
                 "images": (getattr(s, "images", None) if getattr(s, "images", None) is not None
                            else getattr(self.prompts[pid], "images", None))}
                for (pid, s), rew in zip(flat, rewards)]
        meta = {"pid": [d["pid"] for d in full], "reward": [d["reward"] for d in full],
                "finish": [d["finish"] for d in full], "plen": [len(d["prompt_ids"]) for d in full],
                "rlen": [len(d["response_ids"]) for d in full]}
        if versions is not None:
            meta["version"] = [int(versions[gi]) for gi, _, group in kept for _ in group]
        return full, meta, aborted

    def distribute(self, samples: list[dict]) -> RolloutBatch:
        """The kept samples (rank 0: whole; elsewhere metadata) -> this rank's shard of the step's
        batch, on the model's device: the rows its actor and critic own (whole groups when the
        algorithm needs them) and R3 routes of its actor rows cut to its pipeline stage's MoE layers
        (collective; trainer.step.sharding / trainer.step.scatter)."""
        from megatron_s3ac.trainer.step.scatter import distribute
        from megatron_s3ac.trainer.step.sharding import RowShard

        group = self.cfg.rollout.k if self.spec.needs_groups else 1
        local, shares = distribute(samples, group, self.rank_roles(), routes=self.r3_on)
        meta = RolloutMeta.of(samples)
        batch = collate(local, self.pad_to, width=int(meta.resp_len.max()))
        batch.shard = RowShard.of(len(samples), shares, self.rank, meta)
        batch.route_layers = shares[self.rank].layers if self.r3_on else None
        return batch.to(self.device)

    def rank_roles(self) -> list:
        """Every rank's DP place in the actor's and the critic's layout and its MoE layers (gathered once)."""
        if getattr(self, "_roles", None) is None:
            from megatron.core import parallel_state as ps

            from megatron_s3ac.trainer.step.scatter import gather_roles
            from megatron_s3ac.trainer.step.sharding import RankRole

            with self.model_scope("actor"):
                a = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
            c = a
            if self.uses_critic:
                with self.model_scope("critic"):
                    c = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
            self._roles = gather_roles(RankRole(*a, *c, tuple(self._moe_layers) if self.r3_on else ()))
        return self._roles

    def rollout_metrics(self, r: RolloutResult) -> dict:
        """rollout/* over every drawn trajectory of the step (only the aborted counts when every group aborted)."""
        m = {"rollout/aborted": r.aborted[0], "rollout/aborted_groups": r.aborted[1]}
        if r.drawn is None:
            return m
        m.update({"rollout/reward_mean": float(r.drawn.scores.mean()),
                  "rollout/pass_rate": float((r.drawn.scores > 0).float().mean()),
                  "rollout/response_len": float(r.drawn.resp_len.float().mean()),
                  "rollout/truncated_frac": sum(s["finish"] == "length" for s in r.samples) / len(r.samples),
                  # at the cap (rollout.max_new_tokens), not only at a response's own budget (rollout.length_tail)
                  "rollout/capped_frac": float((r.drawn.resp_len >= self.cfg.rollout.max_new_tokens).float().mean()),
                  "rollout/response_len_max": float(r.drawn.resp_len.max())})
        if self.reward_pool is not None:  # verifier health (rank 0 only; cumulative counts)
            st = self.reward_pool.stats
            m.update({"reward/timeouts": st.timeouts, "reward/crashes": st.crashes, "reward/errors": st.errors})
        return m

    def filter_groups(self, meta: RolloutMeta) -> tuple[torch.Tensor | None, dict]:
        """DAPO dynamic sampling: the rows [n] of groups whose K rewards are not all equal (all rows when
        the filter is off); None if nothing is left."""
        if not (self.cfg.rollout.k > 1 and self.cfg.algo.dynamic_sampling):
            return torch.arange(len(meta.scores)), {}
        keep, fstats = A.dynamic_sampling_filter(meta.scores, group_size=self.cfg.rollout.k)
        m = {f"filter/{k}": v for k, v in fstats.items()}
        if int(keep.sum()) == 0:
            return None, {**m, "filter/empty_batch": 1}
        return keep.nonzero()[:, 0], m

    def rollout_once(self, m: dict, first: FirstRound | None = None) -> RolloutResult:
        """Select, roll out and filter once (no refill); ``first``: that round already selected and generated (the
        asynchronous source), else None. The result's metadata is None when every group aborted, its batch when the
        filter left nothing."""
        if first is None:
            pids, stats = self.select_prompts()
            self.placement.place(m, off=["actor", "critic"])  # the engine generates
            rnd = self.rollout(pids)
        else:
            stats, rnd = first.stats, self.rollout(first.pids, ready=first)
            if first.tag is not None:
                first.tag(rnd.samples, 0)
        samples = rnd.samples
        if not samples:
            return RolloutResult(samples, None, None, stats, aborted=rnd.aborted)
        drawn = RolloutMeta.of(samples)
        if self.daps is not None:
            self.daps.update(drawn.pid, drawn.scores, step=self.step_idx)
        keep, fm = self.filter_groups(drawn)
        kept = [] if keep is None else [samples[i] for i in keep.tolist()]
        batch = None if keep is None else self.distribute(kept)
        return RolloutResult(samples, drawn, batch, {**stats, **fm}, kept, rnd.aborted)

    def rollout_refilled(self, m: dict, first: FirstRound | None = None) -> RolloutResult:
        """DAPO dynamic sampling with refill (``algo.dynamic_sampling_refill``): select and roll out
        prompt groups until ``prompts_per_step`` informative ones are kept, drawing at most
        ``refill_max_factor`` x prompts_per_step groups (algorithms.filters.dynamic_sampling_refill);
        DAPS sees every drawn group's outcomes. ``first``: the first round already selected and generated (the
        asynchronous source, which tags every round's samples), else None."""
        import math

        self.placement.place(m, off=["actor"])  # the engine generates; the critic scores every refill round (DAPS)
        k, target = self.cfg.rollout.k, self.cfg.rollout.prompts_per_step
        drawn, stats, rounds, aborted = [], {}, [0], [0, 0]

        def draw(n):
            ready = first if rounds[0] == 0 else None
            pids, st = (first.pids, first.stats) if ready is not None else self.select_prompts(n)
            for key, v in st.items():
                stats.setdefault(key, v)  # the first round's selection statistics
            rnd = self.rollout(pids, round_idx=rounds[0], ready=ready)
            samples = rnd.samples
            if first is not None and first.tag is not None:
                first.tag(samples, rounds[0])
            rounds[0] += 1
            aborted[0] += rnd.aborted[0]
            aborted[1] += rnd.aborted[1]
            # rollout drops a group with an aborted sample: it counts as drawn and uninformative
            got = len(samples) // k
            scores = torch.zeros(n, k)
            if samples:
                b = RolloutMeta.of(samples)
                if self.daps is not None:
                    self.daps.update(b.pid, b.scores, step=self.step_idx)
                scores[:got] = b.scores.reshape(got, k)
                drawn.extend(samples)
            return [samples[i * k:(i + 1) * k] for i in range(got)] + [None] * (n - got), scores

        kept, st = A.dynamic_sampling_refill(draw, target, max_groups=max(target, math.floor(
            self.cfg.algo.refill_max_factor * target)))
        fm = {**stats, "filter/kept_groups": st["kept_groups"], "filter/discarded_groups": st["discarded_groups"],
              "filter/kept_trajectories": st["kept_groups"] * k,
              "filter/discarded_trajectories": st["discarded_groups"] * k,
              "refill/rounds": st["rounds"], "refill/drawn_groups": st["drawn_groups"],
              "refill/surplus_groups": st["surplus_groups"], "refill/reached_target": float(st["reached_target"])}
        kept = [s for g in kept for s in g]
        if not drawn:
            return RolloutResult(drawn, None, None, fm, aborted=tuple(aborted))
        all_meta = RolloutMeta.of(drawn)
        if not kept:
            return RolloutResult(drawn, all_meta, None, {**fm, "filter/empty_batch": 1}, aborted=tuple(aborted))
        return RolloutResult(drawn, all_meta, self.distribute(kept), fm, kept, tuple(aborted))

    # ---- eager refill (algo.refill_eager) -------------------------------------------------------------------
    def refill_budget(self) -> int:
        """Replacement groups a step may draw beyond its prompts_per_step: ``refill_max_factor`` x prompts_per_step
        groups in all (the bound of ``rollout_refilled``)."""
        import math

        target = self.cfg.rollout.prompts_per_step
        return max(target, math.floor(self.cfg.algo.refill_max_factor * target)) - target

    def select_reserve(self) -> torch.Tensor:
        """Every rank (collective: DAPS scores the candidates with the critic's V(s0)): the replacement candidates
        [refill_budget] of a round, chosen with it before it generates, so rank 0 can hand them to the engine
        mid-round without a collective. Their selection statistics are not logged (the round's are)."""
        b = self.refill_budget()
        return self.select_prompts(b)[0] if b > 0 else torch.zeros(0, dtype=torch.long)

    def eager_generate(self, pids: torch.Tensor, reserve: torch.Tensor, first=None, version=None,
                       step: int | None = None) -> EagerRefill:
        """Rank 0: stream the round of ``pids`` (``first``: its stream already submitted, else submitted here) and
        submit replacement j (prompt reserve[j], seed ``sampling_params(cfg, step, 1 + j)``) as soon as a group is
        scored uninformative (``eager_refill_stream``). ``version()``: the engine's version at each submission;
        ``step``: the trainer step the round trains at (its seeds; default the current one)."""
        k, step = self.cfg.rollout.k, (self.step_idx if step is None else step)

        def send(ids: torch.Tensor, round_idx: int):
            return self.engine.generate_stream_async([self.prompts[int(i)].ids for i in ids],
                                                     sampling_params(self.cfg, step, round_idx), n_samples=k,
                                                     return_routed_experts=self.r3_on, **self.image_kwargs(ids))

        def score(slot: int, group: list) -> list:
            pid = int(pids[slot]) if slot < len(pids) else int(reserve[slot - len(pids)])
            texts = [self.decode(smp.response_ids) for smp in group]
            return [float(x) for x in self.score(texts, [self.prompts[pid].reference] * len(texts))]

        stream = first if first is not None else send(pids, 0)
        return eager_refill_stream(stream, len(pids), len(reserve), lambda j: send(reserve[j:j + 1], 1 + j), score,
                                   version)

    def rollout_eager(self, m: dict, first: FirstRound | None = None) -> RolloutResult:
        """DAPO refill with replacements submitted as groups are filtered out (``algo.refill_eager``; needs a
        streaming engine): the round's prompts and its reserve of replacement candidates are chosen first (every
        rank), rank 0 streams the round and hands the engine reserve[j] the moment the j-th uninformative group is
        scored (``eager_generate``), and the step keeps the first ``prompts_per_step`` informative groups in slot
        order. The result is ``rollout_refilled``'s (same metrics, same bound ``refill_max_factor``), its groups
        independent of the engine's timing. ``first``: the round selected (with its reserve) and generated ahead by
        the asynchronous source, its replacements possibly generated too (``first.eager``, rank 0)."""
        self.placement.place(m, off=["actor"])  # the engine generates; the critic scores the prompts (DAPS)
        k, target = self.cfg.rollout.k, self.cfg.rollout.prompts_per_step
        if first is None:
            pids, stats = self.select_prompts()
            reserve = self.select_reserve()
        else:
            pids, stats = first.pids, first.stats
            reserve = first.reserve if first.reserve is not None else torch.zeros(0, dtype=torch.long)

        def gen() -> EagerRefill:
            if first is not None and first.eager is not None:
                return first.eager  # streamed and refilled by the source while the round generated
            if first is not None:  # generated ahead, not refilled (a resumed queue): the replacements now
                done = _DoneStream(first.groups)
                return self.eager_generate(pids, reserve, first=done)
            return self.eager_generate(pids, reserve)

        er = self.source.generate(gen)  # rank 0's (the asynchronous source restarts a dead engine and reruns it)
        payload, full = None, None
        if self.rank == 0:
            slots = sorted(er.groups)
            slot_pids = [int(pids[s]) if s < len(pids) else int(reserve[s - len(pids)]) for s in slots]
            versions = [er.versions[s] for s in slots]
            tracked = any(v is not None for v in versions)
            full, meta, aborted = self._round_samples(
                slot_pids, [er.groups[s] for s in slots], [er.rewards[s] for s in slots],
                [(-1 if v is None else v) for v in versions] if tracked else None)
            kept_slots = [s for s in slots if all(x.finish_reason != "abort" for x in er.groups[s])]
            meta["slot"] = [s for s in kept_slots for _ in range(k)]
            payload = (meta, aborted, len(slots))
        meta, aborted, n_drawn = self.rank0.share("rollout generation", payload)
        light = [dict(zip(meta, vals)) for vals in zip(*meta.values())]
        samples = light if full is None else [dict(f, plen=x["plen"], rlen=x["rlen"], slot=x["slot"])
                                              for f, x in zip(full, light)]
        if first is not None and first.tag is not None:  # weights versions: the round's, then the replacements'
            first.tag([d for d in samples if d["slot"] < len(pids)], 0)
            first.tag([d for d in samples if d["slot"] >= len(pids)], 1)
            if "version" in meta:  # replacements the source submitted mid-round: the version at submission
                for d, v in zip(samples, meta["version"]):
                    if d["slot"] >= len(pids) and v >= 0:
                        d["version"] = int(v)
        for d in samples:
            del d["slot"]
        # the filter's verdict per slot, in slot order (aborted groups: drawn, uninformative)
        groups = [samples[i * k:(i + 1) * k] for i in range(len(samples) // k)]
        good = [g for g in groups if informative([d["reward"] for d in g])]
        kept = [d for g in good[:target] for d in g]
        n_good = len(good)
        fm = {**stats, "filter/kept_groups": min(n_good, target), "filter/discarded_groups": n_drawn - n_good,
              "filter/kept_trajectories": min(n_good, target) * k,
              "filter/discarded_trajectories": (n_drawn - n_good) * k,
              "refill/rounds": 1 + max(0, n_drawn - len(pids)), "refill/drawn_groups": n_drawn,
              "refill/surplus_groups": max(0, n_good - target), "refill/reached_target": float(n_good >= target)}
        if not samples:
            return RolloutResult(samples, None, None, fm, aborted=tuple(aborted))
        drawn = RolloutMeta.of(samples)
        if self.daps is not None:  # every generated group's outcomes, once, in slot order (collective state)
            self.daps.update(drawn.pid, drawn.scores, step=self.step_idx)
        if not kept:
            return RolloutResult(samples, drawn, None, {**fm, "filter/empty_batch": 1}, aborted=tuple(aborted))
        return RolloutResult(samples, drawn, self.distribute(kept), fm, kept, tuple(aborted))


class _DoneStream:
    """A round already generated, as a stream: its groups in prompt order (``eager_refill_stream``'s ``first``)."""

    def __init__(self, groups: list):
        self._groups = groups

    def groups(self):
        yield from enumerate(self._groups)

    def result(self) -> list:
        return self._groups

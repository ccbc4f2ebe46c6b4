"""The rollout phases of one step: prompt selection (DAPS or the seeded stream), generation and scoring
on rank 0, the DAPO group filter, DAPO refill rounds, and the sharded hand-out of the kept rows.
A mixin of ``trainer.loop.Trainer``: it uses the Trainer's engine, prompts, DAPS sampler and critic.

Data flow: rank 0 keeps the samples (token ids, log-probs, R3 routes); every rank receives only their
metadata (prompt id, reward, lengths, finish reason: a few numbers per sample, what the filter, DAPS
and the rollout metrics need). After the filter, ``distribute`` sends each rank its own rows
(trainer.sharding, trainer.scatter) and the step runs on that shard.
"""
from __future__ import annotations

import torch

from megatron_s3ac import algorithms as A
from megatron_s3ac.algorithms.registry import clamp_values
from megatron_s3ac.trainer.batch import RolloutBatch, RolloutMeta, collate


_ENGINE_DIED = "engine died"  # rank 0's hand-over when the engine died in a round (the asynchronous loop)


class RolloutPhases:
    @property
    def device(self) -> torch.device:
        """Where this rank's models and the step's tensors live (trainer.device.trainer_device)."""
        from megatron_s3ac.trainer.device import trainer_device

        return trainer_device()

    def select_prompts(self, n: int | None = None) -> tuple[torch.Tensor, dict]:
        """Prompt indices [n] (default prompts_per_step) and DAPS statistics."""
        n = n or self.cfg.rollout.prompts_per_step
        self._last_v0 = None
        if self.daps is None:
            return self.stream.take(n), {}
        # small chunks: daps/acceptance_rate = accepted / drawn counts the whole last chunk as considered,
        # so with fill's default chunk (2x batch) it read 0.5 at every step, even when all were accepted
        sel = self.daps.fill(draw=self.stream.take, score=self._v0_for_daps, batch_size=n, step=self.step_idx,
                             chunk_size=max(1, n // 4))
        stats = dict(sel.stats)
        if self._last_v0 is not None:
            stats["daps/v0_mean"] = float(self._last_v0.mean())
        return sel.ids, stats

    def _v0_for_daps(self, pids: torch.Tensor) -> torch.Tensor:
        v0 = clamp_values(self.critic_v0(pids), self.cfg.algo).cpu()  # the DAPS sampler's state lives on the host
        self._last_v0 = v0
        return v0

    def image_kwargs(self, pids) -> dict:
        """{"images": [ImageInputs | None per prompt]} for the engine's generate / generate_async when any of
        ``pids`` is an image prompt, else {} (text prompts: the call as before)."""
        images = [getattr(self.prompts[int(i)], "images", None) for i in pids]
        return {"images": images} if any(im is not None for im in images) else {}

    def rollout(self, pids: torch.Tensor, round_idx: int = 0, groups=None, rewards=None) -> list[dict]:
        """Rank 0 generates and scores. Returns one dict per kept sample on every rank: its metadata
        ("pid", "reward", "finish", "plen", "rlen"); on rank 0 also the sample itself ("prompt_ids",
        "response_ids", "logprobs", "routes", "images"), which only ``distribute`` sends on.
        round_idx: the refill round within the step (0 = the step's first rollout), for its own seed.
        groups: rank 0's samples already generated for ``pids`` (the asynchronous loop's prefetched batch), else
        None: generate now. rewards: with groups, each group's rewards already scored as it came back (streaming
        rewards; None for a group with an aborted sample), else None: score here."""
        from megatron_s3ac.rollout.base import SamplingParams

        r = self.cfg.rollout
        payload = [None]
        full = None
        recovery = getattr(self, "async_rollout", None)  # the asynchronous loop restarts a dead engine
        if self.rank == 0:
            params = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                    seed=self.cfg.train.seed * 1_000_003 + self.step_idx + 7919 * round_idx)
            if groups is None:
                try:
                    groups = self.engine.generate([self.prompts[int(i)].ids for i in pids], params, n_samples=r.k,
                                                  return_routed_experts=self.r3_on, **self.image_kwargs(pids))
                except Exception as err:
                    if recovery is None or not recovery.is_engine_death(err):
                        raise
                    payload = [(_ENGINE_DIED, f"{type(err).__name__} during a rollout round: {err}",
                                recovery.lost_steps())]
        if recovery is not None:  # the asynchronous loop: every rank learns whether rank 0's engine died here
            died = self.rank0.share("rollout generation", payload[0])
            if died is not None:  # all restart and re-sync it; the round is generated again with its own seed
                recovery.recover(died[1], died[2])
                return self.rollout(pids, round_idx, None, None)
        if self.rank == 0:
            # an aborted sample (sglang: no routes, partial tokens) drops its whole group: the group baselines
            # need all K samples; counted in rollout/aborted*
            aborted = sum(s.finish_reason == "abort" for g in groups for s in g)
            kept = [(gi, pid, g) for gi, (pid, g) in enumerate(zip(pids.tolist(), groups))
                    if all(s.finish_reason != "abort" for s in g)]
            self._aborted = (aborted, len(groups) - len(kept))
            flat = [(pid, s) for _, pid, group in kept for s in group]
            if rewards is not None:  # scored group by group as they came back (trainer.async_loop)
                rewards = [float(x) for gi, _, _ in kept for x in rewards[gi]]
            else:
                rewards = self._score([self.decode(s.response_ids) for _, s in flat],
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
            payload = [(meta, self._aborted)]
        # metadata only: a few numbers per sample; waited for on the gloo group with the run's deadline
        meta, self._aborted = self.rank0.share("rollout generation", payload[0])
        light = [dict(zip(meta, vals)) for vals in zip(*meta.values())]
        return light if full is None else [dict(f, plen=m["plen"], rlen=m["rlen"]) for f, m in zip(full, light)]

    def distribute(self, samples: list[dict]) -> RolloutBatch:
        """The kept samples (rank 0: whole; elsewhere metadata) -> this rank's shard of the step's
        batch, on the model's device: the rows its actor and critic own (whole groups when the
        algorithm needs them) and R3 routes of its actor rows cut to its pipeline stage's MoE layers
        (collective; trainer.sharding / trainer.scatter)."""
        from megatron_s3ac.trainer.scatter import distribute
        from megatron_s3ac.trainer.sharding import RowShard

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

            from megatron_s3ac.trainer.scatter import gather_roles
            from megatron_s3ac.trainer.sharding import RankRole

            with self.model_scope("actor"):
                a = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
            c = a
            if self.uses_critic:
                with self.model_scope("critic"):
                    c = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
            self._roles = gather_roles(RankRole(*a, *c, tuple(self._moe_layers) if self.r3_on else ()))
        return self._roles

    def rollout_metrics(self, samples: list[dict], batch: RolloutMeta) -> dict:
        aborted = getattr(self, "_aborted", (0, 0))
        m = {"rollout/aborted": aborted[0], "rollout/aborted_groups": aborted[1],
             "rollout/reward_mean": float(batch.scores.mean()),
             "rollout/pass_rate": float((batch.scores > 0).float().mean()),
             "rollout/response_len": float(batch.resp_len.float().mean()),
             "rollout/truncated_frac": sum(s["finish"] == "length" for s in samples) / len(samples)}
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

    def rollout_once(self, m: dict) -> tuple[list[dict], RolloutMeta | None, RolloutBatch | None, dict]:
        """Select, roll out and filter once (no refill). Returns (samples, their metadata, this rank's
        shard of the kept batch, metrics); the metadata is None when every group aborted, the batch
        when the filter left nothing."""
        pids, stats = self.select_prompts()
        self._place(m, off=["actor", "critic"])  # the engine generates
        samples = self.rollout(pids)
        if not samples:
            return samples, None, None, stats
        drawn = RolloutMeta.of(samples)
        if self.daps is not None:
            self.daps.update(drawn.pid, drawn.scores, step=self.step_idx)
        keep, fm = self.filter_groups(drawn)
        batch = None if keep is None else self.distribute([samples[i] for i in keep.tolist()])
        return samples, drawn, batch, {**stats, **fm}

    def rollout_refilled(self, first=None) -> tuple[list[dict], RolloutMeta | None, RolloutBatch | None, dict]:
        """DAPO dynamic sampling with refill (``algo.dynamic_sampling_refill``): select and roll out
        prompt groups until ``prompts_per_step`` informative ones are kept, drawing at most
        ``refill_max_factor`` x prompts_per_step groups (algorithms.filters.dynamic_sampling_refill).
        Returns (every drawn sample, their metadata, this rank's shard of the kept batch or None,
        metrics); DAPS sees every drawn group's outcomes. first: the first round already selected and generated
        (pids, selection stats, rank 0's groups or None, their weights version[, rank 0's per-group rewards when
        scored as they streamed back]; the asynchronous loop, which then
        finds each sample's "version": the first round's, or the engine's current one for a refill), else None."""
        import math

        k, target = self.cfg.rollout.k, self.cfg.rollout.prompts_per_step
        drawn, stats, rounds, aborted = [], {}, [0], [0, 0]

        def draw(n):
            if first is not None and rounds[0] == 0:
                pids, st, groups, rw = first[0], first[1], first[2], (first[4] if len(first) > 4 else None)
            else:
                (pids, st), groups, rw = self.select_prompts(n), None, None
            for key, v in st.items():
                stats.setdefault(key, v)  # the first round's selection statistics
            samples = self.rollout(pids, round_idx=rounds[0], groups=groups, rewards=rw)
            if first is not None:  # asynchronous loop: the weights version that generated each sample
                for d in samples:
                    d["version"] = first[3] if rounds[0] == 0 else self.weights_version
            rounds[0] += 1
            aborted[0] += self._aborted[0]
            aborted[1] += self._aborted[1]
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
        m = {**stats, "filter/kept_groups": st["kept_groups"], "filter/discarded_groups": st["discarded_groups"],
             "filter/kept_trajectories": st["kept_groups"] * k, "filter/discarded_trajectories": st["discarded_groups"] * k,
             "refill/rounds": st["rounds"], "refill/drawn_groups": st["drawn_groups"],
             "refill/surplus_groups": st["surplus_groups"], "refill/reached_target": float(st["reached_target"])}
        self._aborted = tuple(aborted)
        self._kept = [s for g in kept for s in g]  # the trained samples (the asynchronous loop's staleness metrics)
        if not drawn:
            return drawn, None, None, m
        all_meta = RolloutMeta.of(drawn)
        if not kept:
            return drawn, all_meta, None, {**m, "filter/empty_batch": 1}
        return drawn, all_meta, self.distribute([s for g in kept for s in g]), m

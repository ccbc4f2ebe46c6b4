"""The S3AC online loop (paper §3.1-3.4) and its critic-free baselines, on megatron-core.

``Trainer.step()`` is the one step frame, for the synchronous and the asynchronous loop alike: its batch comes
from the rollout source (trainer.step.source: ``SyncSource`` rolls out now, trainer.step.async_loop's ``AsyncSource`` keeps
``train.max_staleness`` batches in flight), then the training phases, then the weight sync. Every phase below is
one method with typed inputs and outputs (every rank runs the same code; rank 0 also hosts the engine):

  select_prompts   DAPS with the latest critic's V(s0), or a uniform draw from the seeded stream
  rollout          rank 0 generates K responses per prompt and scores them -> metadata to all ranks
  filter_groups    DAPO group filter (K > 1) on the metadata; then distribute: each rank its own rows
  old_logprobs     actor forward: old log-probs, entropy (routes replayed under R3), R3 metrics
  advantages       the algorithm's registered estimator (critic values for S3AC), IS corrections
  update_actor     the registered policy loss over ``actor_minibatches`` x ``actor_epochs``
  update_critic    clipped value loss, ``critic_epochs`` epochs (S3AC only)
  sync_weights     actor -> engine (the one weight path: the engine kind's registered sync strategy)

The rollout phases (select_prompts .. rollout_refilled) live in trainer.step.rollout_phases, the engine side
(sync_weights, sleep, scoring) in trainer.step.engine_side, both mixins of Trainer; where the models' states live
between phases (train.offload_idle) in ``Trainer.placement`` (trainer.step.placement).
Construction lives in trainer.step.build, the mini-batch runner and forward pass in trainer.step.minibatch,
per-micro-batch losses in trainer.step.losses, R3 in r3.glue, evaluation in eval.periodic. Parallelism:
each rank holds only the rows its models' DP ranks own (trainer.step.sharding) and computes their outputs,
advantages and metric sums (trainer.step.shard_metrics); the critic may use its own layout
(``critic_layout``), installed around every critic operation by ``model_scope("critic")``.
"""
from __future__ import annotations

import contextlib
import os
import time
from functools import partial

import torch
import torch.distributed as dist

from megatron_s3ac import algorithms as A
from megatron_s3ac.algorithms.registry import get_algo
from megatron_s3ac.trainer.step import build as B
from megatron_s3ac.trainer.step.batch import RolloutBatch, collate
from megatron_s3ac.config import Config, model_info_for, validate
from megatron_s3ac.trainer.step.engine_side import EngineSide, sync_strategy_for
from megatron_s3ac.trainer.step.losses import actor_loss, critic_loss, forward_outputs
from megatron_s3ac.trainer.step import shard_metrics as S
from megatron_s3ac.trainer.step.metrics import masked_sums, ratio, token_means, world_mean
from megatron_s3ac.trainer.step.minibatch import MicroBatcher, forward_only, run_minibatches, shuffled_minibatches
from megatron_s3ac.trainer.step.placement import Placement
from megatron_s3ac.trainer.step.privileged import PrivilegedBlocks, critic_view
from megatron_s3ac.trainer.step.rollout_phases import RolloutPhases
from megatron_s3ac.trainer.step.source import SyncSource, make_source


def _r3_setting(cfg: Config, info):
    """(R3Config, on?) from ``train.r3``: auto = on for MoE models; on for a dense model is refused."""
    return B.r3_setting(cfg, info)


class Trainer(EngineSide, RolloutPhases):
    """Actor (+ critic for S3AC), optimizers, rollout engine (rank 0), prompt stream, DAPS, evaluation."""

    def __init__(self, cfg: Config):
        from megatron_s3ac.models.parallel import init_distributed
        from megatron_s3ac.trainer.step.rank0 import Rank0Phases

        torch.set_num_threads(cfg.train.threads)
        init_distributed(timeout_s=cfg.train.dist_timeout_s)
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        validate(cfg, self.world)
        self.rank0 = Rank0Phases(cfg.train.dist_timeout_s)  # the other ranks wait for rank 0's phases here
        self.info = model_info_for(cfg)
        self.spec = get_algo(cfg.algo.name)
        self.policy_loss = cfg.algo.policy_loss or self.spec.policy_loss
        self.uses_critic = self.spec.uses_critic
        par = B.build_parallel(cfg, self.uses_critic)
        self.layout, self.actor_ctx, self.critic_ctx, self.pad_to = par.layout, par.actor_ctx, par.critic_ctx, par.pad_to
        from megatron.core import parallel_state as ps

        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        B.check_packing(cfg, self.info)
        self.micro_batches = MicroBatcher(cfg.algo.micro_batch_size, cfg.algo.max_tokens_per_micro_batch, self.pad_to)
        self._build_models(par)
        self.placement = Placement.of(self)
        self.source = SyncSource(self)  # the asynchronous source replaces it once the engine is synced (below)
        data = B.build_data(cfg, use_daps=cfg.daps.enabled and self.uses_critic)
        self.vocab, self.prompts, self.eval_prompts = data.vocab, data.prompts, data.eval_prompts
        self.data_stats, self.stream, self.daps = data.stats, data.stream, data.daps
        # model.critic_privileged: the critic's block per prompt (None: it sees what the actor sees)
        m = cfg.model
        self.privileged = (PrivilegedBlocks.of(m.critic_privileged, self.vocab, m.critic_privileged_max_tokens)
                           if self.uses_critic else None)
        self._privileged_of_prompts()
        if self.placement.offload_colocated:  # the engine sizes its KV cache beside what its phases keep: nothing
            self.placement.place({}, off=["actor", "critic"])
            dist.barrier()  # every rank's memory is back before rank 0 starts the engines on the node's GPUs
        # image prompts (data rows with an ``images`` column, or image benchmarks among the evaluation sets): the
        # engine loads the VL checkpoint multimodal
        self.multimodal = B.image_prompts(self.prompts) or bool(B.image_eval_sets(cfg))
        self.engine, self._owns_ray = (B.build_engine(cfg, self.info, multimodal=self.multimodal) if self.rank == 0
                                       else (None, False))
        self.sync_strategy = sync_strategy_for(cfg, self.engine)  # every rank: the same path, from the config
        if self.placement.offload_colocated:
            self.engine_sleep()  # the first sync wakes it in the colocated order, beside the actor's params only
        self.reward_pool = None
        self._build_eval()
        self.step_idx, self.skipped_steps = 0, 0
        from megatron_s3ac.algorithms.entropy_control import make_entropy_control

        a = cfg.algo  # None: no hook (the default, "none")
        self.entropy_control = (make_entropy_control(a.entropy_control, **a.entropy_control_params)
                                if a.entropy_control != "none" else None)
        self.rank0.share("engine start")  # not inside the sync's first collective
        self.sync_weights()
        self.source = make_source(self)  # train.max_staleness > 0: generation overlaps training

    # ---- construction ------------------------------------------------------------------------
    def _privileged_of_prompts(self) -> None:
        if self.privileged is not None:
            self._priv_ids, self._priv_missing = self.privileged.of_prompts(self.prompts)

    def use_prompt_subset(self, path: str) -> dict:
        """RL on the prompts of ``data.prompt_subset`` only (before any RL step or resume): the prompt set, its
        stream and DAPS's sampler rebuilt over them. Returns {kept, of}."""
        from megatron_s3ac.data.prompts import PromptStream

        if self.step_idx or not isinstance(self.source, SyncSource):
            raise ValueError("data.prompt_subset is applied before the first RL step, to the synchronous loop only")
        keep = B.read_prompt_subset(path)
        prompts = [p for p in self.prompts if tuple(p.ids) in keep]
        if not prompts:
            raise ValueError(f"data.prompt_subset: {path}: none of its {len(keep)} prompts is in the prompt set "
                             f"({len(self.prompts)} prompts; written for another data section?)")
        out = {"kept": len(prompts), "of": len(self.prompts)}
        self.prompts, self.stream = prompts, PromptStream(len(prompts), self.cfg.data.seed)
        if self.daps is not None:
            self.daps = B.make_daps(self.cfg, len(prompts))
        self._privileged_of_prompts()
        return out

    def _build_models(self, par: "B.ParallelSetup") -> None:
        m = B.build_models(self.cfg, self.info, par, self.uses_critic, scope=self.model_scope,
                           init_critic=self._init_critic_from)
        self.r3, self.r3_on, self._moe_layers = m.r3, m.r3.on, m.r3.moe_layers
        self.actor, self.actor_ddp, self.actor_opt, self.actor_config = m.actor.module, m.actor.ddp, m.actor.opt, m.actor.config
        self.critic = self.critic_ddp = self.critic_opt = None
        if m.critic is not None:
            self.critic, self.critic_ddp, self.critic_opt, self.critic_config = (m.critic.module, m.critic.ddp,
                                                                                 m.critic.opt, m.critic.config)

    def _init_critic_from(self, actor, critic) -> None:
        B.copy_backbone(actor, critic, same_layout=self.critic_ctx is None, scope=self.model_scope,
                        tmp_dir=os.path.join(self.cfg.train.out_dir, ".critic_init_from_actor"))

    def init_critic_from_actor(self) -> None:
        """Critic backbone := actor backbone (e.g. after the demo's warm-up); the value head is kept. With
        ``train.vision.trainable`` the critic's (frozen) vision tower := the actor's too, so the copied backbone
        reads the image features it learned with (a frozen actor tower is the critic's already)."""
        self._init_critic_from(self.actor, self.critic)
        if self.cfg.train.vision.trainable:
            B.copy_tower(self.actor, self.critic)

    def _build_eval(self) -> None:
        """Held-out sets and the periodic evaluator (rank 0; the engine lives there)."""
        from megatron_s3ac.eval.periodic import TrainerEvaluation

        self.evaluation = self.evaluator = None
        self.eval_sets = {}
        if self.rank != 0:
            return
        cfg = self.cfg
        self.evaluation = TrainerEvaluation(
            cfg.eval, default_reward=cfg.rollout.reward, default_max_new_tokens=cfg.rollout.max_new_tokens,
            heldout_rows=[{"prompt": p.text, "answer": p.reference, "prompt_ids": list(p.ids)}
                          for p in self.eval_prompts],
            every_n_steps=cfg.train.eval_every, report_dir=os.path.join(cfg.train.out_dir, "eval"),
            reward_pool=self.verifier_pool, vision=self._eval_vision())
        self.evaluator, self.eval_sets = self.evaluation.evaluator, self.evaluation.sets

    def _eval_vision(self):
        """The VL checkpoint's VisionProcessor when the prompts carry images (image evaluation sets, e.g. the
        multimodal miniature's held-out drawings), else None (text sets: evaluation unchanged)."""
        if not self.multimodal:
            return None
        from megatron_s3ac.data.prompts import VisionProcessor

        return VisionProcessor.from_pretrained(self.cfg.model.engine_hf_dir or self.cfg.model.hf_config)

    def decode(self, ids) -> str:
        return self.vocab.decode(ids) if hasattr(self.vocab, "chars") else self.vocab.decode(ids, skip_special_tokens=True)

    reset_optimizer = staticmethod(B.reset_optimizer)

    def model_scope(self, which: str):
        """Context in which the ``which`` ("actor" | "critic") model's parallel state is installed
        (a no-op when both share one layout). Build, run, save and load a model inside its scope."""
        if self.critic_ctx is None:
            return contextlib.nullcontext()
        return (self.critic_ctx if which == "critic" else self.actor_ctx).active()

    # ---- forward passes ----------------------------------------------------------------------
    def _forward_only(self, which: str, batch: RolloutBatch, what: str) -> dict:
        """Per-response-token outputs [N, T] of every row, on every rank. what: "values" (critic),
        "logp" (log-probs + entropy, routes replayed under R3) or "native_logp" (log-probs with the
        routers' own choice, recorded: also returns r3 agreement counts "agree", "total")."""
        keys = {"values": ["values"], "logp": ["logp", "entropy"], "native_logp": ["logp"]}[what]
        ddp = self.critic_ddp if which == "critic" else self.actor_ddp
        batch = self.critic_input(batch) if which == "critic" else batch
        loss_fn = partial(forward_outputs, what=what, vocab_size=self.info.vocab_size,
                          temperature=self.cfg.rollout.temperature, chunk_tokens=self.cfg.algo.logprob_chunk_tokens or None)
        if what == "native_logp":
            ctx_fn = lambda mbs: self.r3.record_native(ddp)  # noqa: E731
        else:
            ctx_fn = lambda mbs: self._replay(which, mbs)  # noqa: E731
        with self.model_scope(which):
            full, mbs, recorded = forward_only(ddp, batch, keys, loss_fn, self.micro_batches, ctx_fn, model=which)
            res = dict(zip(keys, full))
            if what == "native_logp":
                res["agree"], res["total"] = self.r3.agreement_counts(recorded, mbs)
        return res

    def _replay(self, which: str, mbs: list):
        return self.r3.replay(self.actor_ddp, mbs) if which == "actor" else contextlib.nullcontext()

    def critic_input(self, batch: RolloutBatch) -> RolloutBatch:
        """What the critic reads of ``batch``: the batch itself, or with each row's privileged block between
        prompt and response (``model.critic_privileged``; trainer.step.privileged.critic_view)."""
        if self.privileged is None:
            return batch
        return critic_view(batch, [self._priv_ids[int(i)] for i in batch.pid.tolist()], self.pad_to)

    def privileged_missing(self, batch: RolloutBatch) -> dict:
        """``critic/privileged_missing``: rows of the step's batch whose prompt lacks the field the critic's block
        is built from (they got its empty form)."""
        if self.privileged is None:
            return {}
        miss = self._priv_missing[batch.pid.cpu()].double()
        if batch.shard is not None:  # each row counted by its critic owner
            miss = miss * batch.shard.owned_mask("critic", miss.device).double()
        return {"critic/privileged_missing": S.global_sums(self, "critic", batch, {"n": miss.sum()})["n"]}

    def critic_v0(self, pids: torch.Tensor) -> torch.Tensor:
        """V(s_0) [n] for prompt indices (state = the prompt; output at its last token)."""
        samples = [{"prompt_ids": self.prompts[int(i)].ids, "response_ids": [0], "logprobs": [0.0],
                    "reward": 0.0, "pid": int(i), "images": getattr(self.prompts[int(i)], "images", None)}
                   for i in pids]  # an image prompt's V(s0) sees its image
        return self._forward_only("critic", collate(samples, self.pad_to).to(self.device), "values")["values"][:, 0]

    def _update(self, which: str, batch: RolloutBatch, minibatches: int, epochs: int, loss_fn, seed: int) -> dict:
        """Mini-batch updates of one model (the shared runner); metrics token-weighted over micro-batches
        and ranks. A non-finite loss skips that optimizer step."""
        ddp, opt = (self.critic_ddp, self.critic_opt) if which == "critic" else (self.actor_ddp, self.actor_opt)
        batch = self.critic_input(batch) if which == "critic" else batch
        with self.model_scope(which):
            g = torch.Generator().manual_seed(seed)
            metrics, grad_norms, skipped = [], [], 0
            for r in run_minibatches(ddp, opt, batch, shuffled_minibatches(batch.global_len(), epochs, g, count=minibatches),
                                     loss_fn, self.micro_batches, replay=partial(self._replay, which),
                                     skip_nonfinite=True, model=which):
                if r.grad_norm is None:
                    skipped += 1
                    continue
                grad_norms.append(r.grad_norm)
                metrics += r.outputs
            res = token_means(metrics)
        res["grad_norm"] = sum(grad_norms) / max(1, len(grad_norms))
        res["skipped_minibatches"] = skipped
        res["opt_steps"] = len(grad_norms)
        return res

    # ---- the phases of one step ----------------------------------------------------------------
    def old_logprobs(self, batch: RolloutBatch) -> dict:
        """batch.old_logp := the actor's log-probs before this step's updates (+ entropy, R3 metrics);
        metrics over the actor's rows, reduced over its DP ranks (trainer.step.shard_metrics)."""
        old = self._forward_only("actor", batch, "logp")
        batch.old_logp = old["logp"]
        batch.old_entropy = old["entropy"]  # [N, T] for the entropy-control hook
        mask = S.own_mask(batch, "actor")
        d = (batch.rollout_logp - batch.old_logp).double()  # approx_kl's log q - log p (q = rollout)
        s = S.global_sums(self, "actor", batch, {
            **masked_sums("ent", old["entropy"], mask), **masked_sums("k1", d, mask),
            **masked_sums("abs", d.abs(), mask), **masked_sums("k3", torch.expm1(-d.clamp(min=-20.0)) + d, mask)})
        m = {"rollout/entropy": ratio(s, "ent"), "mismatch/train_rollout_kl": ratio(s, "k1"),
             # the same gap whatever the routing (R3 on or off): |log pi_train - log pi_rollout| and k3 KL
             "mismatch/logprob_abs_diff": ratio(s, "abs"), "mismatch/kl_k3": ratio(s, "k3")}
        if self.r3_on:
            m.update(self.r3.step_metrics(self.step_idx, batch.old_logp, batch.rollout_logp, mask,
                                          lambda: self._forward_only("actor", batch, "native_logp"),
                                          reduce=lambda sums: S.global_sums(self, "actor", batch, sums)))
        return m

    def critic_values(self, batch: RolloutBatch):
        """The critic's values [N, T] of every row (None without a critic)."""
        return self._forward_only("critic", batch, "values")["values"] if self.uses_critic else None

    def advantages(self, batch: RolloutBatch) -> dict:
        """batch.adv (+ old_values, returns with a critic; is_w, keep with IS corrections). A sharded
        batch: each rank computes its own rows' (trainer.step.shard_metrics.shard_advantages). The critic's values:
        batch.old_values when the step computed them already (critic_values), else computed here."""
        a, mask = self.cfg.algo, batch.mask
        values = getattr(batch, "old_values", None)
        if values is None and self.uses_critic:
            values = self.critic_values(batch)
        out, m = S.shard_advantages(self, batch, values)
        batch.adv, batch.old_values, batch.returns = out.adv, values, out.returns
        if a.normalize_advantages:
            batch.adv = self._whitened(batch)
        if self.spec.uses_is_corrections:
            old, beh = batch.old_logp, batch.rollout_logp
            is_w = A.token_is_weights(old, beh, mask, cap=a.tis_cap)
            ice = A.icepop_mask(old, beh, mask, a.icepop_low, a.icepop_high)
            mis = A.mis_sequence_mask(old, beh, mask, a.mis_threshold)
            keep = ice * mis
            own = S.own_mask(batch, "actor")
            rows = own.bool().any(1)
            s = S.global_sums(self, "actor", batch, {
                **masked_sums("keep", keep, own), **masked_sums("is_w", is_w, own), **masked_sums("ice", ice, own),
                "mis": ((mis.amax(1) == 0) & rows).sum(), "rows": rows.sum()})
            m.update({"mismatch/keep_frac": ratio(s, "keep"), "mismatch/is_weight_mean": ratio(s, "is_w"),
                      "mismatch/icepop_masked_frac": 1 - ratio(s, "ice"),  # of tokens
                      "mismatch/mis_masked_frac": s["mis"] / max(s["rows"], 1.0)})
            if a.mismatch_corrections:
                batch.is_w, batch.keep = is_w, keep
        if self.entropy_control is not None:  # e.g. GRPO-X's GEPO slot (algorithms.entropy_control)
            m.update(S.entropy_control(self, batch))
        adv = batch.adv
        s = S.global_sums(self, "actor", batch, masked_sums(
            "adv", adv if adv.dim() == 2 else adv[:, None].expand_as(mask), S.own_mask(batch, "actor")))
        m["adv/mean"] = ratio(s, "adv")
        return m

    def _whitened(self, batch: RolloutBatch) -> torch.Tensor:
        """batch.adv [N, T] (a per-row [N] broadcast) minus its mean over the step's valid tokens, over their std."""
        adv = batch.adv if batch.adv.dim() == 2 else batch.adv[:, None].expand_as(batch.mask)
        own = S.own_mask(batch, "actor")
        s = S.global_sums(self, "actor", batch, {**masked_sums("a", adv, own), **masked_sums("a2", adv * adv, own)})
        mu = ratio(s, "a")
        std = max(ratio(s, "a2") - mu * mu, 0.0) ** 0.5
        return (adv - mu) / (std + 1e-8) * batch.mask

    def update_actor(self, batch: RolloutBatch) -> dict:
        a = self.cfg.algo
        am = self._update("actor", batch, a.actor_minibatches, a.actor_epochs, self._actor_loss,
                          self.cfg.train.seed * 7919 + self.step_idx)
        return {f"actor/{k}": v for k, v in world_mean(am).items()}

    def update_critic(self, batch: RolloutBatch) -> dict:
        if not self.uses_critic:
            return {}
        a = self.cfg.algo
        cm = self._update("critic", batch, a.critic_minibatches, a.critic_epochs, self._critic_loss,
                          self.cfg.train.seed * 7919 + self.step_idx + 1)
        return {f"critic/{k}": v for k, v in world_mean(cm).items()}

    def _actor_loss(self, mb, logits):
        return actor_loss(mb, logits, policy_loss=self.policy_loss, algo_cfg=self.cfg.algo,
                          vocab_size=self.info.vocab_size, temperature=self.cfg.rollout.temperature,
                          chunk_tokens=self.cfg.algo.logprob_chunk_tokens or None)

    def _critic_loss(self, mb, values):
        return critic_loss(mb, values, value_clip=self.cfg.algo.value_clip)

    # ---- one step ----------------------------------------------------------------------------
    def train_on(self, batch: RolloutBatch, m: dict) -> None:
        """The training phases of a step on its kept batch, in their one order: critic values, old log-probs (the
        current actor: the proximal policy off-policy), advantages + IS corrections, credit record, actor update,
        critic update. Metrics go to ``m`` (time/old_logp_values, time/train, skipped_steps_total)."""
        place = self.placement.place
        self.engine_sleep()  # from here until the weight sync only the models run
        t1 = time.time()
        # one model resident at a time under train.offload_idle: the critic's values, then the actor's forward
        place(m, on=["critic"], off=["actor"])
        batch.old_values = self.critic_values(batch)
        place(m, on=["actor"], off=["critic"])
        m.update(self.old_logprobs(batch))
        m.update(self.advantages(batch))
        if self.cfg.train.credit_every and self.step_idx % self.cfg.train.credit_every == 0:
            from megatron_s3ac.trainer.step.credit_record import record_credit

            record_credit(self, batch)  # per-token advantages for the credit plot (tools/plot_credit.py)
        m["time/old_logp_values"] = time.time() - t1
        t2 = time.time()
        m.update(self.update_actor(batch))
        place(m, on=["critic"], off=["actor"])
        m.update(self.update_critic(batch))
        m.update(self.privileged_missing(batch))
        if not self.placement.offload_colocated:  # else both stay on the host while the engine is awake (the sync)
            place(m, on=["actor"])  # both resident between steps (checkpoints, evaluation, DAPS)
        m["time/train"] = time.time() - t2
        self.skipped_steps += int(m.get("actor/skipped_minibatches", 0) + m.get("critic/skipped_minibatches", 0) > 0)
        m["skipped_steps_total"] = self.skipped_steps

    def step(self) -> dict:
        """One RL step: the source's batch (trainer.step.source), the training phases on it, the weight sync. A step whose
        batch is empty (every group aborted or filtered out) trains nothing and syncs nothing."""
        t0 = time.time()
        m: dict = {"step": self.step_idx}
        self.placement.place(m, on=["critic"] if self.daps is not None else [])  # DAPS scores prompts with V(s0)
        r = self.source.next_batch(m)
        m.update(r.metrics)
        m.update(self.rollout_metrics(r))  # over every drawn trajectory
        m["time/rollout"] = time.time() - t0
        if r.batch is None:
            self.placement.place(m, on=["actor", "critic"])
        else:
            self.train_on(r.batch, m)
            self.source.sync_weights(m)
        self.step_idx += 1
        self.source.end_step(m, t0, r)
        return m

    # ---- evaluation (rank 0 only: the engine generates, nothing of the training state is touched) --
    def eval_report(self, greedy: bool, sets: dict | None = None) -> dict | None:
        """``eval.runner.evaluate`` on the engine's current weights (rank 0; None elsewhere)."""
        return None if self.evaluation is None else self.evaluation.report(self.engine, self.vocab, greedy, sets)

    def evaluate(self, greedy: bool = True, name: str = "heldout") -> float | None:
        """Pass rate (avg@k) of one evaluation set: greedy (T = 0) or sampled (eval.temperature, eval.k).
        Rank 0 only (None elsewhere)."""
        return None if self.evaluation is None else self.evaluation.pass_rate(self.engine, self.vocab, greedy, name)

    def periodic_eval(self) -> dict:
        """Every ``train.eval_every`` steps (after the step's weight sync); {} elsewhere."""
        return {} if self.evaluation is None else self.evaluation.periodic(self.step_idx, self.engine, self.vocab)

    def close(self) -> None:
        self.close_weight_sync()  # the weight-update groups / shared segments before the engines they feed
        if getattr(self, "reward_pool", None) is not None:
            self.reward_pool.close()
            self.reward_pool = None
        if self._close_engine():  # the engine's own processes, where its strategy says it has any
            if getattr(self, "_owns_ray", False):
                import ray

                ray.shutdown()

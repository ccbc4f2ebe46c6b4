"""The S3AC online loop (paper §3.1-3.4) and its critic-free baselines, on megatron-core.

One ``Trainer.step()``, top to bottom (every rank runs the same code; rank 0 also hosts the engine):
  1. prompts: DAPS with the latest critic's V(s0) (or a uniform draw from the seeded stream)
  2. rollout on rank 0 (K responses each, behaviour log-probs) -> rewards -> broadcast to all ranks
  3. DAPO group filter (K > 1)
  4. critic values V(s_t) and old log-probs (forward only)
  5. advantages: S3AC GAE (critic lambda = 1 -> returns; actor lambda = 1 - 1/(alpha T)), or
     GRPO-X / REINFORCE++ / FlashREINFORCE; no normalisation for S3AC
  6. actor: rollout batch -> ``actor_minibatches`` mini-batches x ``actor_epochs``; CISPO clip-higher
     with token IS weights, IcePoP and MIS masks; grad clip via the megatron optimizer
  7. critic: ``critic_epochs`` epochs, LR x ``critic_lr_mult``, clipped value loss, grad clip 10
  8. weight sync to the engine; metrics
Losses are returned as sums with megatron's per-token normalisation (calculate_per_token_loss), so a
mini-batch is a true token mean over micro-batches and DP ranks.
"""
from __future__ import annotations

import math
import os
import time
from functools import partial

import torch
import torch.distributed as dist

from megatron_s3ac import algorithms as A
from megatron_s3ac.trainer.batch import collate, micro_batches, select_rows, shard_rows
from megatron_s3ac.trainer.config import Config, layout_of, model_info_for, validate


def _world_mean(d: dict) -> dict:
    """Average python/tensor scalars over all ranks (same keys everywhere)."""
    if not d or dist.get_world_size() == 1:
        return {k: float(v) for k, v in d.items()}
    keys = sorted(d)
    t = torch.tensor([float(d[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return dict(zip(keys, (t / dist.get_world_size()).tolist()))


def _merge_metrics(ms: list[dict], prefix: str) -> dict:
    out = {}
    for m in ms:
        for k, v in m.items():
            if isinstance(v, torch.Tensor) and v.numel() != 1:
                continue
            out.setdefault(k, []).append(float(v))
    return {f"{prefix}/{k}": sum(v) / len(v) for k, v in out.items()}


class Trainer:
    """Actor (+ critic for S3AC), optimizers, rollout engine (rank 0), prompt stream, DAPS, logger."""

    def __init__(self, cfg: Config):
        from megatron_s3ac.models.parallel import init_distributed, initialize_model_parallel

        torch.set_num_threads(cfg.train.threads)
        init_distributed()
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        validate(cfg, self.world)
        if cfg.critic_layout is not None and cfg.critic_layout != cfg.actor_layout:
            raise NotImplementedError("a critic layout different from the actor's is not implemented yet")
        self.info = model_info_for(cfg)
        self.layout = layout_of(cfg.actor_layout)
        initialize_model_parallel(self.layout, seed=cfg.train.seed)
        from megatron.core import parallel_state as ps

        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.pad_to = 8 * self.layout.tp
        self.uses_critic = cfg.algo.name == "s3ac"
        self._build_models()
        self._build_data()
        self.engine = self._build_engine() if self.rank == 0 else None
        self.step_idx = 0
        self.skipped_steps = 0
        self.logger = None
        self.sync_weights()

    # ---- construction ------------------------------------------------------------------------
    def _build_models(self):
        from megatron.core import dist_checkpointing

        from megatron_s3ac.models.actor_critic import (ValueHeadConfig, build_actor, build_critic,
                                                       build_transformer_config)
        from megatron_s3ac.models.optim import build_optimizer, wrap_ddp

        cfg, a = self.cfg, self.cfg.algo
        torch.manual_seed(cfg.train.seed)
        self.actor_config = build_transformer_config(self.info, self.layout)
        self.actor = build_actor(self.info, self.actor_config)
        if cfg.model.actor_init:
            self.actor.load_state_dict(dist_checkpointing.load(self.actor.sharded_state_dict(), cfg.model.actor_init))
        self.actor_ddp = wrap_ddp(self.actor, self.actor_config)
        self.actor_opt = build_optimizer([self.actor_ddp], lr=a.actor_lr, clip_grad=a.actor_clip_grad,
                                         weight_decay=a.weight_decay)
        self.critic = self.critic_ddp = self.critic_opt = None
        if self.uses_critic:
            self.critic_config = build_transformer_config(self.info, layout_of(cfg.critic_layout or cfg.actor_layout))
            self.critic = build_critic(self.info, self.critic_config, ValueHeadConfig(kind=cfg.model.critic_head))
            if cfg.model.critic_init:
                sd = dist_checkpointing.load(self.critic.sharded_state_dict(), cfg.model.critic_init)
                self.critic.load_state_dict(sd)
            else:  # backbone from the actor; the value head keeps its 1/(H+1) init
                self.init_critic_from_actor()
            self.critic_ddp = wrap_ddp(self.critic, self.critic_config)
            self.critic_opt = build_optimizer([self.critic_ddp], lr=a.actor_lr * a.critic_lr_mult,
                                              clip_grad=a.critic_clip_grad, weight_decay=a.weight_decay)

    @torch.no_grad()
    def init_critic_from_actor(self):
        sd = {k: v for k, v in self.actor.state_dict().items() if not k.startswith("output_layer")}
        missing, unexpected = self.critic.module.load_state_dict(sd, strict=False)
        bad = [k for k in missing if not k.startswith("output_layer")]
        if bad or unexpected:
            raise RuntimeError(f"critic/actor backbone mismatch: missing {bad[:4]}, unexpected {unexpected[:4]}")

    def _build_data(self):
        from megatron_s3ac.trainer import data as D

        cfg = self.cfg
        if cfg.data.task == "arithmetic":
            self.vocab = D.CharVocab()
            self.eval_prompts = D.arithmetic_prompts(cfg.data.eval_prompts, cfg.data.max_operand, cfg.data.seed + 1)
            self.prompts = D.arithmetic_prompts(cfg.data.num_prompts, cfg.data.max_operand, cfg.data.seed,
                                                exclude={p.text for p in self.eval_prompts})
            self.data_stats = {"rows": len(self.prompts), "malformed": 0}
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(cfg.model.engine_hf_dir or cfg.model.hf_config)
            self.vocab = tok
            self.prompts, self.data_stats = D.load_math_prompts(cfg.data.path, tok, cfg.data.max_prompt_tokens,
                                                                cfg.data.apply_chat_template)
            self.eval_prompts = []
        self.stream = D.PromptStream(len(self.prompts), cfg.data.seed)
        self.daps = None
        if cfg.daps.enabled and self.uses_critic:
            d = cfg.daps
            self.daps = A.DAPSSampler(num_prompts=len(self.prompts), n_c=d.n_c, a_min=d.a_min,
                                      warmup_steps=d.warmup_steps, rampup_steps=d.rampup_steps,
                                      half_life_steps=d.half_life_steps, seed=cfg.train.seed)

    def _build_engine(self):
        from megatron_s3ac.rollout.cpu_engine import CPUEngine

        if self.cfg.model.engine_hf_dir:
            return CPUEngine.from_pretrained(self.cfg.model.engine_hf_dir)
        from transformers import AutoConfig

        hf = AutoConfig.for_model(**self.info.hf) if self.cfg.model.tiny is None else None
        if hf is None:
            from megatron_s3ac.trainer.data import tiny_arithmetic_hf_config

            hf = tiny_arithmetic_hf_config()
        return CPUEngine.from_config(hf)  # weights come from the actor right after

    def decode(self, ids) -> str:
        return self.vocab.decode(ids) if hasattr(self.vocab, "chars") else self.vocab.decode(ids, skip_special_tokens=True)

    # ---- weight sync -------------------------------------------------------------------------
    def sync_weights(self):
        """Collective: every rank iterates the export; rank 0 loads it into its engine."""
        from megatron_s3ac.trainer.weights import export_hf_weights

        it = export_hf_weights(self.actor, self.info)
        if self.engine is not None:
            self.engine.update_weights(it)
        else:
            for _ in it:
                pass

    # ---- forward passes ----------------------------------------------------------------------
    def _forward_only(self, ddp, batch: dict, what: str) -> dict:
        """Per-response-token outputs [N, T] for every row (every rank computes all rows)."""
        from megatron_s3ac.models.logprobs import vocab_parallel_entropy, vocab_parallel_log_probs
        from megatron_s3ac.models.pipeline import forward_backward

        rows = torch.arange(len(batch["tokens"]))
        mbs = micro_batches(batch, rows, torch.ones(len(rows), dtype=torch.bool), self.cfg.algo.micro_batch_size)
        vocab, temp = self.info.vocab_size, self.cfg.rollout.temperature

        def loss_fn(mb, out):
            if what == "values":
                res = {"values": out.gather(1, mb["idx"]).detach()}
            else:
                targets = torch.roll(mb["input_ids"], -1, dims=1)
                lp = vocab_parallel_log_probs(out, targets, vocab, temp).gather(1, mb["idx"])
                ent = vocab_parallel_entropy(out, vocab, temp).gather(1, mb["idx"])
                res = {"logp": lp.detach(), "entropy": ent}
            return torch.zeros((), requires_grad=False), torch.tensor(1), res

        ddp.eval()
        with torch.no_grad():
            outs = forward_backward([ddp], mbs, loss_fn, forward_only=True)
        ddp.train()
        return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}

    def critic_v0(self, pids: torch.Tensor) -> torch.Tensor:
        """V(s_0) [n] for prompt indices (state = the prompt; output at its last token)."""
        samples = [{"prompt_ids": self.prompts[int(i)].ids, "response_ids": [0], "logprobs": [0.0],
                    "reward": 0.0, "pid": int(i)} for i in pids]
        return self._forward_only(self.critic_ddp, collate(samples, self.pad_to), "values")["values"][:, 0]

    def _train_pass(self, ddp, opt, batch: dict, extra: dict, minibatches: int, epochs: int, loss_fn, seed: int) -> dict:
        """Mini-batch updates; returns averaged metrics. A non-finite loss skips that optimizer step."""
        from megatron_s3ac.models.pipeline import forward_backward

        n = len(batch["tokens"])
        g = torch.Generator().manual_seed(seed)
        metrics, grad_norms, skipped = [], [], 0
        for _ in range(epochs):
            perm = torch.randperm(n, generator=g)
            for mb_rows in perm.tensor_split(min(minibatches, n)):
                rows, real = shard_rows(mb_rows, self.dp_rank, self.dp)
                mbs = micro_batches(batch, rows, real, self.cfg.algo.micro_batch_size, extra)
                ddp.zero_grad_buffer()
                opt.zero_grad()
                out = forward_backward([ddp], mbs, loss_fn)
                finite = torch.tensor([float(all(math.isfinite(float(o["loss_sum"])) for o in out))])
                dist.all_reduce(finite, op=dist.ReduceOp.MIN)
                if finite.item() < 1:  # weights unchanged: drop the reduced grads, no optimizer step
                    ddp.zero_grad_buffer()
                    opt.zero_grad()
                    skipped += 1
                    continue
                ok, gn, _ = opt.step()
                grad_norms.append(float(gn) if gn is not None else float("nan"))
                metrics += out
        res = _merge_metrics(metrics, "x")
        res = {k[2:]: v for k, v in res.items() if k != "x/loss_sum"}
        res["grad_norm"] = sum(grad_norms) / max(1, len(grad_norms))
        res["skipped_minibatches"] = skipped
        res["opt_steps"] = len(grad_norms)
        return res

    # ---- one step ----------------------------------------------------------------------------
    def select_prompts(self) -> tuple[torch.Tensor, dict]:
        n = self.cfg.rollout.prompts_per_step
        if self.daps is None:
            return self.stream.take(n), {}
        sel = self.daps.fill(draw=self.stream.take, score=self.critic_v0, batch_size=n, step=self.step_idx)
        return sel.ids, dict(sel.stats)

    def rollout(self, pids: torch.Tensor) -> list[dict]:
        """Rank 0 generates and scores; every rank receives the same list of sample dicts."""
        from megatron_s3ac.rollout.base import SamplingParams
        from megatron_s3ac.rollout.rewards import get_reward

        r = self.cfg.rollout
        payload = [None]
        if self.rank == 0:
            params = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                    seed=self.cfg.train.seed * 1_000_003 + self.step_idx)
            groups = self.engine.generate([self.prompts[int(i)].ids for i in pids], params, n_samples=r.k)
            fn = get_reward(r.reward).fn  # TODO(math at scale): RewardPool workers for isolate=True rewards
            out = []
            for pid, group in zip(pids.tolist(), groups):
                for s in group:
                    text = self.decode(s.response_ids)
                    try:
                        rew = float(fn(text, self.prompts[pid].reference))
                    except Exception:  # noqa: BLE001 - an unscorable answer is wrong
                        rew = -1.0
                    out.append({"prompt_ids": s.prompt_ids, "response_ids": s.response_ids or [0],
                                "logprobs": (s.logprobs.tolist() or [0.0]), "reward": rew, "pid": pid,
                                "finish": s.finish_reason})
            payload = [out]
        dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def step(self) -> dict:
        cfg, a = self.cfg, self.cfg.algo
        t0 = time.time()
        m: dict = {"step": self.step_idx}
        pids, daps_stats = self.select_prompts()
        m.update(daps_stats)
        samples = self.rollout(pids)
        batch = collate(samples, self.pad_to)
        scores = batch["scores"]
        m["rollout/reward_mean"] = float(scores.mean())
        m["rollout/pass_rate"] = float((scores > 0).float().mean())
        m["rollout/response_len"] = float(batch["resp_len"].float().mean())
        m["rollout/truncated_frac"] = sum(s["finish"] == "length" for s in samples) / len(samples)
        if self.daps is not None:
            self.daps.update(batch["pid"], scores, step=self.step_idx)
        m["time/rollout"] = time.time() - t0

        if cfg.rollout.k > 1 and a.dynamic_sampling:
            keep, fstats = A.dynamic_sampling_filter(scores, group_size=cfg.rollout.k)
            m.update({f"filter/{k}": v for k, v in fstats.items()})
            if int(keep.sum()) == 0:
                m["filter/empty_batch"] = 1
                self.step_idx += 1
                return m
            batch = select_rows(batch, keep.nonzero()[:, 0])
        mask = batch["mask"]
        t1 = time.time()
        old = self._forward_only(self.actor_ddp, batch, "logp")
        old_logp, ent = old["logp"], old["entropy"]
        m["rollout/entropy"] = float(A.masked_mean(ent, mask))
        m["mismatch/train_rollout_kl"] = float(A.approx_kl(old_logp, batch["rollout_logp"], mask))
        extra = {"old_logp": old_logp}
        rew_tok = A.terminal_rewards(batch["scores"], mask)
        if a.name == "s3ac":
            values = self._forward_only(self.critic_ddp, batch, "values")["values"]
            lam = A.length_adaptive_lambda(mask.sum(1), alpha=a.actor_alpha)
            adv, _ = A.compute_gae(rew_tok, values, mask, lam=lam)
            _, returns = A.compute_gae(rew_tok, values, mask, lam=a.critic_lambda)
            extra.update(old_values=values, returns=returns)
            m["critic/explained_variance"] = float(A.explained_variance(values, returns, mask))
            m["critic/v0_mean"] = float(values[:, 0].mean())
        elif a.name == "grpo_x":
            adv = A.grpo_advantages(batch["scores"], cfg.rollout.k, normalize_std=a.grpo_normalize_std, mask=mask)
        elif a.name == "reinforce_pp":
            adv = A.reinforce_pp_advantages(batch["scores"], mask)
        else:  # flash_reinforce: one scalar per row, centred on the batch
            adv = A.flash_reinforce_advantages(batch["scores"])
        extra["adv"] = adv
        if a.name in ("s3ac", "grpo_x"):
            extra["is_w"] = A.token_is_weights(old_logp, batch["rollout_logp"], mask, cap=a.tis_cap)
            extra["keep"] = (A.icepop_mask(old_logp, batch["rollout_logp"], mask, a.icepop_low, a.icepop_high)
                             * A.mis_sequence_mask(old_logp, batch["rollout_logp"], mask, a.mis_threshold))
            m["mismatch/keep_frac"] = float(A.masked_mean(extra["keep"], mask))
        m["adv/mean"] = float(A.masked_mean(adv if adv.dim() == 2 else adv[:, None].expand_as(mask), mask))
        m["time/old_logp_values"] = time.time() - t1

        t2 = time.time()
        seed = cfg.train.seed * 7919 + self.step_idx
        am = self._train_pass(self.actor_ddp, self.actor_opt, batch, extra, a.actor_minibatches, a.actor_epochs,
                              self._actor_loss, seed)
        m.update({f"actor/{k}": v for k, v in _world_mean(am).items()})
        if self.uses_critic:
            cm = self._train_pass(self.critic_ddp, self.critic_opt, batch, extra, a.critic_minibatches,
                                  a.critic_epochs, self._critic_loss, seed + 1)
            m.update({f"critic/{k}": v for k, v in _world_mean(cm).items()})
        m["time/train"] = time.time() - t2
        self.skipped_steps += int(m.get("actor/skipped_minibatches", 0) + m.get("critic/skipped_minibatches", 0) > 0)
        m["skipped_steps_total"] = self.skipped_steps
        t3 = time.time()
        self.sync_weights()
        m["time/sync"] = time.time() - t3
        m["time/step"] = time.time() - t0
        self.step_idx += 1
        return m

    # ---- losses (run on each micro-batch; return sums, megatron divides by the global count) ----
    def _actor_loss(self, mb, logits):
        from megatron_s3ac.models.logprobs import vocab_parallel_log_probs

        a = self.cfg.algo
        targets = torch.roll(mb["input_ids"], -1, dims=1)
        logp = vocab_parallel_log_probs(logits, targets, self.info.vocab_size, self.cfg.rollout.temperature)
        logp = logp.gather(1, mb["idx"])
        mask = mb["mask"]
        if a.name == "flash_reinforce":
            loss, met = A.flash_reinforce_loss(logp, mb["rollout_logp"], mb["adv"], mask, a.flash_delta, num_global_seqs=1)
            count = (mask.sum(1) > 0).sum()
        else:
            loss, met = A.cispo_loss(logp, mb["old_logp"], mb["adv"], mask, a.eps_low, a.eps_high,
                                     is_weights=mb.get("is_w"), keep_mask=mb.get("keep"), num_global_tokens=1)
            count = mask.sum()
        met = {k: v for k, v in met.items() if k != "num_tokens"}
        met["loss_sum"] = loss.detach()
        return loss, count.long().clamp(min=0), met

    def _critic_loss(self, mb, values_all):
        mask = mb["mask"]
        values = values_all.gather(1, mb["idx"])
        loss, met = A.value_loss(values, mb["old_values"], mb["returns"], mask, self.cfg.algo.value_clip,
                                 num_global_tokens=1)
        met = {k: v for k, v in met.items() if k != "num_tokens"}
        met["loss_sum"] = loss.detach()
        met["value_loss_tok"] = (loss.detach() / mask.sum().clamp(min=1))
        return loss, mask.sum().long(), met

    # ---- evaluation (rank 0; no collectives) -------------------------------------------------
    def evaluate(self, prompts=None, greedy: bool = True) -> float | None:
        from megatron_s3ac.rollout.base import SamplingParams
        from megatron_s3ac.rollout.rewards import get_reward

        if self.rank != 0:
            return None
        prompts = prompts if prompts is not None else self.eval_prompts
        if not prompts:
            return None
        params = SamplingParams(temperature=0.0 if greedy else 1.0, max_new_tokens=self.cfg.rollout.max_new_tokens, seed=0)
        outs = self.engine.generate([p.ids for p in prompts], params, n_samples=1)
        fn = get_reward(self.cfg.rollout.reward).fn
        return sum(fn(self.decode(o[0].response_ids), p.reference) > 0 for o, p in zip(outs, prompts)) / len(prompts)

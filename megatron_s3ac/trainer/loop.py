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

Parallelism: rows are sharded over each model's DP ranks in every pass (forward-only passes too; their
outputs are all-reduced back over DP and broadcast from the last pipeline stage, so every rank holds
the whole batch's log-probs and values). The critic may use its own layout (``critic_layout``): it is
built and run inside its own ``ParallelContext``. Micro-batches are padded rows or, with
``algo.max_tokens_per_micro_batch``, packed sequences under a token budget (trainer.batch).
"""
from __future__ import annotations

import math
import os
import time
from functools import partial

import torch
import torch.distributed as dist

from megatron_s3ac import algorithms as A
from megatron_s3ac.trainer.batch import collate, micro_batches, pad_micro_batches, per_token, select_rows, shard_rows
from megatron_s3ac.trainer.config import Config, ConfigError, layout_of, model_info_for, validate


def _world_mean(d: dict) -> dict:
    """Average python/tensor scalars over the ranks that have each key (loss metrics exist on the last
    pipeline stage only), so every rank, rank 0 included, gets the same dict."""
    d = {k: float(v) for k, v in d.items()}
    if dist.get_world_size() == 1:
        return d
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, d)
    out: dict = {}
    for one in every:
        for k, v in one.items():
            out.setdefault(k, []).append(v)
    return {k: sum(v) / len(v) for k, v in sorted(out.items())}


def _token_means(ms: list[dict]) -> dict:
    """Per-micro-batch metrics -> token-weighted means over every micro-batch of every rank (collective).

    Each dict carries ``num_tokens`` (its weight): a fully masked micro-batch (DP padding, a filler) says
    nothing, and the result does not depend on how rows fell into micro-batches or ranks. ``*_max`` keys
    take the max. Non-scalar entries are skipped; ``loss_sum`` is dropped."""
    acc: dict = {}
    for m in ms:
        w = float(m.get("num_tokens", 1.0))
        if w <= 0:
            continue
        for k, v in m.items():
            if k in ("num_tokens", "loss_sum") or (isinstance(v, torch.Tensor) and v.numel() != 1):
                continue
            s, n = acc.get(k, (float("-inf"), 0.0) if k.endswith("_max") else (0.0, 0.0))
            acc[k] = (max(s, float(v)), 1.0) if k.endswith("_max") else (s + w * float(v), n + w)
    if dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, acc)
        acc = {}
        for one in every:
            for k, (s, n) in one.items():
                s0, n0 = acc.get(k, (float("-inf"), 0.0) if k.endswith("_max") else (0.0, 0.0))
                acc[k] = (max(s0, s), 1.0) if k.endswith("_max") else (s0 + s, n0 + n)
    return {k: (s / n if n > 0 else float("nan")) for k, (s, n) in sorted(acc.items())}


def _r3_setting(cfg: Config, info):
    """(R3Config, on?) from ``train.r3``: auto = on for MoE models; on for a dense model is refused."""
    from megatron_s3ac.r3.config import R3Config, R3ConfigError

    r3 = R3Config(enabled={"auto": None, "on": True, "off": False}[cfg.train.r3],
                  agreement_every=cfg.train.r3_agreement_every)
    try:
        return r3, r3.is_on(info)
    except R3ConfigError as e:
        raise ConfigError(f"train.r3: {e}") from None


class Trainer:
    """Actor (+ critic for S3AC), optimizers, rollout engine (rank 0), prompt stream, DAPS, logger."""

    def __init__(self, cfg: Config):
        from megatron_s3ac.models.parallel import init_distributed, initialize_model_parallel

        torch.set_num_threads(cfg.train.threads)
        init_distributed()
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        validate(cfg, self.world)
        self.info = model_info_for(cfg)
        self.layout = layout_of(cfg.actor_layout)
        self.uses_critic = cfg.algo.name == "s3ac"
        critic_layout = layout_of(cfg.critic_layout or cfg.actor_layout)
        self.actor_ctx = self.critic_ctx = None
        if self.uses_critic and critic_layout != self.layout:
            from megatron_s3ac.models.parallel import ParallelContext

            # megatron keeps one layout in module globals: the actor's stays installed, the critic's is
            # swapped in around every critic operation (``model_scope("critic")``)
            self.actor_ctx = ParallelContext(self.layout, seed=cfg.train.seed)
            self.critic_ctx = ParallelContext(critic_layout, seed=cfg.train.seed)
        else:
            initialize_model_parallel(self.layout, seed=cfg.train.seed)
        from megatron.core import parallel_state as ps

        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        # sequence parallelism splits every micro-batch's length over TP: a multiple of both models' TP
        self.pad_to = 8 * self.layout.tp * critic_layout.tp // math.gcd(self.layout.tp, critic_layout.tp)
        self._check_packing()
        self._build_models()
        self._moe_layers = []
        if self.r3_on:
            from megatron_s3ac.r3.replay import local_moe_layers

            self._moe_layers = local_moe_layers([self.actor_ddp])
        self._build_data()
        self.engine = self._build_engine() if self.rank == 0 else None
        self._engine_asleep = False
        self.reward_pool = None
        self._build_eval()
        self.step_idx = 0
        self._last_v0 = None
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
        self.r3, self.r3_on = _r3_setting(cfg, self.info)
        self.actor_config = build_transformer_config(self.info, self.layout,
                                                     **(self.r3.transformer_config_overrides(self.info)
                                                        if self.r3_on else {}))
        if self.r3_on:
            from megatron_s3ac.r3.config import R3ConfigError, check_replay_config

            try:  # refuse settings under which replay would be skipped or undone silently
                check_replay_config(self.actor_config)
            except R3ConfigError as e:
                raise ConfigError(f"train.r3: {e}") from None
        self.actor = build_actor(self.info, self.actor_config)
        if cfg.model.actor_init:
            self.actor.load_state_dict(dist_checkpointing.load(self.actor.sharded_state_dict(), cfg.model.actor_init))
        self.actor_ddp = wrap_ddp(self.actor, self.actor_config)
        self.actor_opt = build_optimizer([self.actor_ddp], lr=a.actor_lr, clip_grad=a.actor_clip_grad,
                                         weight_decay=a.weight_decay)
        self.critic = self.critic_ddp = self.critic_opt = None
        if self.uses_critic:
            with self.model_scope("critic"):
                self._build_critic()

    def _build_critic(self):
        from megatron.core import dist_checkpointing

        from megatron_s3ac.models.actor_critic import ValueHeadConfig, build_critic, build_transformer_config
        from megatron_s3ac.models.optim import build_optimizer, wrap_ddp

        cfg, a = self.cfg, self.cfg.algo
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
        """Critic backbone := actor backbone (the value head keeps its own init). At one layout the
        local shards are copied; at different layouts the actor's backbone goes through a torch_dist
        checkpoint (layout-free) under ``train.out_dir`` and is read back at the critic's layout."""
        if self.critic_ctx is None:
            sd = {k: v for k, v in self.actor.state_dict().items() if not k.startswith("output_layer")}
            missing, unexpected = self.critic.module.load_state_dict(sd, strict=False)
            bad = [k for k in missing if not k.startswith("output_layer")]
            if bad or unexpected:
                raise RuntimeError(f"critic/actor backbone mismatch: missing {bad[:4]}, unexpected {unexpected[:4]}")
            return
        import shutil

        from megatron.core import dist_checkpointing

        tmp = os.path.join(self.cfg.train.out_dir, ".critic_init_from_actor")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        backbone = lambda sd: {k: v for k, v in sd.items() if not k.startswith("output_layer")}  # noqa: E731
        with self.model_scope("actor"):
            dist_checkpointing.save(backbone(self.actor.sharded_state_dict()), tmp)
        with self.model_scope("critic"):
            loaded = dist_checkpointing.load(backbone(self.critic.sharded_state_dict()), tmp)
            missing, unexpected = self.critic.load_state_dict(loaded, strict=False)
        bad = [k for k in missing if not k.startswith("output_layer") and not k.endswith("_extra_state")]
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
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
        """Rank 0's rollout engine: in this process (colocated) or in its own Ray actor process
        (separate: ``rollout.RemoteEngine``; same engine code, so the same samples for the same seed)."""
        from functools import partial

        from megatron_s3ac.rollout.cpu_engine import CPUEngine

        if self.cfg.model.engine_hf_dir:
            factory = partial(CPUEngine.from_pretrained, self.cfg.model.engine_hf_dir)
        else:
            from transformers import AutoConfig

            hf = AutoConfig.for_model(**self.info.hf) if self.cfg.model.tiny is None else None
            if hf is None:
                from megatron_s3ac.trainer.data import tiny_arithmetic_hf_config

                hf = tiny_arithmetic_hf_config()
            factory = partial(CPUEngine.from_config, hf)  # weights come from the actor right after
        if self.cfg.rollout.placement == "separate":
            import ray

            from megatron_s3ac.rollout.remote import RemoteEngine

            self._owns_ray = not ray.is_initialized()  # a Ray started here is shut down by close()
            return RemoteEngine(factory, num_cpus=1, torch_threads=self.cfg.train.threads)
        return factory()

    def decode(self, ids) -> str:
        return self.vocab.decode(ids) if hasattr(self.vocab, "chars") else self.vocab.decode(ids, skip_special_tokens=True)

    @staticmethod
    def reset_optimizer(opt, lr: float) -> None:
        """Fresh Adam moments and step counters at learning rate ``lr`` (e.g. after the supervised
        warm-up: its momentum and second moments belong to another objective and another LR)."""
        for o in [c.optimizer for c in getattr(opt, "chained_optimizers", [opt])]:
            o.state.clear()
            for g in o.param_groups:
                g["lr"] = lr
        for g in opt.param_groups:
            g["lr"] = lr

    def model_scope(self, which: str):
        """Context in which the ``which`` ("actor" | "critic") model's parallel state is installed
        (a no-op when both share one layout). Build, run, save and load a model inside its scope."""
        import contextlib

        if self.critic_ctx is None:
            return contextlib.nullcontext()
        return (self.critic_ctx if which == "critic" else self.actor_ctx).active()

    def _scope_of(self, ddp):
        return self.model_scope("critic" if ddp is not None and ddp is self.critic_ddp else "actor")

    def _check_packing(self) -> None:
        if self.cfg.algo.max_tokens_per_micro_batch <= 0:
            return
        from megatron_s3ac.models.specs import have_transformer_engine

        if self.info.model_type.startswith("qwen3_5"):
            raise ConfigError("algo.max_tokens_per_micro_batch: sequence packing is refused for Qwen3.5 "
                              "(megatron-core 0.16.1's Gated DeltaNet ignores the attention mask, so packed "
                              "samples would share recurrent state)")
        if have_transformer_engine():
            raise ConfigError("algo.max_tokens_per_micro_batch: packing is expressed as a block-diagonal "
                              "attention mask, which the torch spec honours; the Transformer Engine spec "
                              "needs THD PackedSeqParams, not wired yet")

    def _micro_batches(self, batch: dict, rows: torch.Tensor, real: torch.Tensor, extra: dict | None = None) -> list[dict]:
        """This rank's rows -> micro-batches (padded or packed), as many on every rank (EP all-to-alls
        and pipeline schedules are collective): ranks with fewer get fully masked no-op ones."""
        a = self.cfg.algo
        mbs = micro_batches(batch, rows, real, a.micro_batch_size, extra,
                            token_budget=a.max_tokens_per_micro_batch, pad_to=self.pad_to)
        if self.world > 1:
            n = torch.tensor([len(mbs)])
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            mbs = pad_micro_batches(mbs, int(n))
        return mbs

    # ---- weight sync -------------------------------------------------------------------------
    def sync_weights(self):
        """Collective: every rank joins the export; rank 0's engine receives every pipeline stage's
        tensors (rollout.weight_sync gathers stages to the engine rank)."""
        from megatron_s3ac.rollout.weight_sync import sync_weights

        chunks = list(self.actor) if isinstance(self.actor, (list, tuple)) else [self.actor]
        if self.engine is not None and self._engine_asleep:
            self.engine.wake()  # weights re-allocated but stale: the sync below must refill every one
            self._engine_asleep = False
        return sync_weights(chunks, self.info, self.engine)

    def _engine_sleep(self) -> None:
        """Colocated placement: release the engine's weights while the models train (rank 0)."""
        if self.engine is not None and self.cfg.rollout.placement == "colocated":
            self.engine.sleep()
            self._engine_asleep = True

    # ---- forward passes ----------------------------------------------------------------------
    def _forward_only(self, ddp, batch: dict, what: str) -> dict:
        """Per-response-token outputs [N, T] of every row, on every rank. what: "values" (critic),
        "logp" (log-probs + entropy, routes replayed under R3) or "native_logp" (log-probs with the
        routers' own choice, recorded: also returns r3 agreement counts "agree", "total").

        Rows are sharded over this model's DP ranks; each row is computed by exactly one DP rank, so a
        sum over DP gathers them, then the last pipeline stage broadcasts to the others."""
        from megatron.core import parallel_state as ps

        from megatron_s3ac.models.logprobs import vocab_parallel_entropy, vocab_parallel_log_probs
        from megatron_s3ac.models.pipeline import forward_backward

        n, T = batch["mask"].shape
        keys = {"values": ["values"], "logp": ["logp", "entropy"], "native_logp": ["logp"]}[what]
        vocab, temp = self.info.vocab_size, self.cfg.rollout.temperature

        def loss_fn(mb, out):
            if what == "values":
                res = {"values": per_token(out, mb).detach()}
            else:
                lp = vocab_parallel_log_probs(out, torch.roll(mb["input_ids"], -1, dims=1), vocab, temp)
                res = {"logp": per_token(lp, mb).detach()}
                if what == "logp":
                    res["entropy"] = per_token(vocab_parallel_entropy(out, vocab, temp), mb)
            return torch.zeros(()), torch.tensor(1), res

        with self._scope_of(ddp):
            rows, real = shard_rows(torch.arange(n), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
            mbs = self._micro_batches(batch, rows, real)
            if what == "native_logp":
                from megatron_s3ac.r3.metrics import record_native_routes

                ctx = record_native_routes([ddp])
            else:
                ctx = self._replay(ddp, mbs)
            ddp.eval()
            with torch.no_grad(), ctx as recorded:
                outs = forward_backward([ddp], mbs, loss_fn, forward_only=True)
            ddp.train()
            full = torch.zeros(len(keys), n, T)
            for mb, o in zip(mbs, outs):
                r = mb["real_rows"]
                for j, k in enumerate(keys):
                    full[j, mb["row_ids"][r]] = o[k][r].float()
            if ps.get_data_parallel_world_size() > 1:
                dist.all_reduce(full, group=ps.get_data_parallel_group())
            if ps.get_pipeline_model_parallel_world_size() > 1:
                dist.broadcast(full, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
            res = dict(zip(keys, full))
            if what == "native_logp":
                from megatron_s3ac.r3.metrics import routing_agreement

                res["agree"], res["total"] = routing_agreement(recorded, [self._align_routes(mb) for mb in mbs])
        return res

    # ---- R3: routing replay ------------------------------------------------------------------
    def _align_routes(self, mb: dict):
        """The rollout's routes of one micro-batch, in the order this rank's routers see its tokens
        (padded rows from position 0, every sample fed whole: its last token gets a filler row;
        only this rank's MoE layers, so dense layers are skipped)."""
        import numpy as np

        from megatron_s3ac.r3.align import align_microbatch, pad_last_row, sp_split

        # no-op rows (DP padding, filler micro-batches) keep the filler routes and are not counted as
        # routed, so they neither replay nor enter the agreement metric
        real = mb["real_rows"].tolist()
        pick = [i for i, ok in enumerate(real) if ok] or [0]
        routes = []
        for i in pick:
            r, n = np.asarray(mb["routes"][i]), mb["placements"][i][2]
            while r.shape[0] < n - 1:  # an empty response was collated as one pad token
                r = pad_last_row(r, self.info.num_experts)
            routes.append(r[: n - 1])
        sp_rank, sp_size = sp_split(self.actor_config)
        out = align_microbatch(routes, [mb["placements"][i] for i in pick], tuple(mb["input_ids"].shape),
                               self._moe_layers, self.info.num_experts, sp_rank=sp_rank, sp_size=sp_size)
        if not any(real):
            out.routed.zero_()
        return out

    def _replay(self, ddp, mbs: list[dict]):
        """Context that replays the rollout's routes in the actor's forward(s) of ``mbs`` (R3)."""
        import contextlib

        if not (self.r3_on and ddp is self.actor_ddp and mbs and "routes" in mbs[0]):
            return contextlib.nullcontext()
        from megatron_s3ac.r3.replay import routing_replay

        return routing_replay([ddp], [self._align_routes(mb) for mb in mbs])

    def _r3_metrics(self, batch: dict, old_logp: torch.Tensor) -> dict:
        """r3/agreement: share of (token, MoE layer) pairs where the trainer's native top-k equals the
        rollout's (an extra forward-only pass, every ``train.r3_agreement_every`` steps);
        r3/logprob_abs_diff, r3/kl_k3: train (replayed) vs rollout log-prob gap; r3/native_*: the same
        gap with native routing (what replay removes)."""
        from megatron_s3ac.r3.metrics import gap_means, logprob_gap

        mask, beh = batch["mask"], batch["rollout_logp"]
        out = {f"r3/{k}": v for k, v in gap_means([logprob_gap(old_logp, beh, mask)]).items()}
        every = self.cfg.train.r3_agreement_every
        if not every or self.step_idx % every:
            return out
        res = self._forward_only(self.actor_ddp, batch, "native_logp")
        t = torch.tensor([res["agree"], res["total"]], dtype=torch.float64)
        dist.all_reduce(t)  # ratio of sums: right whether ranks saw the same tokens (TP) or other ones (DP, SP)
        out["r3/agreement"] = float(t[0] / t[1].clamp(min=1))
        out.update({f"r3/native_{k}": v for k, v in gap_means([logprob_gap(res["logp"], beh, mask)]).items()})
        return out

    def critic_v0(self, pids: torch.Tensor) -> torch.Tensor:
        """V(s_0) [n] for prompt indices (state = the prompt; output at its last token)."""
        samples = [{"prompt_ids": self.prompts[int(i)].ids, "response_ids": [0], "logprobs": [0.0],
                    "reward": 0.0, "pid": int(i)} for i in pids]
        return self._forward_only(self.critic_ddp, collate(samples, self.pad_to), "values")["values"][:, 0]

    def _train_pass(self, ddp, opt, batch: dict, extra: dict, minibatches: int, epochs: int, loss_fn, seed: int) -> dict:
        """Mini-batch updates; returns averaged metrics (loss metrics from the last pipeline stage only).
        A non-finite loss skips that optimizer step."""
        with self._scope_of(ddp):
            return self._train_pass_in_scope(ddp, opt, batch, extra, minibatches, epochs, loss_fn, seed)

    def _train_pass_in_scope(self, ddp, opt, batch, extra, minibatches, epochs, loss_fn, seed) -> dict:
        from megatron.core import parallel_state as ps

        from megatron_s3ac.models.pipeline import forward_backward

        n = len(batch["tokens"])
        dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        g = torch.Generator().manual_seed(seed)
        metrics, grad_norms, skipped = [], [], 0
        for _ in range(epochs):
            perm = torch.randperm(n, generator=g)
            for mb_rows in perm.tensor_split(min(minibatches, n)):
                rows, real = shard_rows(mb_rows, dp_rank, dp)
                mbs = self._micro_batches(batch, rows, real, extra)
                ddp.zero_grad_buffer()
                opt.zero_grad()
                with self._replay(ddp, mbs):
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
        res = _token_means(metrics)
        res["grad_norm"] = sum(grad_norms) / max(1, len(grad_norms))
        res["skipped_minibatches"] = skipped
        res["opt_steps"] = len(grad_norms)
        return res

    # ---- one step ----------------------------------------------------------------------------
    def select_prompts(self) -> tuple[torch.Tensor, dict]:
        n = self.cfg.rollout.prompts_per_step
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
        v0 = self._clamp_values(self.critic_v0(pids))
        self._last_v0 = v0
        return v0

    def _clamp_values(self, v: torch.Tensor) -> torch.Tensor:
        a = self.cfg.algo
        return v.clamp(a.reward_min, a.reward_max) if a.clamp_values else v

    def rollout(self, pids: torch.Tensor) -> list[dict]:
        """Rank 0 generates and scores; every rank receives the same list of sample dicts."""
        from megatron_s3ac.rollout.base import SamplingParams

        r = self.cfg.rollout
        payload = [None]
        if self.rank == 0:
            params = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                    seed=self.cfg.train.seed * 1_000_003 + self.step_idx)
            groups = self.engine.generate([self.prompts[int(i)].ids for i in pids], params, n_samples=r.k,
                                          return_routed_experts=self.r3_on)
            flat = [(pid, s) for pid, group in zip(pids.tolist(), groups) for s in group]
            rewards = self._score([self.decode(s.response_ids) for _, s in flat],
                                  [self.prompts[pid].reference for pid, _ in flat])
            out = [{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids or [0],
                    "logprobs": (s.logprobs.tolist() or [0.0]), "reward": float(rew), "pid": pid,
                    "finish": s.finish_reason, "routes": s.routed_experts}
                   for (pid, s), rew in zip(flat, rewards)]
            payload = [out]
        dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def _score(self, responses: list[str], references: list[str]) -> list[float]:
        """Rewards of one rollout batch (rank 0). Verifiers that may hang or blow up (math-verify:
        ``isolate``) run in the RewardPool's worker processes under a per-answer time limit; cheap
        ones inline. An answer that cannot be scored is wrong (-1)."""
        from megatron_s3ac.rollout.rewards import get_reward

        spec = get_reward(self.cfg.rollout.reward)
        if spec.isolate:
            return self._reward_pool().score(self.cfg.rollout.reward, responses, references).tolist()
        out = []
        for text, ref in zip(responses, references):
            try:
                out.append(float(spec.fn(text, ref)))
            except Exception:  # noqa: BLE001 - an unscorable answer is wrong
                out.append(-1.0)
        return out

    def _reward_pool(self):
        """One verifier pool per run (rank 0), shared by rollouts and evaluation."""
        if self.reward_pool is None:
            from megatron_s3ac.rollout.rewards import RewardPool

            self.reward_pool = RewardPool(num_workers=self.cfg.rollout.reward_workers,
                                          timeout_s=self.cfg.rollout.reward_timeout_s)
        return self.reward_pool

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
        if self.reward_pool is not None:  # verifier health (rank 0 only; cumulative counts)
            st = self.reward_pool.stats
            m.update({"reward/timeouts": st.timeouts, "reward/crashes": st.crashes, "reward/errors": st.errors})
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
        self._engine_sleep()  # from here until the weight sync only the models run
        t1 = time.time()
        old = self._forward_only(self.actor_ddp, batch, "logp")
        old_logp, ent = old["logp"], old["entropy"]
        m["rollout/entropy"] = float(A.masked_mean(ent, mask))
        m["mismatch/train_rollout_kl"] = float(A.approx_kl(old_logp, batch["rollout_logp"], mask))
        self.last_batch, self.last_old_logp = batch, old_logp  # for tests and debugging (references only)
        if self.r3_on:
            m.update(self._r3_metrics(batch, old_logp))
        extra = {"old_logp": old_logp}
        rew_tok = A.terminal_rewards(batch["scores"], mask)
        if a.name == "s3ac":
            values = self._forward_only(self.critic_ddp, batch, "values")["values"]
            self.last_values = values
            v_gae = self._clamp_values(values)
            lam = A.length_adaptive_lambda(mask.sum(1), alpha=a.actor_alpha)
            adv, _ = A.compute_gae(rew_tok, v_gae, mask, lam=lam)
            _, returns = A.compute_gae(rew_tok, v_gae, mask, lam=a.critic_lambda)
            extra.update(old_values=values, returns=returns)
            m["critic/explained_variance"] = float(A.explained_variance(values, returns, mask))
            m["critic/v0_mean"] = float(values[:, 0].mean())
            m["critic/values_out_of_range_frac"] = float(A.masked_mean(
                ((values < a.reward_min) | (values > a.reward_max)).float(), mask))
            # sign check: with +-1 rewards, A at the last token = R - V(s_T-1); a correct answer's
            # advantage must be positive and a wrong one's negative
            last = A.terminal_rewards(torch.ones_like(batch["scores"]), mask).bool()
            pos, neg = batch["scores"] > 0, batch["scores"] <= 0
            if pos.any():
                m["adv/last_token_correct"] = float(adv[last][pos].mean())
            if neg.any():
                m["adv/last_token_wrong"] = float(adv[last][neg].mean())
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
        logp = per_token(logp, mb)
        mask = mb["mask"]
        if a.name == "flash_reinforce":
            loss, met = A.flash_reinforce_loss(logp, mb["rollout_logp"], mb["adv"], mask, a.flash_delta, num_global_seqs=1)
            count = (mask.sum(1) > 0).sum()
        else:
            loss, met = A.cispo_loss(logp, mb["old_logp"], mb["adv"], mask, a.eps_low, a.eps_high,
                                     is_weights=mb.get("is_w"), keep_mask=mb.get("keep"), num_global_tokens=1)
            count = mask.sum()
        met["num_tokens"] = mask.sum()  # the weight of this micro-batch's metrics (_token_means)
        met["loss_sum"] = loss.detach()
        return loss, count.long().clamp(min=0), met

    def _critic_loss(self, mb, values_all):
        mask = mb["mask"]
        values = per_token(values_all, mb)
        loss, met = A.value_loss(values, mb["old_values"], mb["returns"], mask, self.cfg.algo.value_clip,
                                 num_global_tokens=1)
        met["num_tokens"] = mask.sum()
        met["loss_sum"] = loss.detach()
        met["value_loss_tok"] = (loss.detach() / mask.sum().clamp(min=1))
        return loss, mask.sum().long(), met

    # ---- evaluation (rank 0 only: the engine generates, nothing of the training state is touched) --
    def _build_eval(self):
        """Held-out sets and the PeriodicEvaluator (rank 0; the engine lives there)."""
        from megatron_s3ac.eval.periodic import PeriodicEvaluator
        from megatron_s3ac.eval.runner import BenchmarkSpec
        from megatron_s3ac.rollout.rewards import get_reward

        cfg, e = self.cfg, self.cfg.eval
        self.evaluator = None
        self.eval_sets = {}
        if self.rank != 0:
            return
        reward = e.reward or cfg.rollout.reward
        if e.heldout and self.eval_prompts:  # pre-tokenized: the exact ids the trainer would feed
            rows = [{"prompt": p.text, "answer": p.reference, "prompt_ids": list(p.ids)} for p in self.eval_prompts]
            self.eval_sets["heldout"] = BenchmarkSpec(rows, reward=reward, k=e.k_for.get("heldout"))
        for name, path in e.benchmarks.items():
            self.eval_sets[name] = BenchmarkSpec(path, reward=reward, k=e.k_for.get(name))
        if not self.eval_sets:
            return
        if get_reward(reward).isolate:  # one verifier pool for the whole run, not one per evaluation
            self._reward_pool()
        self.evaluator = PeriodicEvaluator(self.eval_sets, every_n_steps=cfg.train.eval_every, k=e.k,
                                           params=self._eval_params(greedy=False), seed=e.seed,
                                           template=e.template, report_dir=os.path.join(cfg.train.out_dir, "eval"),
                                           reward_pool=self.reward_pool, batch_size=e.batch_size)
        self.eval_sets = self.evaluator.benchmarks  # loaded once (files validated at start-up)

    def _eval_params(self, greedy: bool):
        from megatron_s3ac.rollout.base import SamplingParams

        e = self.cfg.eval
        return SamplingParams(temperature=0.0 if greedy else e.temperature, top_p=1.0 if greedy else e.top_p,
                              max_new_tokens=e.max_new_tokens or self.cfg.rollout.max_new_tokens)

    def eval_report(self, greedy: bool, sets: dict | None = None) -> dict | None:
        """``megatron_s3ac.eval.runner.evaluate`` on the engine's current weights (rank 0; None elsewhere):
        greedy = T 0 and k 1, else the eval section's sampling settings and k."""
        from megatron_s3ac.eval.runner import evaluate

        sets = self.eval_sets if sets is None else sets
        if self.rank != 0 or not sets:
            return None
        e = self.cfg.eval
        return evaluate(self.engine, self.vocab, sets, k=1 if greedy else e.k, params=self._eval_params(greedy),
                        seed=e.seed, template=e.template, reward_pool=self.reward_pool, batch_size=e.batch_size)

    def evaluate(self, greedy: bool = True, name: str = "heldout") -> float | None:
        """Pass rate (avg@k) of one evaluation set, by the same code as ``s3ac-eval`` and the periodic
        evaluation: greedy (T = 0) or sampled (eval.temperature, eval.k). Rank 0 only (None elsewhere)."""
        if self.rank != 0 or name not in self.eval_sets:
            return None
        spec = self.eval_sets[name]
        if greedy:
            import dataclasses

            spec = dataclasses.replace(spec, k=1)
        return self.eval_report(greedy, {name: spec})["benchmarks"][name]["avg_at_k"]

    def periodic_eval(self) -> dict:
        """Every ``train.eval_every`` steps (after the step's weight sync): eval/<set>/avg@k, pass@k,
        eval/average, eval/is_best (+ eval/<set>/greedy). Rank 0 computes; returns {} elsewhere."""
        if self.evaluator is None or not self.evaluator.should_run(self.step_idx):
            return {}
        m = self.evaluator.run(self.step_idx, self.engine, self.vocab)
        if self.cfg.eval.greedy:
            import dataclasses

            rep = self.eval_report(True, {n: dataclasses.replace(s, k=1) for n, s in self.eval_sets.items()})
            m.update({f"eval/{n}/greedy": b["avg_at_k"] for n, b in rep["benchmarks"].items()})
        return m

    def close(self) -> None:
        if getattr(self, "reward_pool", None) is not None:
            self.reward_pool.close()
            self.reward_pool = None
        if self.cfg.rollout.placement == "separate" and getattr(self, "engine", None) is not None:
            self.engine.close()  # the engine's own process
            self.engine = None
            if getattr(self, "_owns_ray", False):
                import ray

                ray.shutdown()

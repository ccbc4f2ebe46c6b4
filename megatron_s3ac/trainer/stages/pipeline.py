"""``s3ac-train pipeline``: the paper's recipe as resumable stages in one torchrun job (megatron starts once).

    warmup          (model.tiny only) supervised warm-up of the from-scratch demo model into a policy:
                    policies/step_N/ (HF dir + tokenizer) per evaluation point, actor/ (torch_dist), warmup.jsonl
    coverage        (critic used, value_pretrain.enabled, no model.critic_init) coverage.jsonl from
                    pipeline.policies, rolled out with rollout.engine at rollout.max_new_tokens (trainer.stages.coverage)
    value_pretrain  (as coverage) critic/ (torch_dist; frozen attention + router, value_pretrain.* LR and
                    schedule), value_pretrain.jsonl
    rl              train.out_dir as ``s3ac-train train`` writes it, from the warm-up actor and the pretrained critic

Each stage lives in its own dir (``pipeline.<stage>_dir``, default ``{train.out_dir}/stages/<stage>``; rl:
``train.out_dir``) and ends by writing ``DONE.json`` = {stage, fingerprint, keys, result, wall_s}. A stage
whose DONE.json carries this config's fingerprint is skipped and its recorded result reused; another
fingerprint is an error naming the keys that differ (never a silent reuse). A stage killed before its
DONE.json is redone from scratch (its dir is emptied first), except rl, which resumes from its checkpoints.
``stage_keys`` / ``stage_fingerprint`` are public: tools/reproduce_claims.py groups arms that share stages.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import time
from typing import Callable, Optional

from megatron_s3ac.rollout.errors import EngineSettings
from megatron_s3ac import faults
from megatron_s3ac.config import Config, ConfigError

STAGES = ("warmup", "coverage", "value_pretrain", "rl")
DONE = "DONE.json"
COVERAGE_VERDICT = "coverage_verdict.json"  # rank 0's {"ok", "error"} for the ranks waiting on its coverage
ENGINE_START_S = 900.0  # EnginePool's start_timeout_s default

# ---- what each stage depends on ---------------------------------------------------------------------
# the warm-up trains the actor alone: the critic's settings (model.critic_*, value head init) are not
# inputs, so arms that differ only there share one warm-up. Its optimizer is the actor's (clip, decay),
# its stopping rule the greedy held-out evaluation (eval.*, the default max_new_tokens and reward).
_WARMUP = ["model.*", "-model.critic_init", "-model.critic_head", "-model.value_head_init_std", "-model.critic_privileged",
           "-model.critic_privileged_max_tokens",
           "actor_layout.*", "data.*", "-data.prompt_subset", "demo.*", "-demo.coverage_checkpoints", "-demo.coverage_prompts",
           "-demo.coverage_k", "train.seed", "train.r3", "algo.actor_clip_grad", "algo.weight_decay",
           "algo.micro_batch_size", "algo.max_tokens_per_micro_batch", "eval.*", "rollout.max_new_tokens",
           "rollout.reward"]
_COVERAGE = ["rollout.engine", "rollout.temperature", "rollout.top_p", "pipeline.policies",
             "pipeline.coverage_prompts", "pipeline.coverage_k", "demo.coverage_checkpoints", "demo.coverage_prompts",
             "demo.coverage_k"]
_VALUE_PRETRAIN = ["value_pretrain.*", "model.value_head_init_std", "model.critic_head", "model.critic_privileged",
                   "model.critic_privileged_max_tokens", "model.critic_init",
                   "critic_layout"]
# rl: everything but where things are written and how progress is shown
_RL_EXCLUDE = ["-pipeline.warmup_dir", "-pipeline.coverage_timeout_s", "-pipeline.coverage_dir",
               "-pipeline.value_pretrain_dir",
               "-pipeline.stop_after", "-train.out_dir", "-train.resume", "-train.progress", "-train.tensorboard",
               "-train.wandb_project", "-cluster.*", "-rollout.reward_workers", "-train.dist_timeout_s"]


def _leaf_keys(cls=Config, prefix: str = "") -> list[str]:
    """Dotted keys of the schema's leaves (an Optional section such as critic_layout, and rollout.sglang /
    rollout.vllm, are one leaf each)."""
    out = []
    for f in dataclasses.fields(cls):
        sub = f.default_factory
        if sub is not dataclasses.MISSING and dataclasses.is_dataclass(sub) and not issubclass(sub, EngineSettings):
            out += _leaf_keys(sub, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def _expand(patterns: list[str]) -> list[str]:
    """``*`` = every leaf, ``section.*`` -> its leaves, ``-key`` / ``-section.*`` removes; schema order."""
    leaves = _leaf_keys()
    keep: set[str] = set()
    for p in patterns:
        neg, pat = p.startswith("-"), p.lstrip("-")
        hit = {k for k in leaves if pat == "*" or k == pat or (pat.endswith(".*") and k.startswith(pat[:-1]))}
        if not hit:
            raise KeyError(f"stage key pattern {p!r} matches no config key")
        keep = keep - hit if neg else keep | hit
    return [k for k in leaves if k in keep]


def stage_keys(stage: str) -> list[str]:
    """The dotted config keys ``stage`` depends on, upstream stages' included."""
    groups = {"warmup": _WARMUP, "coverage": _WARMUP + _COVERAGE,
              "value_pretrain": _WARMUP + _COVERAGE + _VALUE_PRETRAIN, "rl": ["*"] + _RL_EXCLUDE}
    if stage not in groups:
        raise KeyError(f"unknown pipeline stage {stage!r}; one of {STAGES}")
    return _expand(groups[stage])


def _plain(v):
    """A JSON value for a config value (enums by value, OmegaConf containers as lists / dicts)."""
    from omegaconf import OmegaConf

    if hasattr(v, "value") and not isinstance(v, (int, float, str, bool)):
        return v.value
    if isinstance(v, (list, tuple)) or OmegaConf.is_config(v):
        v = OmegaConf.to_container(v, enum_to_str=True) if OmegaConf.is_config(v) else list(v)
        return json.loads(json.dumps(v, default=str))
    if isinstance(v, dict):
        return json.loads(json.dumps(v, default=str))
    if dataclasses.is_dataclass(v):
        return json.loads(json.dumps(dataclasses.asdict(v), default=str))
    return getattr(v, "value", v)


def stage_values(cfg: Config, stage: str) -> dict:
    """{dotted key: JSON value} of ``stage_keys(stage)`` in ``cfg``."""
    out = {}
    for key in stage_keys(stage):
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        out[key] = _plain(obj)
    return out


def stage_fingerprint(cfg: Config, stage: str) -> str:
    """sha256 (16 hex) of the stage's key values: equal fingerprints = the same stage output."""
    blob = json.dumps({"stage": stage, "keys": stage_values(cfg, stage)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def stage_dirs(cfg: Config) -> dict:
    """{stage: dir}; rl's dir is train.out_dir."""
    p, root = cfg.pipeline, os.path.join(cfg.train.out_dir, "stages")
    return {"warmup": p.warmup_dir or os.path.join(root, "warmup"),
            "coverage": p.coverage_dir or os.path.join(root, "coverage"),
            "value_pretrain": p.value_pretrain_dir or os.path.join(root, "value_pretrain"),
            "rl": cfg.train.out_dir}


def planned_stages(cfg: Config) -> dict:
    """{stage: why it runs or not} ("run" | a reason it is not part of this pipeline)."""
    from megatron_s3ac.algorithms.registry import get_algo

    critic = get_algo(cfg.algo.name).uses_critic
    vpt = ("run" if critic and cfg.value_pretrain.enabled and not cfg.model.critic_init else
           "no critic" if not critic else "model.critic_init given" if cfg.model.critic_init
           else "value_pretrain.enabled=false")
    warm = cfg.model.tiny is not None or cfg.demo.warmup_actor_init
    plan = {"warmup": "run" if warm else "not model.tiny (the actor is model.actor_init; demo.warmup_actor_init=false)",
            "coverage": vpt, "value_pretrain": vpt, "rl": "run"}
    if plan["coverage"] == "run" and cfg.value_pretrain.coverage_path:
        plan["coverage"] = "value_pretrain.coverage_path given"
    stop = STAGES.index(getattr(cfg.pipeline.stop_after, "value", cfg.pipeline.stop_after))
    for s in STAGES[stop + 1:]:
        plan[s] = f"pipeline.stop_after={STAGES[stop]}"
    return plan


def pipeline_errors(cfg: Config) -> list[str]:
    """What would stop ``s3ac-train pipeline`` before any work (the plain config checks come first)."""
    plan, out = planned_stages(cfg), []
    if plan["coverage"] == "run" and cfg.pipeline.policies is None and plan["warmup"] != "run":
        out.append("pipeline.policies: the coverage stage needs policies (HF dirs of several strengths); only "
                   "model.tiny has a warm-up whose snapshots serve by default (or set value_pretrain.coverage_path, "
                   "or model.critic_init)")
    dirs = stage_dirs(cfg)
    for stage in STAGES:  # a DONE.json of another config: refused before any work
        if plan[stage] == "run":
            try:
                read_done(cfg, stage, dirs[stage])
            except StageMismatch as e:
                out.append(str(e))
    return out


class StageMismatch(ConfigError):
    """A stage dir holds a DONE.json written under another config."""


def read_done(cfg: Config, stage: str, directory: str) -> Optional[dict]:
    """The stage's DONE.json if it exists with this config's fingerprint; None if absent; StageMismatch
    naming every key that differs otherwise."""
    path = os.path.join(directory, DONE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        done = json.load(f)
    if done.get("fingerprint") == stage_fingerprint(cfg, stage):
        return done
    now, was = stage_values(cfg, stage), done.get("keys", {})
    diff = [f"{k}: {was.get(k, '<absent>')!r} (recorded) vs {now.get(k, '<absent>')!r} (now)"
            for k in sorted(set(now) | set(was)) if now.get(k, "<absent>") != was.get(k, "<absent>")]
    fix = (f"delete {directory} to redo the stage, or point pipeline.{stage}_dir elsewhere" if stage != "rl" else
           f"choose another train.out_dir, or delete {path} to continue the run from its checkpoints "
           f"under the new config")
    raise StageMismatch(f"pipeline stage {stage}: {path} was written under another config ("
                        + ("; ".join(diff) or "same keys, another fingerprint") + f"); {fix}")


def write_done(cfg: Config, stage: str, directory: str, result: dict, wall_s: float) -> dict:
    done = {"stage": stage, "fingerprint": stage_fingerprint(cfg, stage), "keys": stage_values(cfg, stage),
            "result": result, "wall_s": wall_s}
    tmp = os.path.join(directory, DONE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(done, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, DONE))
    return done


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def release_engine(tr) -> bool:
    """Close rank 0's engine if it holds Ray placement groups (an EnginePool: its GPUs stay reserved even asleep, so
    no other engine could be placed on them). Returns whether it was closed (restore_engine starts it again)."""
    eng = getattr(tr, "engine", None)
    if eng is None or not getattr(eng, "placement_groups", None):
        return False
    getattr(eng, "close", eng.shutdown)()
    tr.engine = None
    return True


def restore_engine(tr) -> None:
    """Start rank 0's engine again as the trainer built it (trainer.step.build.build_engine); the caller syncs weights.
    Building draws nothing from the trainer's random stream."""
    import torch

    from megatron_s3ac.trainer.step import build as B

    with torch.random.fork_rng(devices=[]):
        tr.engine, _ = B.build_engine(tr.cfg, tr.info, multimodal=tr.multimodal)
    tr.sync_strategy.attach(tr.engine)  # its sessions were closed before the old engine went (run_coverage)
    if tr.placement.offload_colocated:
        tr.engine_sleep()  # the next sync wakes it in the colocated order (trainer.step.engine_side)


# ---- the stages -------------------------------------------------------------------------------------
class Pipeline:
    """Runs the planned stages on one Trainer. ``after_stage(stage, ran: bool)`` is called on every rank
    after each stage (the demo exports its eval inputs there)."""

    def __init__(self, cfg: Config, trainer=None):
        self.cfg = cfg
        self.plan = planned_stages(cfg)
        self.dirs = stage_dirs(cfg)
        errs = pipeline_errors(cfg)
        if errs:
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(errs))
        # fingerprints of the config as given (rl's actor_init / critic_init are filled in below)
        self.fingerprints = {s: stage_fingerprint(cfg, s) for s in STAGES}
        self._orig_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model))
        if trainer is None:
            from megatron_s3ac.trainer.step.trainer import Trainer

            trainer = Trainer(cfg)
        self.tr = trainer
        self.rank = trainer.rank
        self.results: dict = {}

    # -- helpers
    def _barrier(self):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def _fresh_dir(self, stage: str) -> str:
        """The stage dir emptied (a killed earlier attempt's files go) and recreated; collective."""
        d = self.dirs[stage]
        if self.rank == 0:
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
        self._barrier()
        return d

    def _save(self, which: str, path: str) -> None:
        """The actor or critic as a torch_dist checkpoint at ``path`` (layout-free; collective)."""
        from megatron.core import dist_checkpointing

        from megatron_s3ac.convert.carried import model_sharded_state_dict

        if self.rank == 0:
            os.makedirs(path)
        self._barrier()
        with self.tr.model_scope(which):
            model = self.tr.actor if which == "actor" else self.tr.critic
            dist_checkpointing.save(model_sharded_state_dict(model), path)  # + carried tensors (vision, MTP)
        self._barrier()

    def _jsonl(self, path: str):
        return open(path, "w") if self.rank == 0 else None

    def _done(self, stage: str) -> Optional[dict]:
        return read_done(self._orig_cfg, stage, self.dirs[stage])

    def _finish(self, stage: str, result: dict, t0: float) -> dict:
        if self.rank == 0:
            write_done(self._orig_cfg, stage, self.dirs[stage], result, time.time() - t0)
        self._barrier()
        return result

    # -- run
    def run(self, after_stage: Optional[Callable[[str, bool], None]] = None) -> dict:
        """Every planned stage in order; returns {stage: {"status": ran|skipped|<reason>, "wall_s", "result"}}
        and writes ``{train.out_dir}/pipeline.json`` (rank 0)."""
        for stage in STAGES:
            if self.plan[stage] != "run":
                if stage == "coverage" and self.plan[stage] == "value_pretrain.coverage_path given":
                    self.results[stage] = {"status": self.plan[stage], "wall_s": 0.0,
                                           "result": {"path": self.cfg.value_pretrain.coverage_path}}
                else:
                    self.results[stage] = {"status": f"not run: {self.plan[stage]}", "wall_s": 0.0, "result": {}}
                self._after_stage_state(stage)
                continue
            t0 = time.time()
            done = self._done(stage)
            if done is not None:
                with self._resident(stage):
                    self._load(stage)
                self.results[stage] = {"status": "skipped", "wall_s": time.time() - t0, "result": done["result"],
                                       "recorded_wall_s": done.get("wall_s")}
                if self.rank == 0:
                    print(f"pipeline: stage {stage} skipped ({self.dirs[stage]}/{DONE} matches)", flush=True)
            else:
                if self.rank == 0:
                    print(f"pipeline: stage {stage} -> {self.dirs[stage]}", flush=True)
                if stage == "rl":
                    self._record_rl_config()
                with self._resident(stage):
                    res = getattr(self, f"_run_{stage}")(t0)
                self.results[stage] = {"status": "ran", "wall_s": time.time() - t0, "result": res}
            self._after_stage_state(stage)
            if after_stage is not None:
                after_stage(stage, self.results[stage]["status"] == "ran")
        if self.rank == 0:
            os.makedirs(self.cfg.train.out_dir, exist_ok=True)
            with open(os.path.join(self.cfg.train.out_dir, "pipeline.json"), "w") as f:
                json.dump({"stages": self.results, "dirs": self.dirs, "fingerprints": self.fingerprints}, f,
                          indent=1, default=str)
        return self.results

    def _resident(self, stage: str):
        """The models on the device for a stage that trains, saves or loads them (trainer.step.engine_side.models_resident:
        with colocated offload they live on the host while the engine is awake). Not for coverage (its engines need
        the memory) nor rl (its steps place the models themselves)."""
        return self.tr.models_resident() if stage not in ("coverage", "rl") else contextlib.nullcontext()

    def _after_stage_state(self, stage: str) -> None:
        """After the warm-up (run or not): the critic's backbone := the warm-up actor (the value head keeps
        its init), unless model.critic_init gave the critic."""
        tr = self.tr
        if stage == "warmup" and self.plan["warmup"] == "run" and tr.uses_critic and not self.cfg.model.critic_init:
            with self._resident(stage):
                tr.init_critic_from_actor()

    def _load(self, stage: str) -> None:
        """A skipped stage's output into the trainer (collective)."""
        from megatron.core import dist_checkpointing

        from megatron_s3ac.convert.carried import load_model

        tr = self.tr
        if stage == "warmup":
            path = os.path.join(self.dirs["warmup"], "actor")
            with tr.model_scope("actor"):
                load_model(tr.actor, path)
            tr.sync_weights_soon()
        elif stage == "value_pretrain":
            path = os.path.join(self.dirs["value_pretrain"], "critic")
            with tr.model_scope("critic"):
                tr.critic.load_state_dict(dist_checkpointing.load(tr.critic.sharded_state_dict(), path))
        elif stage == "rl":  # the run is complete: its checkpoints / hf exports are in train.out_dir
            self._record_rl_config()

    # -- warmup
    def _run_warmup(self, t0: float) -> dict:
        from megatron_s3ac.trainer.stages.warmup import save_engine_hf, supervised_warmup

        tr, d = self.tr, self._fresh_dir("warmup")
        log_f = self._jsonl(os.path.join(d, "warmup.jsonl"))
        snaps = []

        def log(m):
            if log_f is not None:
                log_f.write(json.dumps(m) + "\n")
                log_f.flush()
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}, flush=True)

        def snapshot(step):  # rank 0, after the weight sync of an evaluation point
            path = os.path.join(d, "policies", f"step_{step}")
            save_engine_hf(tr, path)
            snaps.append(step)
            if len(snaps) == 1:
                faults.in_stage("warmup")  # testing seam: killed with part of the stage written

        info = supervised_warmup(tr, log, snapshot=snapshot)
        self._save("actor", os.path.join(d, "actor"))
        tr.sync_weights()  # the engine holds the final warm-up actor (the loop may end between evaluations)
        before = self._bcast({"greedy": tr.evaluate(), "sampled": tr.evaluate(greedy=False)})
        if log_f is not None:
            log_f.close()
        res = {**info, "before": before, "snapshots": self._bcast(snaps)}
        return self._finish("warmup", res, t0)

    def _bcast(self, obj):
        """Rank 0's ``obj`` (e.g. its evaluation's result) on every rank; the others wait on the trainer's gloo
        group with the run's deadline (trainer.step.rank0), not inside a collective of the default group."""
        return self.tr.rank0.share("pipeline stage (rank 0's result)", obj)

    # -- coverage
    def coverage_policies(self) -> list[str]:
        from megatron_s3ac.trainer.stages.coverage import resolve_policies

        try:
            return resolve_policies(self.cfg, self.dirs["warmup"])
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _run_coverage(self, t0: float) -> dict:
        """Rank 0 rolls the policies out; the other ranks wait for its verdict file (a long generation would outlast
        a collective's timeout), with a deadline. An engine pool of the trainer's holds its GPUs in Ray even asleep,
        so the coverage engines could never be placed: it is closed first and started again after."""
        from megatron_s3ac.trainer.stages.coverage import build_coverage

        tr, d = self.tr, self._fresh_dir("coverage")
        verdict = os.path.join(d, COVERAGE_VERDICT)
        tr.close_weight_sync()  # every rank: the sync sessions of the engines closed below (reopened on next sync)
        res = None
        if self.rank == 0:
            try:
                policies = self.coverage_policies()
                log_f = open(os.path.join(d, "coverage_log.jsonl"), "w")

                def log(st):
                    log_f.write(json.dumps(st) + "\n")
                    log_f.flush()
                    print(f"coverage: {st}", flush=True)

                tr.engine_sleep()  # a colocated engine frees its memory for the coverage engines
                reopen = release_engine(tr)
                try:
                    res = build_coverage(self.cfg, policies, tr.prompts, tr.vocab, tr.score,
                                         os.path.join(d, "coverage.jsonl"), log=log,
                                         after_policy=lambda i: faults.in_stage("coverage"))
                finally:
                    log_f.close()
                if reopen:
                    restore_engine(tr)
            except BaseException as e:
                _write_json(verdict, {"ok": False, "error": f"{type(e).__name__}: {e}"})
                raise
            _write_json(verdict, {"ok": True})
        else:
            self._wait_for_verdict(verdict)
        self._barrier()
        tr.sync_weights()  # wakes the colocated engine, refilled with the actor's weights
        res = self._bcast(res)
        return self._finish("coverage", res, t0)

    def coverage_deadline_s(self) -> float:
        """How long the other ranks wait for rank 0's coverage: ``pipeline.coverage_timeout_s``, else one engine start
        and one generation (``rollout.sglang.timeout_s``) per policy, plus the trainer engine's restart."""
        p = self.cfg.pipeline
        if getattr(p, "coverage_timeout_s", 0):
            return float(p.coverage_timeout_s)
        n = len(p.policies) if p.policies else self.cfg.demo.coverage_checkpoints
        return (n + 1) * (ENGINE_START_S + float(self.cfg.rollout.sglang.timeout_s))

    def _wait_for_verdict(self, path: str, poll_s: float = 2.0) -> None:
        """Poll for rank 0's verdict; raise its error, or TimeoutError past coverage_deadline_s."""
        deadline = time.time() + self.coverage_deadline_s()
        while not os.path.exists(path):
            if time.time() > deadline:
                raise TimeoutError(f"pipeline coverage: rank {self.rank} waited {self.coverage_deadline_s():g} s for "
                                   f"rank 0's coverage ({path} never appeared; pipeline.coverage_timeout_s sets "
                                   f"the limit)")
            time.sleep(min(poll_s, max(0.05, deadline - time.time())))
        with open(path) as f:
            v = json.load(f)
        if not v.get("ok"):
            raise RuntimeError(f"pipeline coverage failed on rank 0: {v.get('error')}")

    # -- value pretraining
    def coverage_path(self) -> str:
        return self.cfg.value_pretrain.coverage_path or os.path.join(self.dirs["coverage"], "coverage.jsonl")

    def _run_value_pretrain(self, t0: float) -> dict:
        from megatron_s3ac.data.prompts import read_coverage
        from megatron_s3ac.trainer.stages.value_pretrain import value_pretrain

        tr, d = self.tr, self._fresh_dir("value_pretrain")
        rows, stats = read_coverage(self.coverage_path())
        if not rows:
            raise ConfigError(f"value pretraining: {self.coverage_path()} holds no valid coverage rows ({stats})")
        log_f = self._jsonl(os.path.join(d, "value_pretrain.jsonl"))
        # value pretraining builds a third model (the frozen-attention critic copy): never beside an awake colocated
        # engine, and the actor, idle, goes to the host (train.offload_idle)
        tr.engine_sleep()
        tr.placement.place({}, off=["actor"])
        res = value_pretrain(tr, rows, log=(lambda m: log_f.write(json.dumps(m) + "\n")) if log_f else None)
        tr.placement.place({}, on=["actor"])
        tr.sync_weights_soon()  # the engine awake again, refilled (colocated offload: as the models leave)
        if log_f is not None:
            log_f.close()
        faults.in_stage("value_pretrain")
        self._save("critic", os.path.join(d, "critic"))
        return self._finish("value_pretrain", {**res, "coverage_rows": stats["rows"],
                                               "coverage_malformed": stats["malformed"]}, t0)

    # -- rl
    def _record_rl_config(self) -> None:
        """The RL stage is `s3ac-train train` started from the stages' outputs: {out_dir}/config.yaml names
        them (model.actor_init / model.critic_init), so `s3ac-train train OUT/config.yaml` re-runs it alone."""
        from megatron_s3ac.config import to_yaml

        cfg = self.cfg
        if self.plan["warmup"] == "run":
            cfg.model.actor_init = os.path.join(self.dirs["warmup"], "actor")
        if self.plan["value_pretrain"] == "run":
            cfg.model.critic_init = os.path.join(self.dirs["value_pretrain"], "critic")
        if self.rank == 0:
            os.makedirs(cfg.train.out_dir, exist_ok=True)
            with open(os.path.join(cfg.train.out_dir, "config.yaml"), "w") as f:
                f.write(to_yaml(cfg))

    def _run_rl(self, t0: float) -> dict:
        from megatron_s3ac.trainer.run.train_loop import train_loop

        tr = self.tr
        train_loop(tr)
        res = {"steps": tr.step_idx}
        if self._bcast("heldout" in (tr.eval_sets or {})):  # the held-out split's final pass rates
            res["after"] = self._bcast({"greedy": tr.evaluate(), "sampled": tr.evaluate(greedy=False)})
        return self._finish("rl", res, t0)


def run_pipeline(cfg: Config, after_stage=None) -> dict:
    """``s3ac-train pipeline``: build the trainer once, run the planned stages, close it."""
    p = Pipeline(cfg)
    try:
        return p.run(after_stage)
    finally:
        p.tr.close()


# ---- a fresh value head in a critic-using run --------------------------------------------------------
def fresh_critic_warning(cfg: Config, command: str = "train") -> Optional[str]:
    """The warning for a critic-using run that would start from a randomly initialised value head
    (paper §3.3, Table 4), or None. ``command``: "train" (never pretrains the critic) or "pipeline"
    (pretrains it unless value pretraining is off or has no coverage source)."""
    from megatron_s3ac.algorithms.registry import get_algo

    try:
        spec = get_algo(cfg.algo.name)
    except KeyError:
        return None
    if not spec.uses_critic or cfg.model.critic_init:
        return None
    if command == "pipeline":
        plan = planned_stages(cfg)
        if plan["value_pretrain"] == "run" and not pipeline_errors(cfg):
            return None
        why = "value_pretrain.enabled=false" if not cfg.value_pretrain.enabled else "no coverage source"
    else:
        why = "`s3ac-train train` never pretrains the value head"
    return (f"algo.name={cfg.algo.name} trains a critic, model.critic_init is not set and {why}: the critic starts "
            f"from a FRESH, randomly initialised value head (the paper's §3.3 / Table 4 failure mode: early "
            f"advantages are noise). Run `s3ac-train pipeline` (coverage data -> value pretraining -> RL) or set "
            f"model.critic_init to a pretrained critic (s3ac-train value-pretrain).")


def banner(msg: str) -> str:
    """A multi-line banner for a warning that must not scroll by unseen."""
    import textwrap

    bar = "!" * 100
    lines = textwrap.wrap(msg, 94)
    return "\n".join([bar, "!! WARNING", *[f"!! {l}" for l in lines], bar])

"""``s3ac-train``: the trainer's command line (run under torchrun; gloo on CPU, nccl on GPU).

    torchrun --nproc-per-node 2 -m megatron_s3ac.trainer.cli train  examples/cpu_demo.yaml train.steps=20
    torchrun --nproc-per-node 2 -m megatron_s3ac.trainer.cli value-pretrain cfg.yaml value_pretrain.coverage_path=cov.jsonl
    torchrun --nproc-per-node 2 -m megatron_s3ac.trainer.cli pipeline examples/cpu_demo.yaml
    torchrun --nproc-per-node 2 -m megatron_s3ac.trainer.cli demo   examples/cpu_demo.yaml
    s3ac-train check cfg.yaml [key=value ...] [--strict] [--for train|pipeline]   # validate + plan memory
    s3ac-train rehearse cfg.yaml [key=value ...] [--report FILE]   # the cluster job's start-up, on CPU

``pipeline`` runs the paper's recipe as resumable stages in one job (trainer.stages.pipeline; docs/trainer.md
"Pipeline"): warm-up (model.tiny) -> coverage data -> value pretraining -> RL; a stage whose DONE.json
matches the config is skipped. ``demo`` = the pipeline + the CPU demo's before/after table.
``train`` with a critic-using algorithm, no ``model.critic_init`` and so a fresh value head prints a
banner on rank 0; ``check`` reports the same as a warning (``--for pipeline``: only when the pipeline
would not pretrain the critic either), which ``--strict`` refuses.

``check`` validates the config, then runs the planner's pre-flight (megatron_s3ac.plan.preflight): every
layout rule (world-size rules when WORLD_SIZE or a ``cluster:`` section gives the world size) and, with a
``cluster:`` section, the memory fit per phase and pipeline stage. Layout errors exit 2; memory misfits are
warnings (stderr), or exit 2 with ``--strict``.

``rehearse`` (not under torchrun; trainer.rehearse, docs/rehearse.md) runs the job's start-up at the cluster's
size on this machine: config checks and the planner at the cluster's world size, the engines' launch (devices per
process, the engine's own argument rules; Ray placing SGLang's pool on fake GPUs), the layer spec on a GPU with
TE, the job shrunk on CPU ranks (``--max-ranks``: degrees reduced to fit) and, for a reduced world, the groups the
reduction shrank at their real sizes (``--max-group-ranks``, default 32). Exit 1 naming the first defect, 2 for a
config it cannot read.

``train`` / ``value-pretrain`` / ``demo`` on a machine with CUDA first check the installed GPU stack
(``megatron_s3ac.env.check_environment(require_gpu=True)``): a known-bad combination (e.g. an sglang
that pins another torch) exits 2 naming both versions, before any process group or model is built;
rank 0 prints the report.
"""
from __future__ import annotations

import os
import sys


_USAGE = {
    "train": ("s3ac-train train CONFIG.yaml [key=value ...]   (under torchrun)",
              "RL training (trainer.step.trainer / trainer.run.train_loop): resumes from the latest complete checkpoint in "
              "train.out_dir unless train.resume=false."),
    "value-pretrain": ("s3ac-train value-pretrain CONFIG.yaml value_pretrain.coverage_path=cov.jsonl [key=value ...]",
                       "pretrain the critic on a coverage jsonl; saves <out_dir>/critic_pretrained (torch_dist) "
                       "for model.critic_init."),
    "pipeline": ("s3ac-train pipeline CONFIG.yaml [key=value ...]   (under torchrun)",
                 "the paper's recipe as resumable stages: warm-up (model.tiny) -> coverage data -> value "
                 "pretraining -> RL; a stage whose DONE.json matches the config is skipped."),
    "demo": ("s3ac-train demo CONFIG.yaml [key=value ...]   (under torchrun)",
             "the pipeline, then the CPU demo's before/after pass-rate table."),
    "check": ("s3ac-train check CONFIG.yaml [key=value ...] [--strict] [--for train|pipeline]",
              "validate the config and run the planner's pre-flight (layout rules; memory fit with a cluster: "
              "section). Layout errors exit 2; memory misfits are warnings, or exit 2 with --strict."),
    "rehearse": ("s3ac-train rehearse CONFIG.yaml [key=value ...] [--report FILE] [--max-ranks N] "
                 "[--max-group-ranks N] [--no-run]   "
                 "(not under torchrun)",
                 "the cluster job's start-up rehearsed on CPU at the cluster's size (docs/rehearse.md): exit 1 "
                 "naming the first defect; TRAINER_GPUS_PER_NODE as launch.sh takes it."),
}
_HELP = ("-h", "--help")


def _usage(cmd: str) -> str:
    line, what = _USAGE[cmd]
    return f"usage: {line}\n\n{what}\nConfig keys: docs/trainer.md; overrides are OmegaConf dotted key=value."


def _parse(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0)
    cmd, rest = argv[0], argv[1:]
    path = rest[0] if rest and "=" not in rest[0] else None
    overrides = rest[1:] if path else rest
    return cmd, path, overrides


def main(argv=None) -> int:
    from megatron_s3ac.console import silence_known_warnings

    silence_known_warnings()  # before anything imports megatron: known library warnings, each justified there
    from megatron_s3ac.config import ConfigError, load_config, to_yaml

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) > 1 and args[0] in _USAGE and any(a in _HELP for a in args[1:]):
        print(_usage(args[0]))  # a subcommand's --help: its usage, never "config file not found: --help"
        return 0
    strict = "--strict" in args
    args = [a for a in args if a != "--strict"]
    check_for = "train"
    if "--for" in args:
        i = args.index("--for")
        check_for = args[i + 1] if i + 1 < len(args) else ""
        del args[i:i + 2]
        if check_for not in ("train", "pipeline"):
            print(f"s3ac-train check: --for {check_for!r} must be train or pipeline", file=sys.stderr)
            return 2
    report, max_ranks, max_group_ranks, run_job = None, 8, None, "--no-run" not in args
    args = [a for a in args if a != "--no-run"]
    for flag in ("--report", "--max-ranks", "--max-group-ranks"):
        if flag in args:
            i = args.index(flag)
            if i + 1 >= len(args):
                print(f"s3ac-train: {flag} needs a value", file=sys.stderr)
                return 2
            value = args[i + 1]
            del args[i:i + 2]
            if flag == "--report":
                report = value
            elif not value.isdigit() or int(value) < 1:
                print(f"s3ac-train: {flag} {value!r} must be a positive integer", file=sys.stderr)
                return 2
            elif flag == "--max-ranks":
                max_ranks = int(value)
            else:
                max_group_ranks = int(value)
    cmd, path, overrides = _parse(args)
    if cmd not in _USAGE:
        print(f"unknown command {cmd!r}; use {' | '.join(_USAGE)}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(path, overrides, check=cmd != "rehearse")  # a rehearsal's files live on the cluster
        if cmd == "rehearse":
            from megatron_s3ac.trainer.rehearse import rehearse

            return rehearse(cfg, report=report, max_ranks=max_ranks, run=run_job, max_group_ranks=max_group_ranks)
        if cmd in ("pipeline", "demo"):
            from megatron_s3ac.trainer.stages.pipeline import pipeline_errors

            errs = pipeline_errors(cfg)
            if errs:
                raise ConfigError("invalid config:\n  - " + "\n  - ".join(errs))
        from megatron_s3ac.trainer.inputs import check_inputs

        check_inputs(cfg, cmd)  # the input files, before any process group or output: every rank exits 2 alike
        if cmd == "check":
            from megatron_s3ac.config import validate

            world = int(os.environ.get("WORLD_SIZE", "0")) or None
            validate(cfg, world)
            from megatron_s3ac.plan.preflight import preflight

            rep = preflight(cfg, world)
            from megatron_s3ac.trainer.stages.pipeline import fresh_critic_warning, pipeline_errors

            if check_for == "pipeline":
                rep.errors += pipeline_errors(cfg)
            fresh = fresh_critic_warning(cfg, check_for)
            if fresh:
                rep.warnings.append(fresh)
            for msg in rep.messages():
                print(f"s3ac-train check: {msg}", file=sys.stderr)
            if rep.errors or (strict and rep.warnings):
                return 2
            print(to_yaml(cfg))
            return 0
    except ConfigError as e:
        print(f"s3ac-train: {e}", file=sys.stderr)
        return 2
    err = _check_gpu_environment()
    if err is not None:
        print(f"s3ac-train: {err}", file=sys.stderr)
        return 2
    if cmd == "train" and not cfg.train.resume:
        from megatron_s3ac.trainer.run.checkpoint import latest_checkpoint

        old = latest_checkpoint(cfg.train.out_dir)
        if old is not None:  # a fresh run would interleave its checkpoints with the old run's
            print(f"s3ac-train: train.resume=false but {old} exists from an earlier run; choose another "
                  f"train.out_dir or delete {os.path.join(cfg.train.out_dir, 'checkpoints')}", file=sys.stderr)
            return 2
    os.makedirs(cfg.train.out_dir, exist_ok=True)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(cfg.train.out_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))
    if cmd == "demo":
        from megatron_s3ac.trainer.stages.demo import run_demo

        run_demo(cfg)
    elif cmd == "pipeline":
        from megatron_s3ac.trainer.stages.pipeline import run_pipeline

        run_pipeline(cfg)
    elif cmd == "train":
        from megatron_s3ac.trainer.step.trainer import Trainer
        from megatron_s3ac.trainer.stages.pipeline import banner, fresh_critic_warning
        from megatron_s3ac.trainer.run.train_loop import train_loop

        fresh = fresh_critic_warning(cfg, "train")
        if fresh and int(os.environ.get("RANK", "0")) == 0:  # before the (long) build: seen at once
            print(banner(fresh), file=sys.stderr, flush=True)
        tr = Trainer(cfg)
        try:
            train_loop(tr)
        finally:
            tr.close()
    else:
        _value_pretrain_cmd(cfg)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _check_gpu_environment():
    """On a CUDA machine: the environment check's error message, or None (rank 0 prints the report).
    Not on CPU: the CPU stack (gloo, no TE / SGLang) is what the tests run and needs no GPU pins."""
    import torch

    if not torch.cuda.is_available():
        return None
    from megatron_s3ac import env as s3ac_env  # module attribute: tests inject a failing check

    try:
        report = s3ac_env.check_environment(require_gpu=True)
    except s3ac_env.IncompatibleEnvironment as e:
        return str(e)
    if int(os.environ.get("RANK", "0")) == 0:
        print(report.format(), flush=True)
    return None


def _value_pretrain_cmd(cfg) -> None:
    """Pretrain the critic on a coverage jsonl; save it (torch_dist) for ``model.critic_init``."""
    import json

    from megatron.core import dist_checkpointing

    from megatron_s3ac.data.prompts import read_coverage
    from megatron_s3ac.trainer.step.trainer import Trainer
    from megatron_s3ac.trainer.stages.value_pretrain import value_pretrain

    if not cfg.value_pretrain.coverage_path:
        raise SystemExit("value-pretrain needs value_pretrain.coverage_path")
    tr = Trainer(cfg)
    rows, stats = read_coverage(cfg.value_pretrain.coverage_path)
    f = open(os.path.join(cfg.train.out_dir, "value_pretrain.jsonl"), "w") if tr.rank == 0 else None
    summary = value_pretrain(tr, rows, log=(lambda m: f.write(json.dumps(m) + "\n")) if f else None)
    out = os.path.join(cfg.train.out_dir, "critic_pretrained")
    if tr.rank == 0:
        os.makedirs(out, exist_ok=True)
        print({**stats, **summary})
    import torch.distributed as dist

    dist.barrier()
    with tr.model_scope("critic"):
        dist_checkpointing.save(tr.critic.sharded_state_dict(), out)


if __name__ == "__main__":
    sys.exit(main())

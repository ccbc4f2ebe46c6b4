"""``s3ac-train rehearse CONFIG``: a cluster job's start-up rehearsed on this CPU machine (docs/rehearse.md).

The user's own config, at the cluster's size (``cluster.gpus`` / ``gpus_per_node``; the trainer's GPUs per node as
launch.sh splits them, ``TRAINER_GPUS_PER_NODE``), through the code the job itself runs, stopped where a GPU process
would start. Phases, each a function of the ``Rehearsal`` below, each adding the defects it finds:

* ``config``: the config checks and the planner's pre-flight at the cluster's world size (layout rules, memory fit);
* ``engines``: the trainer's own engine factory (``build.build_engine``) started by the engine kind's launch plan
  (``rollout.rehearsal``: vLLM's servers up to ``Popen``, SGLang's pool really placed by Ray on fake GPUs), then
  who uses which GPU (every process has its devices; no two on one; separate placement disjoint from the
  trainer's ranks) and the engine's own rules on the arguments it is started with;
* ``kernels``: the model's layer spec as it is built on a GPU with Transformer Engine, against the planner's
  assumption (TE's kernels: grouped GEMM, fused attention, CP ring).
* ``run``: the job shrunk, through its stages on CPU ranks under the collective and residency audits
  (trainer/rehearse_run.py).

What it cannot see: the weights (the served directory is the model's real config.json beside placeholder weights
and a tokenizer; nothing reads weights before a process starts), the NCCL / CUDA calls themselves, engines other
than on rank 0's node's first engine slots (every node is alike), and of a step's memory only the model states
(docs/rehearse.md "What a rehearsal cannot see").
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
from typing import Callable, Optional

from megatron_s3ac.config import Config, ConfigError


@dataclasses.dataclass
class Phase:
    name: str
    ran: list = dataclasses.field(default_factory=list)  # one line per thing checked
    defects: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    tracebacks: list = dataclasses.field(default_factory=list)  # in --report only
    # run: {phase, model, kind, measured, planned, ratio[, where]} per audited phase (trainer.rehearse_run)
    residency: list = dataclasses.field(default_factory=list)


class RehearsalInputError(ConfigError):
    """The config cannot be rehearsed (says why, naming the key)."""


LAUNCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "examples", "paper", "launch.sh")
_STUB = 'echo "$(basename "$0") $* CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}" >> "$S3AC_REHEARSE_LOG"\n'


def launch_split(nodes: int, gpus_per_node: int, script: str) -> tuple[int, tuple]:
    """(torchrun's ranks per node, the GPUs ``ray start`` is given) as the launch script itself computes them on node
    0: the script runs with ``ray`` / ``torchrun`` replaced by recorders (TRAINER_GPUS_PER_NODE from the
    environment, as on the cluster)."""
    import re
    import subprocess

    with tempfile.TemporaryDirectory(prefix="s3ac-launch-") as d:
        for name in ("ray", "torchrun"):
            with open(os.path.join(d, name), "w") as f:
                f.write("#!/usr/bin/env bash\n" + _STUB)
            os.chmod(os.path.join(d, name), 0o755)
        log = os.path.join(d, "log")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RAY_", "CUDA_VISIBLE"))}
        env.update(PATH=f"{d}:{os.environ['PATH']}", S3AC_REHEARSE_LOG=log, NNODES=str(nodes), NODE_RANK="0",
                   MASTER_ADDR="127.0.0.1", GPUS_PER_NODE=str(gpus_per_node))
        res = subprocess.run(["bash", script, "train", "rehearsal.yaml"], env=env, cwd=d, capture_output=True,
                             text=True, timeout=60)
        lines = open(log).read().splitlines() if os.path.exists(log) else []
    ray = next((x for x in lines if x.startswith("ray start")), None)
    run = next((x for x in lines if x.startswith("torchrun")), None)
    if res.returncode or ray is None or run is None:
        raise RehearsalInputError(f"{script} did not reach ray start and torchrun (exit {res.returncode}): "
                                  f"{res.stderr.strip()[-400:]}")
    trainer = int(re.search(r"--nproc-per-node (\d+)", run).group(1))
    ray_n = int(re.search(r"--num-gpus (\d+)", ray).group(1))
    visible = ray.rsplit("CUDA_VISIBLE_DEVICES=", 1)[1]
    gpus = tuple(range(gpus_per_node)) if visible == "unset" else tuple(int(x) for x in visible.split(",") if x)
    return trainer, gpus[:ray_n]


def cluster_shape(cfg: Config, script: Optional[str] = None):
    """The job's ``ClusterShape``: ``cluster:`` and the launch script's split of each node (TRAINER_GPUS_PER_NODE)."""
    from megatron_s3ac.rollout.rehearsal import ClusterShape
    from megatron_s3ac.config import Placement

    c = cfg.cluster
    if not c.gpus:
        raise RehearsalInputError("cluster.gpus: not set; a rehearsal needs the cluster's size (cluster.gpus, "
                                  "cluster.gpus_per_node)")
    per_node = int(c.gpus_per_node or 8)
    if c.gpus % per_node:
        raise RehearsalInputError(f"cluster.gpus: {c.gpus} is not a whole number of nodes of {per_node} GPUs")
    nodes, placement = c.gpus // per_node, Placement(cfg.rollout.placement).value
    trainer, ray_gpus = launch_split(nodes, per_node, script or LAUNCH)
    return ClusterShape(nodes, per_node, trainer, placement, ray_gpus)


def served_dir(cfg: Config, out: str) -> str:
    """The engines' view of the served HF directory: the model's real config.json, a placeholder weight file and a
    character tokenizer (no process reads weights before it starts)."""
    import torch
    from safetensors.torch import save_file

    from megatron_s3ac.models.tiny_models import char_tokenizer

    src = cfg.model.hf_config
    if not src or not os.path.exists(src):
        raise RehearsalInputError(f"model.hf_config: {src} does not exist here; point it at the model's config.json "
                                  f"or its directory (e.g. model.hf_config=examples/hf_configs/<model>)")
    path = os.path.join(src, "config.json") if os.path.isdir(src) else src
    os.makedirs(out, exist_ok=True)
    shutil.copy(path, os.path.join(out, "config.json"))
    save_file({"rehearsal.placeholder": torch.zeros(1)}, os.path.join(out, "model.safetensors"))
    char_tokenizer().save_pretrained(out)
    return out


class Rehearsal:
    """One rehearsal of ``cfg``; ``run()`` -> the phases in order (a phase's exception is its defect)."""

    def __init__(self, cfg: Config, log: Callable[[str], None] = print, max_ranks: int = 8, run: bool = True):
        self.cfg, self.log, self.max_ranks, self.run_job = cfg, log, max_ranks, run
        self.shape = cluster_shape(cfg)
        self.world = self.shape.nodes * self.shape.trainer_per_node
        self.phases: list[Phase] = []

    def run(self) -> list[Phase]:
        with tempfile.TemporaryDirectory(prefix="s3ac-rehearse-") as tmp:
            self.tmp = tmp
            phases = [("config", self.config), ("engines", self.engines), ("kernels", self.kernels)]
            for name, fn in phases + ([("run", self.run_shrunk)] if self.run_job else []):
                p = Phase(name)
                t0 = time.monotonic()
                try:
                    fn(p)
                except RehearsalInputError:
                    raise
                except Exception as e:  # noqa: BLE001 - the phase failed where the job would: that is the finding
                    p.defects.append(f"{type(e).__name__}: {e}")
                p.seconds = time.monotonic() - t0
                self.phases.append(p)
                self.log(format_phase(p))
        return self.phases

    def config(self, p: Phase) -> None:
        from megatron_s3ac.plan.preflight import preflight
        from megatron_s3ac.config import validate
        from megatron_s3ac.config.enums import paths_elsewhere

        s = self.shape
        p.ran.append(f"{s.nodes} nodes x {s.gpus_per_node} GPUs, {s.trainer_per_node} trainer ranks per node "
                     f"(world {self.world}), rollout.placement: {s.placement}")
        self.cfg.model.engine_hf_dir = served_dir(self.cfg, os.path.join(self.tmp, "served"))
        try:
            with paths_elsewhere():  # data, checkpoints, benchmarks are the cluster's files
                validate(self.cfg, self.world)
        except ConfigError as e:
            p.defects.append(str(e))
            return
        p.ran.append("config checks at the cluster's world size (its files not looked for here): pass")
        rep = preflight(self.cfg, self.world)
        p.defects += rep.errors
        p.ran += [f"planner: {w}" for w in rep.warnings] or ["planner pre-flight: fits"]

    def engines(self, p: Phase) -> None:
        from megatron_s3ac.rollout import factory as factory_mod
        from megatron_s3ac.rollout.rehearsal import device_defects, engine_rules, launch_plan
        from megatron_s3ac.trainer.step import build
        from megatron_s3ac.config import model_info_for

        made = {}
        real = factory_mod.make_engine_factory

        def capture(*a, **kw):  # the factory the trainer builds; no engine is made from it here
            made["factory"] = real(*a, **kw)
            raise _FactoryBuilt

        with _patched(factory_mod, "make_engine_factory", capture):
            try:
                build.build_engine(self.cfg, model_info_for(self.cfg))
            except _FactoryBuilt:
                pass
        f = made["factory"]
        procs = launch_plan(f, self.shape)
        for proc in procs:
            p.ran.append(f"{proc.name}: node {proc.node} GPUs {proc.devices} ({proc.how})")
        p.defects += device_defects(procs, self.shape)
        p.defects += engine_rules(f.kind, procs, self.shape)

    def run_shrunk(self, p: Phase) -> None:
        import copy

        from megatron_s3ac.trainer.rehearse_run import run_phase

        run_phase(copy.deepcopy(self.cfg), os.path.join(self.tmp, "job"), self.max_ranks, p)

    def kernels(self, p: Phase) -> None:
        from megatron_s3ac.models.actor_critic import build_transformer_config
        from megatron_s3ac.models.registry import get_arch
        from megatron_s3ac.config import layout_of, model_info_for

        info = model_info_for(self.cfg)
        layout = layout_of(self.cfg.actor_layout)
        built = _te_spec_built(lambda: get_arch(info.model_type).block_spec(
            build_transformer_config(info, layout), info, None, pp_rank=0))
        if built:
            p.ran.append(f"{info.model_type}: on a GPU with Transformer Engine the layers use TE's modules "
                         f"({', '.join(sorted(built))}), as the planner costs them")
        else:
            p.defects.append(f"{info.model_type}: on a GPU with Transformer Engine the layers are built from torch "
                             f"modules (a Python loop over local experts, SDPA, all-gather CP) while the planner "
                             f"costs TE's kernels (models/specs.py have_transformer_engine)")


class _FactoryBuilt(Exception):
    pass


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _te_spec_built(build) -> set:
    """Which TE spec builders ``build()`` calls with Transformer Engine present (TE cannot be imported here: its
    builders are recorded, not run)."""
    from megatron.core.models.gpt import gpt_layer_specs

    import megatron_s3ac.models.qwen3_5_spec as qwen3_5_spec
    import megatron_s3ac.models.specs as specs

    built: set = set()

    def rec(name):
        def f(*a, **k):
            built.add(name)
            raise _SpecChosen

        return f

    with contextlib.ExitStack() as st:
        st.enter_context(_patched(specs, "have_transformer_engine", lambda: True))
        st.enter_context(_patched(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec",
                                  rec("get_gpt_layer_with_transformer_engine_spec")))
        st.enter_context(_patched(qwen3_5_spec, "_te_block_spec", rec("te hybrid block (qwen3_5_spec._te_block_spec)")))
        try:
            build()
        except _SpecChosen:
            pass
    return built


class _SpecChosen(Exception):
    pass


def format_phase(p: Phase) -> str:
    head = f"[{'FAIL' if p.defects else 'ok'}] {p.name} ({p.seconds:.1f} s)"
    return "\n".join([head] + [f"    {r}" for r in p.ran] + [f"    DEFECT: {d}" for d in p.defects])


def rehearse(cfg: Config, log: Callable[[str], None] = print, report: Optional[str] = None, max_ranks: int = 8,
             run: bool = True) -> int:
    """Run the rehearsal; 0 when no phase found a defect, else 1 (the first defect printed last). ``run``: the
    shrunk job too (``--no-run``: the start-up phases only, seconds)."""
    phases = Rehearsal(cfg, log, max_ranks, run).run()
    if report:
        with open(report, "w") as f:
            json.dump([dataclasses.asdict(p) for p in phases], f, indent=1)
    first = next((f"{p.name}: {d}" for p in phases for d in p.defects), None)
    log(f"rehearsal: {'first defect: ' + first if first else 'no defect found'}")
    return 1 if first else 0

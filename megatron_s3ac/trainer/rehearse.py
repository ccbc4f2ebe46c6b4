"""``s3ac-train rehearse CONFIG``: a cluster job's start-up rehearsed on this CPU machine (docs/rehearse.md).

The user's own config, at the cluster's size (``cluster.gpus`` / ``gpus_per_node``; the trainer's GPUs per node as
launch.sh splits them, ``TRAINER_GPUS_PER_NODE``), through the code the job itself runs, stopped where a GPU process
would start. Phases, each a function of the ``Rehearsal`` below, each adding the defects it finds:

* ``config``: the config checks and the planner's pre-flight at the cluster's world size (layout rules, memory fit);
* ``engines``: launch.sh run on every node rank and checked per node (``node_defects``), then the trainer's own
  engine factory (``build.build_engine``) started by the engine kind's launch plan
  (``rollout.rehearsal``: vLLM's servers up to ``Popen``, SGLang's pool really placed by Ray on fake GPUs), then
  who uses which GPU (every process has its devices; no two on one; separate placement disjoint from the
  trainer's ranks) and the engine's own rules on the arguments it is started with;
* ``kernels``: the model's layer spec as it is built on a GPU with Transformer Engine, against the planner's
  assumption (TE's kernels: grouped GEMM, fused attention, CP ring).
* ``run``: the job shrunk, through its stages on CPU ranks under the collective and residency audits
  (trainer/rehearse_run.py).
* ``groups``: for a world the run phase had to reduce, the groups it ran smaller than the cluster's (the
  expert-parallel, expert-data-parallel, data-parallel groups...) at their real sizes: one pipeline stage's ranks
  (or the smallest world holding the group) running the model's MoE layer, megatron's DDP reduce and one optimizer
  step under the collective audit, against the planner's per-rank share at the real degree
  (trainer/rehearse_groups.py).

What it cannot see: the weights (the served directory is the model's real config.json beside placeholder weights
and a tokenizer; nothing reads weights before a process starts), the NCCL / CUDA calls themselves, a real
rendezvous across hosts (the nodes' launches are recorded, SGLang's Ray nodes are fakes on this machine, at most
4), and of a step's memory only the model states
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


# launch.sh per node: all of them up to this many, else node 0, node 1 and the last (node 1..N-2 run the same
# non-head branch with only NODE_RANK changing)
ALL_NODES_UP_TO = 32
_MASTER, _RAY_PORT = "10.0.0.1", "6379"  # what every node is given, as on a cluster without Slurm


@dataclasses.dataclass(frozen=True)
class NodeLaunch:
    """What launch.sh ran on node ``rank``: its ``ray start`` and ``torchrun`` lines (recorded), or why not."""

    rank: int
    ray: Optional[str]
    torchrun: Optional[str]
    error: str = ""

    def flag(self, line: Optional[str], name: str) -> Optional[str]:
        import re

        m = re.search(rf"(?:^| ){re.escape(name)}(?: |=)(\S+)", line or "")
        return m.group(1).strip('"') if m else None

    @property
    def trainer(self) -> int:
        return int(self.flag(self.torchrun, "--nproc-per-node") or 0)

    def ray_gpus(self, gpus_per_node: int) -> tuple:
        """The physical GPUs Ray hands out on this node: ray start's CUDA_VISIBLE_DEVICES, its first --num-gpus."""
        visible = (self.ray or "").rsplit("CUDA_VISIBLE_DEVICES=", 1)[-1]
        gpus = tuple(range(gpus_per_node)) if visible == "unset" else tuple(int(x) for x in visible.split(",") if x)
        return gpus[:int(self.flag(self.ray, "--num-gpus") or 0)]


def node_ranks(nodes: int) -> list[int]:
    return list(range(nodes)) if nodes <= ALL_NODES_UP_TO else [0, 1, nodes - 1]


def launch_nodes(nodes: int, gpus_per_node: int, script: str) -> list[NodeLaunch]:
    """launch.sh itself on each node rank (``node_ranks``) with ``ray`` / ``torchrun`` replaced by recorders: the
    same NNODES, MASTER_ADDR and GPUS_PER_NODE on every node, NODE_RANK its own, TRAINER_GPUS_PER_NODE from the
    environment (as on the cluster). Cheap: a shell per node."""
    import subprocess

    out = []
    with tempfile.TemporaryDirectory(prefix="s3ac-launch-") as d:
        for name in ("ray", "torchrun"):
            with open(os.path.join(d, name), "w") as f:
                f.write("#!/usr/bin/env bash\n" + _STUB)
            os.chmod(os.path.join(d, name), 0o755)
        for rank in node_ranks(nodes):
            log = os.path.join(d, f"log{rank}")
            env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RAY_", "CUDA_VISIBLE"))}
            env.update(PATH=f"{d}:{os.environ['PATH']}", S3AC_REHEARSE_LOG=log, NNODES=str(nodes),
                       NODE_RANK=str(rank), MASTER_ADDR=_MASTER, RAY_PORT=_RAY_PORT, GPUS_PER_NODE=str(gpus_per_node),
                       RAY_JOIN_TIMEOUT="0")
            res = subprocess.run(["bash", script, "train", "rehearsal.yaml"], env=env, cwd=d, capture_output=True,
                                 text=True, timeout=60)
            lines = open(log).read().splitlines() if os.path.exists(log) else []
            ray = next((x for x in lines if x.startswith("ray start")), None)
            run = next((x for x in lines if x.startswith("torchrun")), None)
            err = "" if not res.returncode and ray and run else (
                f"{script} did not reach ray start and torchrun (exit {res.returncode}): {res.stderr.strip()[-400:]}")
            out.append(NodeLaunch(rank, ray, run, err))
    return out


def node_defects(launches: list[NodeLaunch], nodes: int, gpus_per_node: int, placement: str) -> list[str]:
    """Each node's launch against the job: node 0 starts the Ray head, the others join it at node 0's address;
    every torchrun has --node-rank = its node, the same --nnodes (the job's) and rendezvous endpoint; a node's Ray
    GPUs are its own and, separate, disjoint from its trainer ranks' (cuda:LOCAL_RANK; colocated: among them);
    every node runs as many trainer ranks as node 0 (LOCAL_WORLD_SIZE places vLLM's servers; the world is
    nodes x that). One line per defect, naming the node."""
    out = []
    head = launches[0]
    rdzv = head.flag(head.torchrun, "--rdzv-endpoint")
    head_port = head.flag(head.ray, "--port") or _RAY_PORT
    for n in launches:
        where = f"node {n.rank} of {nodes}"
        if n.error:
            out.append(f"{where}: {n.error}")
            continue
        is_head = " --head" in f" {n.ray}"
        addr = n.flag(n.ray, "--address")
        if n.rank == 0 and not is_head:
            out.append(f"{where}: `{n.ray.split(' CUDA_VISIBLE')[0]}` does not start the Ray head (ray start --head)")
        if n.rank > 0 and (is_head or addr != f"{_MASTER}:{head_port}"):
            out.append(f"{where}: `{n.ray.split(' CUDA_VISIBLE')[0]}` does not join the head's Ray at "
                       f"{_MASTER}:{head_port} (ray start --address; MASTER_ADDR={_MASTER} on every node)")
        rank, nn, ep = (n.flag(n.torchrun, k) for k in ("--node-rank", "--nnodes", "--rdzv-endpoint"))
        if rank != str(n.rank):
            out.append(f"{where}: torchrun --node-rank {rank} (NODE_RANK={n.rank}): two nodes' ranks collide")
        if nn != str(nodes):
            out.append(f"{where}: torchrun --nnodes {nn}, the job has {nodes} nodes")
        if ep != rdzv:
            out.append(f"{where}: torchrun --rdzv-endpoint {ep}, node 0's is {rdzv}: the nodes do not meet")
        if n.trainer != head.trainer:
            out.append(f"{where}: torchrun --nproc-per-node {n.trainer}, node 0's is {head.trainer}")
        ray_gpus, trainer = n.ray_gpus(gpus_per_node), set(range(n.trainer))
        if any(not 0 <= g < gpus_per_node for g in ray_gpus):
            out.append(f"{where}: Ray's GPUs {list(ray_gpus)} are not all among the node's 0..{gpus_per_node - 1}")
        both = sorted(trainer & set(ray_gpus))
        if placement == "separate" and both:
            out.append(f"{where}: Ray's GPUs {list(ray_gpus)} (ray start's CUDA_VISIBLE_DEVICES / --num-gpus) include "
                       f"trainer local ranks {both}'s GPUs (torchrun --nproc-per-node {n.trainer}: cuda:LOCAL_RANK); "
                       f"rollout.placement: separate puts the engines there")
        if placement == "colocated" and set(ray_gpus) - trainer:
            out.append(f"{where}: Ray's GPUs {list(ray_gpus)} include GPUs no trainer rank uses "
                       f"(rollout.placement: colocated shares each trainer rank's GPU)")
    return out


def cluster_shape(cfg: Config, script: Optional[str] = None):
    """The job's ``ClusterShape``: ``cluster:`` and the launch script's split of each node (TRAINER_GPUS_PER_NODE);
    its ``launches``: what launch.sh ran on each node rank (``launch_nodes``), checked in the engines phase."""
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
    launches = launch_nodes(nodes, per_node, script or LAUNCH)
    if launches[0].error:  # node 0 not even starting is the input (TRAINER_GPUS_PER_NODE, the script), not a node
        raise RehearsalInputError(launches[0].error)
    ok = [n for n in launches if not n.error]
    shape = ClusterShape(nodes, per_node, launches[0].trainer, placement, launches[0].ray_gpus(per_node),
                         tuple((n.rank, (n.trainer, n.ray_gpus(per_node))) for n in ok))
    return shape, launches


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

    def __init__(self, cfg: Config, log: Callable[[str], None] = print, max_ranks: int = 8, run: bool = True,
                 max_group_ranks: Optional[int] = None):
        from megatron_s3ac.trainer.rehearse_groups import MAX_GROUP_RANKS

        self.cfg, self.log, self.max_ranks, self.run_job = cfg, log, max_ranks, run
        self.max_group_ranks = MAX_GROUP_RANKS if max_group_ranks is None else max_group_ranks
        self.shape, self.launches = cluster_shape(cfg)
        self.world = self.shape.nodes * self.shape.trainer_per_node  # node_defects: every node runs node 0's count
        self.phases: list[Phase] = []

    def run(self) -> list[Phase]:
        with tempfile.TemporaryDirectory(prefix="s3ac-rehearse-") as tmp:
            self.tmp = tmp
            phases = [("config", self.config), ("engines", self.engines), ("kernels", self.kernels)]
            ranks = [("run", self.run_shrunk), ("groups", self.groups)] if self.run_job else []
            for name, fn in phases + ranks:
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
        self.nodes(p)
        f = made["factory"]
        procs = launch_plan(f, self.shape)
        for proc in procs:
            if proc.rehearsed:
                p.ran.append(f"{proc.name}: node {proc.node} GPUs {proc.devices} ({proc.how})")
            else:
                p.ran.append(f"{proc.name}: not rehearsed ({proc.how})")
        p.defects += device_defects(procs, self.shape)
        p.defects += engine_rules(f.kind, procs, self.shape)

    def nodes(self, p: Phase) -> None:
        """launch.sh on every node rank (``node_defects``) and the world its ranks add up to against the layouts."""
        import math

        from megatron_s3ac.config import layout_of

        s, runs = self.shape, self.launches
        ranks = [n.rank for n in runs]
        which = "every node" if len(ranks) == s.nodes else f"nodes {ranks} of {s.nodes} (the others as node 1)"
        defects = node_defects(runs, s.nodes, s.gpus_per_node, s.placement)
        for n in runs:
            if not n.error:
                ray = "--head" if " --head" in f" {n.ray}" else f"--address {n.flag(n.ray, '--address')}"
                p.ran.append(f"launch.sh node {n.rank}: ray start {ray} on GPUs {list(n.ray_gpus(s.gpus_per_node))}; "
                             f"torchrun --node-rank {n.flag(n.torchrun, '--node-rank')} --nnodes "
                             f"{n.flag(n.torchrun, '--nnodes')}, {n.trainer} ranks (cuda:0..{n.trainer - 1})")
        total = sum(n.trainer for n in runs) + (s.nodes - len(runs)) * (runs[1].trainer if len(runs) > 1 else 0)
        layouts = [layout_of(self.cfg.actor_layout)] + ([layout_of(self.cfg.critic_layout)]
                                                        if self.cfg.critic_layout else [])
        need = math.lcm(*[x for lay in layouts for x in (lay.tp * lay.pp * lay.cp, lay.etp * lay.ep * lay.pp)])
        if total % need:
            defects.append(f"the nodes' torchrun ranks add up to {total}, not a multiple of {need} (the layouts' "
                           f"TP x PP x CP and ETP x EP x PP)")
        elif not defects:
            p.ran.append(f"launch.sh on {which}: the head starts Ray and the others join it, node ranks and "
                         f"rendezvous agree, Ray's GPUs {'apart from' if s.placement == 'separate' else 'among'} "
                         f"the trainer's on each node; world {total} ({need} divides it)")
        p.defects += defects

    def run_shrunk(self, p: Phase) -> None:
        import copy

        from megatron_s3ac.trainer.rehearse_run import run_phase

        run_phase(copy.deepcopy(self.cfg), os.path.join(self.tmp, "job"), self.max_ranks, p)

    def groups(self, p: Phase) -> None:
        import copy

        from megatron_s3ac.trainer.rehearse_groups import groups_phase

        groups_phase(copy.deepcopy(self.cfg), os.path.join(self.tmp, "groups"), self.world, self.max_ranks,
                     self.max_group_ranks, p)

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
             run: bool = True, max_group_ranks: Optional[int] = None) -> int:
    """Run the rehearsal; 0 when no phase found a defect, else 1 (the first defect printed last). ``run``: the
    shrunk job and the groups phase too (``--no-run``: the start-up phases only, seconds); ``max_group_ranks``: the
    most ranks one world of the groups phase starts (None: ``rehearse_groups.MAX_GROUP_RANKS``)."""
    phases = Rehearsal(cfg, log, max_ranks, run, max_group_ranks).run()
    if report:
        with open(report, "w") as f:
            json.dump([dataclasses.asdict(p) for p in phases], f, indent=1)
    first = next((f"{p.name}: {d}" for p in phases for d in p.defects), None)
    log(f"rehearsal: {'first defect: ' + first if first else 'no defect found'}")
    return 1 if first else 0

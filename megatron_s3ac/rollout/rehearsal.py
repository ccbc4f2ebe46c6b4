"""What a rollout engine would be started with on the cluster, found on CPU: the rehearsal's engine side.

Each engine kind registers how to find its launch plan (``register_launch_plan(kind, "module:function")``, in its
own folder's ``rehearsal.py``), so ``s3ac-train rehearse`` (trainer/rehearse.py) never branches on an engine's name.
A launch plan function takes the engine factory the trainer itself built (``trainer.step.build.build_engine``) and the
cluster's ``ClusterShape``, runs the engine's own start-up code up to the point where a process would be started on
a GPU, and returns one ``EngineProcess`` per engine: the physical GPUs its workers use on its node (in worker
order) and the arguments it is started with. ``engine_rules`` are each kind's checks of those arguments against
the engine's own rules (its source cited there); ``device_defects`` is the kind-independent check of who uses
which GPU.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Optional, Sequence, Union


@dataclasses.dataclass(frozen=True)
class ClusterShape:
    """The job's GPUs as the launch scripts split them (examples/paper/launch.sh): ``nodes`` x ``gpus_per_node``;
    torchrun runs ``trainer_per_node`` ranks on each node's first GPUs (cuda:LOCAL_RANK), Ray gets the rest
    (separate) or every GPU (colocated)."""

    nodes: int
    gpus_per_node: int
    trainer_per_node: int
    placement: str  # "colocated" | "separate"
    ray_gpus: tuple = ()  # physical GPUs of node 0 Ray hands out (launch.sh's CUDA_VISIBLE_DEVICES for ray start)
    # node rank -> (its torchrun ranks, its Ray GPUs), as launch.sh computed them on that node; a node not run
    # (very many nodes: node 0, 1 and the last are) is taken to be like node 1
    per_node: tuple = ()

    def _node(self, node: int) -> tuple:
        table = dict(self.per_node)
        if node in table:
            return table[node]
        if node > 0 and 1 in table:
            return table[1]
        return self.trainer_per_node, tuple(self.ray_gpus)

    def ray_devices(self, node: int = 0) -> list[int]:
        return list(self._node(node)[1])

    def trainer_on(self, node: int = 0) -> int:
        """Trainer ranks on ``node`` (cuda:0..n-1: torchrun's LOCAL_RANK)."""
        return int(self._node(node)[0])


@dataclasses.dataclass
class EngineProcess:
    """One engine as it would start: ``devices`` = physical GPU index on ``node`` of each worker (TP rank order);
    ``args``: what it is started with (vLLM's ``vllm.LLM`` keywords, SGLang's server args); ``env``: the
    engine-relevant part of its environment; ``how``: where the devices come from (one line, for the report)."""

    name: str
    node: int
    devices: list[int]
    args: dict
    env: dict = dataclasses.field(default_factory=dict)
    how: str = ""
    rehearsed: bool = True  # False: listed with the reason (``how``), not checked


_PLANS: dict[str, Union[str, Callable]] = {}
_RULES: dict[str, Union[str, Callable]] = {}


def register_launch_plan(kind: str, plan: Union[str, Callable], rules: Union[str, Callable, None] = None) -> None:
    """Engine kind ``kind``'s launch plan ``plan(factory, shape) -> list[EngineProcess]`` and its argument rules
    ``rules(process, shape) -> list[str]`` (defects, empty when the engine would accept them); "module:function"
    strings are imported when first used."""
    _PLANS[kind] = plan
    if rules is not None:
        _RULES[kind] = rules


def _resolve(table: dict, kind: str) -> Optional[Callable]:
    target = table.get(kind)
    if isinstance(target, str):
        mod, _, fn = target.partition(":")
        target = table[kind] = getattr(importlib.import_module(mod), fn)
    return target


def launch_plan(factory: Any, shape: ClusterShape) -> list[EngineProcess]:
    """The engines ``factory`` would start on ``shape``; [] for a kind that takes no GPUs (cpu / hf)."""
    plan = _resolve(_PLANS, factory.kind)
    return [] if plan is None else plan(factory, shape)


def engine_rules(kind: str, procs: Sequence[EngineProcess], shape: ClusterShape) -> list[str]:
    rules = _resolve(_RULES, kind)
    return [] if rules is None else [d for p in procs for d in rules(p, shape)]


def device_defects(procs: Sequence[EngineProcess], shape: ClusterShape) -> list[str]:
    """Who uses which GPU, against the placement's rule: every worker on a GPU of its node; no two engine workers
    on one GPU; separate: none on a trainer rank's GPU (NCCL refuses two ranks on one device, "Duplicate GPU
    detected", or memory runs out first); colocated: each engine worker on a trainer rank's GPU (it sleeps while
    that rank trains). One line per defect."""
    out, seen = [], {}
    for p in procs:
        if not p.rehearsed:
            continue
        trainer = set(range(shape.trainer_on(p.node)))
        if not p.devices:
            out.append(f"{p.name}: no GPU ({p.how})")
        for w, d in enumerate(p.devices):
            where = f"{p.name} worker {w} on node {p.node} GPU {d}"
            if not 0 <= d < shape.gpus_per_node:
                out.append(f"{where}: the node has GPUs 0..{shape.gpus_per_node - 1}")
            other = seen.setdefault((p.node, d), where)
            if other != where:
                out.append(f"{where} and {other}: two engine workers on one GPU ({p.how})")
            if shape.placement == "separate" and d in trainer:
                out.append(f"{where} is trainer local rank {d}'s GPU (rollout.placement: separate; {p.how})")
            if shape.placement == "colocated" and d not in trainer:
                out.append(f"{where}: no trainer rank there to share it with (rollout.placement: colocated)")
    return out


# the engines' own registrations: each folder says how its engines start
register_launch_plan("vllm", "megatron_s3ac.rollout.engines.vllm.rehearsal:launch_plan",
                     "megatron_s3ac.rollout.engines.vllm.rehearsal:rules")
register_launch_plan("sglang", "megatron_s3ac.rollout.engines.sglang.rehearsal:launch_plan",
                     "megatron_s3ac.rollout.engines.sglang.rehearsal:rules")

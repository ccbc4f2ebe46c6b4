"""The package's module import graph (every ``import``, module-level or inside a function, read with ast) is
acyclic, every folder has a floor and no module imports a higher floor: a folder imports only its own floor and the
floors below it (README "Layout"), whatever the import's place (module level, a function, ``TYPE_CHECKING``)."""
import ast
import graphlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = "megatron_s3ac"
# The floor of each folder of the package (or module at its root): an import may go to the same or a lower floor.
# No exceptions: a module lives in the folder whose floor fits what it imports and what imports it.
FLOORS = {
    "algorithms": 0, "console": 0, "faults": 0,  # pure torch; warning filters; the crash tests' fault points
    "models": 1,  # megatron-core models, layouts, the CPU shim, the gloo rank launcher, tiny models
    "data": 2,  # prompt sets, images, character tokenizers
    "convert": 3,  # HF <-> Megatron plans
    "tasks": 4,  # the toy tasks: prompts + reward of each (rollout.rewards registers the rewards)
    "rollout": 5,  # engines, weight sync, the reward registry and pool
    "r3": 6, "audit": 6,  # routing replay; the audits s3ac-train rehearse runs (collectives, pg timeout)
    "config": 7,  # the run's schema (reads the engine, algorithm and reward registries)
    "eval": 8, "plan": 8, "env": 8,  # evaluation, the memory planner, the version check: below the trainer
    "trainer": 9,
    "testing": 10, "": 10,  # test harnesses (drive the trainer; no package module imports them); the package root
}


def _modules() -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(os.path.join(ROOT, PKG)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> package modules it imports (``from pkg import sub`` counts as an edge to pkg.sub)."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        pkg = m if path.endswith("__init__.py") else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else [base] + subs
            else:
                continue
            graph[m] |= {t for t in targets if t in mods and t != m}
    return graph


def _folder(module: str) -> str:
    """The folder (or root module) a module lives in: ``megatron_s3ac.trainer.step.trainer`` -> ``trainer``, the package
    root -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _floor(module: str) -> int:
    key = _folder(module)
    if key not in FLOORS:
        pytest.fail(f"{module}: folder {key!r} has no floor in FLOORS; add it")
    return FLOORS[key]


def test_every_folder_has_a_floor():
    """FLOORS names exactly the package's folders and root modules (a moved folder leaves no stale floor)."""
    assert {_folder(m) for m in import_graph()} == set(FLOORS)


def test_graph_sees_known_edges():
    g = import_graph()
    assert "megatron_s3ac.trainer.step.batch" in g["megatron_s3ac.trainer.step.trainer"]
    assert "megatron_s3ac.r3.glue" in g["megatron_s3ac.trainer.step.build"]  # a function-level import
    assert "megatron_s3ac.algorithms" in g["megatron_s3ac.trainer.step.trainer"]  # from megatron_s3ac import algorithms
    assert len(g) > 60


def test_no_import_cycles():
    try:
        list(graphlib.TopologicalSorter(import_graph()).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


def test_cycle_detection_works():
    with pytest.raises(graphlib.CycleError):
        list(graphlib.TopologicalSorter({"a": {"b"}, "b": {"a"}}).static_order())


def test_no_import_from_a_higher_floor():
    up = sorted(f"{m} (floor {_floor(m)}) imports {t} (floor {_floor(t)})"
                for m, ts in import_graph().items() for t in ts if _floor(t) > _floor(m))
    assert not up, "\n".join(up)


def test_no_folders_import_each_other():
    """The folder graph is acyclic too: no two folders import each other, even on one floor (trainer, eval and
    plan once did, through imports inside functions)."""
    folders: dict[str, set[str]] = {}
    for m, ts in import_graph().items():
        folders.setdefault(_folder(m), set()).update(_folder(t) for t in ts if _folder(t) != _folder(m))
    pairs = sorted(f"{a} <-> {b}" for a, bs in folders.items() for b in bs if a < b and a in folders.get(b, ()))
    assert not pairs, "folders importing each other: " + ", ".join(pairs)
    try:
        list(graphlib.TopologicalSorter(folders).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f"folder cycle: {' -> '.join(e.args[1])}")


def test_no_package_module_imports_testing():
    """testing/ holds test harnesses only: the package's own code imports none of it (its fault points, rank
    launcher, tiny models and the rehearse audits live in production folders)."""
    up = sorted(f"{m} imports {t}" for m, ts in import_graph().items() if _folder(m) != "testing"
                for t in ts if _folder(t) == "testing")
    assert not up, "\n".join(up)


# trainer/ in rooms by role, each importing only the rooms before it: the step (the Trainer, its rollout sources and
# phases), the run (the loop of steps, checkpoints, logs), the stages around RL (pipeline, coverage, value
# pretraining, warm-up, demo), then the commands at trainer/'s root (cli, input checks, rehearse).
TRAINER_ROOMS = {"step": 0, "run": 1, "stages": 2, "": 3}


def _room(module: str):
    """The trainer room of a module (None outside trainer/): its subfolder, or "" for trainer/'s root modules."""
    parts = module.split(".")
    if parts[:2] != [PKG, "trainer"]:
        return None
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in TRAINER_ROOMS) else ""


def test_trainer_rooms_import_only_earlier_rooms():
    g = import_graph()
    rooms = {_room(m) for m in g if _room(m) is not None}
    assert rooms == set(TRAINER_ROOMS), f"trainer/ rooms without a place in TRAINER_ROOMS: {rooms ^ set(TRAINER_ROOMS)}"
    up = sorted(f"{m} (room {_room(m)!r}) imports {t} (room {_room(t)!r})" for m, ts in g.items()
                if _room(m) is not None for t in ts
                if _room(t) is not None and TRAINER_ROOMS[_room(t)] > TRAINER_ROOMS[_room(m)])
    assert not up, "\n".join(up)


ENGINES = f"{PKG}.rollout.engines."


def _engine_of(module: str):
    """The engine folder a module lives in (``rollout/engines/<engine>/``), else None (engines/pool.py etc.)."""
    if not module.startswith(ENGINES):
        return None
    rest = module[len(ENGINES):].split(".")
    return rest[0] if len(rest) > 1 else None


def test_no_engine_imports_another_engine():
    """One engine's code and its weight sync live in one place: what two engines share goes into rollout/sync/ (or
    rollout/), never one engine's module imported by another's (rollout/engines/<a>/ -> rollout/engines/<b>/)."""
    g = import_graph()
    assert {"cpu", "sglang", "vllm"} <= {_engine_of(m) for m in g}, "the engine folders moved: update ENGINES"
    cross = sorted(f"{m} imports {t}" for m, ts in g.items() for t in ts
                   if _engine_of(m) and _engine_of(t) and _engine_of(m) != _engine_of(t))
    assert not cross, "\n".join(cross)


def test_shared_sync_imports_no_engine():
    """rollout/sync/ is the ground every engine's sync stands on: it imports no engine module (the strategy registry
    names engine classes as "module:Class" strings, imported on lookup)."""
    up = sorted(f"{m} imports {t}" for m, ts in import_graph().items() if m.startswith(f"{PKG}.rollout.sync")
                for t in ts if t.startswith(ENGINES))
    assert not up, "\n".join(up)

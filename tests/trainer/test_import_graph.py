"""The package's module import graph (every ``import``, module-level or inside a function, read with
ast) is acyclic and no module imports a higher floor (README: algorithms <- models <- convert <-
rollout <- r3 <- trainer, eval <- CLIs)."""
import ast
import graphlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = "megatron_s3ac"
# floor of each subpackage (or top-level module); an import may go to the same or a lower floor.
# testing/ holds tiny models and launch helpers next to models/ (used by convert.verify and tests).
# console (warning filters, pure python) sits at the bottom so every CLI and library module may use it.
FLOORS = {"algorithms": 0, "console": 0, "models": 1, "testing": 1, "convert": 2, "rollout": 3, "r3": 4,
          "eval": 5, "trainer": 5, "plan": 5, "": 6, "env": 5}
# testing/'s library, used by package code, each module at the floor of what it imports: tiny models, the rank
# launcher, fault points and the audits ``s3ac-train rehearse`` runs (collectives, fake Ray GPUs: floor 1; SGLang's
# start-up stand-in and the rank-0 wait harness read rollout/: floor 3). Every other testing module is a test
# harness (device audits, engine stand-ins) that drives the trainer: the top floor, so it may import anything and no
# package module may import it.
TESTING_LIBRARY = {"dist": 1, "faults": 1, "tiny_models": 1, "tiny_qwen3_5": 1, "collective_audit": 1,
                   "fake_gpus": 1, "sglang_startup": 3, "dist_timeout": 3}


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


def _floor(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in FLOORS) else ""
    if key == "testing" and len(parts) > 2:
        return TESTING_LIBRARY.get(parts[2], FLOORS[""])
    if key not in FLOORS:
        pytest.fail(f"{module}: package {key!r} has no floor in FLOORS; add it")
    return FLOORS[key]


def test_graph_sees_known_edges():
    g = import_graph()
    assert "megatron_s3ac.trainer.batch" in g["megatron_s3ac.trainer.loop"]
    assert "megatron_s3ac.r3.glue" in g["megatron_s3ac.trainer.build"]  # a function-level import
    assert "megatron_s3ac.algorithms" in g["megatron_s3ac.trainer.loop"]  # from megatron_s3ac import algorithms
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

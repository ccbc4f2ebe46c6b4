"""The weight-sync registry (rollout.sync.strategy): each (engine kind, placement) brings its own strategy, the
trainer's engine side calls it without knowing the engine's name, and a new engine plugs in by registering."""
import ast
import pathlib
import re
from types import SimpleNamespace

import pytest

from megatron_s3ac.rollout.sync import strategy as ss
from megatron_s3ac.rollout.engines.sglang.broadcast import SGLangBroadcastSync
from megatron_s3ac.rollout.engines.sglang.colocated import SGLangColocatedSync
from megatron_s3ac.rollout.factory import ConfigError, SGLangSettings, make_engine_factory, make_sync_strategy
from megatron_s3ac.rollout.sync.weight_sync import ColocatedRankZeroSync, RankZeroSync
from megatron_s3ac.config import EngineKind, Placement, load_config
from megatron_s3ac.trainer.step.engine_side import EngineSide, sync_strategy_for


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry: registrations made by a test vanish after it."""
    monkeypatch.setattr(ss, "_REGISTRY", dict(ss._REGISTRY))
    return ss


@pytest.mark.parametrize("kind, placement, cls", [
    ("cpu", "colocated", ColocatedRankZeroSync), ("cpu", "separate", RankZeroSync),
    ("hf", "colocated", ColocatedRankZeroSync), ("hf", "separate", RankZeroSync),
    ("sglang", "separate", SGLangBroadcastSync), ("sglang", "colocated", SGLangColocatedSync)])
def test_builtin_strategies(kind, placement, cls):
    """Strings and the config's Enum members find the same registration; the trainer's config gives it."""
    assert type(make_sync_strategy(kind, placement)) is cls
    if kind == "sglang":  # without a section: sglang's defaults
        assert make_sync_strategy(kind, placement).settings == SGLangSettings()
    assert type(make_sync_strategy(EngineKind(kind), Placement(placement))) is cls
    cfg = load_config(None, ["model.tiny=arithmetic_moe", f"rollout.placement={placement}"])
    cfg.rollout.engine = EngineKind(kind)  # (sglang refuses the tiny model at load time; the kind is what matters)
    s = sync_strategy_for(cfg)
    assert type(s) is cls and s.engine is None  # every rank builds it, engine or not
    assert s.sleeps == (placement == "colocated")
    if kind == "sglang":
        assert isinstance(s.settings, SGLangSettings)  # the kind's own section, rollout.sglang
    f = make_engine_factory(kind, model_dir="/nonexistent") if kind == "sglang" else \
        make_engine_factory(kind, hf_config=object())
    assert type(f.sync_strategy(placement)) is cls  # next to the engine, from the factory


def test_unregistered_pair_names_both_keys(registry):
    with pytest.raises(ConfigError, match="rollout.engine='trtllm' with rollout.placement='separate'.*registered: "
                                          r"\['cpu/colocated'"):
        make_sync_strategy("trtllm", "separate")
    with pytest.raises(TypeError, match="neither a WeightSyncStrategy subclass"):
        registry.register_weight_sync("vllm", "separate", object)
    registry.register_weight_sync("vllm", "separate", "megatron_s3ac.rollout.sync.weight_sync:RankZeroSync")  # lazy
    assert type(make_sync_strategy("vllm", "separate")) is RankZeroSync
    registry.register_weight_sync("vllm", "colocated", "megatron_s3ac.rollout.sync.weight_sync:SyncStats")
    with pytest.raises(TypeError, match="is not a WeightSyncStrategy"):
        make_sync_strategy("vllm", "colocated")


class _Engine:
    def __init__(self, log):
        self.log = log

    def sleep(self):
        self.log.append("engine.sleep")

    def wake(self, tags=None):
        self.log.append(("engine.wake", tags))

    def close(self):
        self.log.append("engine.close")


class ToySync(ss.WeightSyncStrategy):
    """A third engine's colocated path: wakes in its own order around its own transfer."""

    sleeps = True

    def sync(self, chunks, info, weights_loaded=None):
        log = self.settings.log
        if self.engine is not None and self.asleep:
            self.engine.wake(["weights"])
            self.asleep = False
        log.append(("transfer", len(chunks), info, self.engine is not None))
        return SimpleNamespace(bytes=7)

    def close(self):
        self.settings.log.append("leave groups")


def _toy_trainer(log, engine):
    rollout = SimpleNamespace(engine="toy", placement="colocated", weights_dtype="bf16", fp8_keep=None,
                              toy=SimpleNamespace(log=log))
    return SimpleNamespace(cfg=SimpleNamespace(rollout=rollout), engine=engine, actor=[object(), object()],
                           info="info")


@pytest.mark.parametrize("rank0", [True, False])
def test_a_new_engine_plugs_in_by_registering(registry, rank0):
    """The trainer's engine side drives a registered engine kind it has never heard of: sleep, sync (waking in the
    strategy's order), close of the groups, then of the engine; ranks without an engine run the same collective."""
    registry.register_weight_sync("toy", "colocated", ToySync)
    log = []
    tr = _toy_trainer(log, _Engine(log) if rank0 else None)
    EngineSide.engine_sleep(tr)
    assert EngineSide.sync_weights(tr).bytes == 7
    EngineSide.close_weight_sync(tr)
    closed = EngineSide._close_engine(tr)
    if rank0:
        assert log == ["engine.sleep", ("engine.wake", ["weights"]), ("transfer", 2, "info", True), "leave groups",
                       "engine.close"]
        assert closed and tr.engine is None
    else:
        assert log == [("transfer", 2, "info", False), "leave groups"] and not closed
    assert type(tr.sync_strategy) is ToySync


def test_sglang_colocated_wake_order(monkeypatch):
    """Moved unchanged from trainer/step/engine_side.py: sleep -> wake(["weights"]) -> ColocatedIPCSync.sync ->
    wake(["kv_cache", "cuda_graph"]); a sync with the engine awake wakes nothing."""
    import megatron_s3ac.rollout.engines.sglang.colocated as colocated

    log = []

    class Recorder:
        def __init__(self, engine, timeout_s):
            log.append(("connect", timeout_s))

        def sync(self, chunks, info, bucket_bytes, quantize=None):
            log.append(("sync", bucket_bytes, quantize))
            return "stats"

        def close(self):
            log.append("close")

    monkeypatch.setattr(colocated, "ColocatedIPCSync", Recorder)
    s = make_sync_strategy("sglang", "colocated", _Engine(log), settings=SGLangSettings(bucket_mb=2, timeout_s=9.0),
                           quantize="q")
    s.sleep()
    assert s.sync(["c"], "info") == "stats"
    s.sync(["c"], "info")
    s.close()
    assert log == ["engine.sleep", ("connect", 9.0), ("engine.wake", ["weights"]), ("sync", 2 << 20, "q"),
                   ("engine.wake", ["kv_cache", "cuda_graph"]), ("sync", 2 << 20, "q"), "close"]
    assert s.close_engine() and log[-1] == "engine.close"


def test_cpu_colocated_engine_is_left_to_its_process():
    """The rank-0 path in process: Trainer.close does not shut the engine down (as before the registry)."""
    log = []
    s = make_sync_strategy("cpu", "colocated", _Engine(log))
    assert not s.close_engine() and s.engine is not None and log == []
    assert make_sync_strategy("cpu", "separate", _Engine(log)).close_engine() and log == ["engine.close"]


def test_trainer_never_compares_engine_or_placement_names():
    """The step's rooms (the Trainer, its sources, engine side and placement) hold no comparison with an engine kind
    or placement literal."""
    root = pathlib.Path(__file__).resolve().parents[2] / "megatron_s3ac" / "trainer" / "step"
    names = {k.value for k in EngineKind} | {p.value for p in Placement} | {"vllm"}
    for f in ("engine_side.py", "trainer.py", "source.py", "async_loop.py", "async_partial.py", "placement.py",
              "rollout_phases.py"):
        for node in ast.walk(ast.parse((root / f).read_text())):
            if isinstance(node, ast.Compare):
                consts = {c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)}
                assert not consts & names, f"{f}:{node.lineno} compares with {consts & names}"


KINDS = {k.value for k in EngineKind} | {"cpu", "sglang", "vllm"}
_DEVICE = re.compile(r"device|backend|\.type\b")  # "cpu" compared with a device / backend is not an engine kind


def _kinds_in(node) -> set:
    """Engine-kind names a comparison operand spells: a literal, a tuple / list / set of them, an EngineKind.X."""
    if isinstance(node, ast.Constant):
        return {node.value} & KINDS if isinstance(node.value, str) else set()
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "EngineKind":
        return {f"EngineKind.{node.attr}"}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(set(), *map(_kinds_in, node.elts))
    return set()


def engine_name_comparisons(pkg: pathlib.Path) -> list[str]:
    """Every comparison with an engine-kind name in ``pkg`` outside ``rollout/engines/<kind>/`` (an engine's own
    folder may name itself), as "path:line: source"."""
    out = []
    for f in sorted(pkg.rglob("*.py")):
        parts = f.relative_to(pkg).parts
        if parts[:2] == ("rollout", "engines") and len(parts) > 3:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            ops = [node.left, *node.comparators]
            for i, op in enumerate(ops):
                others = " ".join(ast.unparse(o) for j, o in enumerate(ops) if j != i)
                hit = {k for k in _kinds_in(op) if not (k == "cpu" and _DEVICE.search(others))}
                if hit:
                    out.append(f"{'/'.join(parts)}:{node.lineno}: {ast.unparse(node)}")
                    break
    return out


def test_package_never_compares_engine_names():
    """Callers ask the engine registry (rollout.engines.registry) or the kind's capabilities; only an engine's own
    folder, rollout/engines/<kind>/, may compare with an engine-kind name (issue 38)."""
    found = engine_name_comparisons(pathlib.Path(__file__).resolve().parents[2] / "megatron_s3ac")
    assert not found, "\n".join(found)


def test_engine_name_check_sees_comparisons(tmp_path):
    (tmp_path / "rollout" / "engines" / "toy").mkdir(parents=True)
    (tmp_path / "a.py").write_text('if kind in ("cpu", "hf") or r.engine == EngineKind.vllm or d.type == "cpu":\n'
                                   '    pass\nok = device != "cpu"\n')
    (tmp_path / "rollout" / "engines" / "toy" / "b.py").write_text('x = kind == "sglang"\n')
    (tmp_path / "rollout" / "engines" / "c.py").write_text('x = kind == "sglang"\n')
    assert [f.split(":")[0] for f in engine_name_comparisons(tmp_path)] == ["a.py", "a.py", "rollout/engines/c.py"]

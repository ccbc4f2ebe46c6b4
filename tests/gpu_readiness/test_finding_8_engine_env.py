"""Finding 8 (issue 24): engine actors get the engines' environment from the driver, not from whoever started Ray.

Ray actors take their raylet's environment. At 2c164be SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN reached the
engines only because examples/paper/launch.sh exported it before ``ray start``; on a cluster started earlier the
Qwen2.5-Math configs (context_length 18432 on a 4,096-position model) failed at engine start. Here a real local Ray
is started first, the variables are set in the driver afterwards (the raylet never sees them), and an engine pool
is built as the trainer builds it (``factory.make_engine_factory`` + ``build_rollout_engine``) with the start-up
stand-in of sglang.Engine (megatron_s3ac/rollout/engines/sglang/startup_stand_in.py: it refuses a longer context unless its own
process has the variable, like configs/model_config.py:1291-1316). The Ray cases take tens of seconds on a loaded
2-core box; the in-process engine (one colocated engine) is the fast variant of the configured-context case.
"""
import os

import pytest

ray = pytest.importorskip("ray")

from megatron_s3ac.rollout.factory import SGLangSettings, build_rollout_engine, make_engine_factory  # noqa: E402
from megatron_s3ac.rollout.engines.sglang import startup_stand_in as sglang_startup  # noqa: E402
from megatron_s3ac.rollout.engines.sglang.startup_stand_in import StartupEngine  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QWEN25 = os.path.join(ROOT, "examples", "hf_configs", "qwen2_5_math_1_5b")  # max_position_embeddings 4096
VAR = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


@pytest.fixture(scope="module")
def local_ray():
    saved = {k: os.environ.pop(k) for k in (VAR, "SGLANG_TEST_MARKER", "RAY_ADDRESS") if k in os.environ}
    if ray.is_initialized():  # a Ray of an earlier test module: this test needs one started before the variables
        ray.shutdown()
    ray.cloudpickle.register_pickle_by_value(sglang_startup)
    for attempt in range(3):  # an overloaded box can miss Ray's 30 s raylet registration
        try:
            ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    yield
    ray.shutdown()
    ray.cloudpickle.unregister_pickle_by_value(sglang_startup)
    os.environ.update(saved)


def _started(context_length):
    """Start a one-engine pool the trainer's way; return what its engine saw at start-up."""
    factory = make_engine_factory("sglang", model_dir=QWEN25, return_routed_experts=False, engine_cls=StartupEngine,
                                  settings=SGLangSettings(num_engines=1, context_length=context_length))
    pool = build_rollout_engine(factory, "separate", num_cpus=0.5)
    try:
        return pool.wait([pool.submit(0, "engine.startup_record")], "startup_record")[0]
    finally:
        pool.close()


def test_driver_variables_set_after_ray_started_reach_the_engine(local_ray, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_MARKER", "from-the-driver")
    monkeypatch.setenv(VAR, "1")
    record = _started(18432)
    assert record["env"].get("SGLANG_TEST_MARKER") == "from-the-driver"
    assert record["env"].get(VAR) == "1"
    assert record["pid"] != os.getpid()  # a Ray actor, not this process


def _no_shell_variable(monkeypatch):
    monkeypatch.setenv(VAR, "0")  # recorded first, so the test's end restores the variable's absence
    monkeypatch.delenv(VAR)


def test_in_process_engine_starts_a_configured_longer_context_without_the_shell_variable(monkeypatch):
    _no_shell_variable(monkeypatch)
    factory = make_engine_factory("sglang", model_dir=QWEN25, return_routed_experts=False, engine_cls=StartupEngine,
                                  settings=SGLangSettings(num_engines=1, context_length=18432))
    record = factory().engine.startup_record()  # rollout.sglang.num_engines 1, colocated: built in this process
    assert record["server_args"]["context_length"] == 18432 and record["env"].get(VAR) == "1"
    assert record["pid"] == os.getpid()


def test_the_model_own_context_needs_no_variable(monkeypatch):
    _no_shell_variable(monkeypatch)
    factory = make_engine_factory("sglang", model_dir=QWEN25, return_routed_experts=False, engine_cls=StartupEngine,
                                  settings=SGLangSettings(num_engines=1, context_length=4096))
    assert VAR not in factory().engine.startup_record()["env"]


@pytest.mark.slow
def test_a_configured_longer_context_starts_without_the_shell_variable(local_ray, monkeypatch):
    _no_shell_variable(monkeypatch)
    record = _started(18432)
    assert record["server_args"]["context_length"] == 18432
    assert record["env"].get(VAR) == "1"

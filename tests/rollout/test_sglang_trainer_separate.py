"""The trainer with SGLang engines on their own GPUs (rollout.placement=separate) at PP=2 on 2 gloo ranks: every
weight sync goes from each pipeline stage's leader straight to the engines (per-stage broadcast groups; the 0.5.23
stand-in's receiving side, each engine in its own process), and after the initial sync and each step every
engine's tensors equal the trainer's export exactly."""
import pytest

from megatron_s3ac.models.gloo_ranks import run_distributed
from stage_broadcast_ranks import trainer_separate_rank
from test_sglang_trainer import BASE, arith_dir, sglang_overrides  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow  # 2 ranks + 2 engine processes: ~1-3 min on 2 busy cores


def test_two_steps_separate_engines_fed_by_stage_leaders(arith_dir, tmp_path):
    base = [o for o in BASE if o != "actor_layout.ep=2"]
    over = base + sglang_overrides(arith_dir) + [
        "actor_layout.pp=2", "rollout.placement=separate", "rollout.sglang.num_engines=2", "cluster.gpus=4",
        f"train.out_dir={tmp_path}"]
    r0, r1 = run_distributed(trainer_separate_rank, 2, arith_dir, over, 2)
    assert len(r0["checks"]) == 4 and r1["checks"] == [None] * 4
    for per_engine in r0["checks"]:
        assert len(per_engine) == 2
        for n, diff, unsent in per_engine:
            assert n > 10 and diff == 0.0 and unsent == []  # engine-side tensors == the trainer's export
    assert r0["bytes"] > 0 and r1["bytes"] > 0  # both stages' leaders broadcast their own stage
    assert all(m["actor/opt_steps"] >= 1 for m in r0["steps"])

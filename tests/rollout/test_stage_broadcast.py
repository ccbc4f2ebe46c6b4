"""Separate-GPU weight sync from the ranks that own the bytes (rollout.engines.sglang.broadcast.StageBroadcastSync) over gloo on
CPU ranks, against the sglang 0.5.23 stand-in's receiving side (init_weights_update_group +
update_weights_from_distributed with flattened buckets, in weight-update sessions): after each sync every engine's
tensors equal the trainer's export exactly; each pipeline stage's leader broadcasts its own stage (PP=2: both
ranks send, neither relays the other's bytes); with EP=2 the experts of rank 1 reach the engines through their
stage leader only."""
import pytest

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.models.tiny_models import save_tiny_hf
from stage_broadcast_ranks import refused_rank, stage_broadcast_rank

pytestmark = pytest.mark.slow  # 2 ranks + engine processes each: ~15 s quiet, ~60 s on 2 busy cores


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from megatron_s3ac.convert import hf_to_mcore

    root = tmp_path_factory.mktemp("bsync")
    out = {}
    for i, name in enumerate(("qwen3", "qwen3_moe")):
        hf = save_tiny_hf(name, str(root / f"hf_{name}"), seed=20 + i)
        mc = str(root / f"mcore_{name}")
        hf_to_mcore(hf, mc, workers=1, progress=False)
        out[name] = (hf, mc)
    return out


def _check_exact(r0):
    for per_engine in r0["diffs"]:
        assert len(per_engine) == 2
        for diffs in per_engine:
            assert len(diffs) > 10 and max(diffs.values()) == 0.0, {n: d for n, d in diffs.items() if d}
    assert all(u == [] for u in r0["unsent"])  # every served tensor was sent


def _sessions(calls):
    """Each sync is one session: begin, only distributed updates, end, flush."""
    begins = [i for i, c in enumerate(calls) if c == "begin_weight_update"]
    assert len(begins) == 2
    for i in begins:
        j = calls.index("end_weight_update", i)
        assert j > i + 1 and set(calls[i + 1:j]) == {"update_weights_from_distributed"}
        assert calls[j + 1] == "flush_cache"


@pytest.mark.parametrize("case", ["pp2", "ep2"])
def test_stage_leaders_broadcast_their_own_stage(ckpts, case):
    name, tp, pp, ep = {"pp2": ("qwen3", 1, 2, 1), "ep2": ("qwen3_moe", 1, 1, 2)}[case]
    hf, mc = ckpts[name]
    r0, r1 = run_distributed(stage_broadcast_rank, 2, hf, mc, tp, pp, ep, 2, 20_000)
    _check_exact(r0)
    _sessions(r0["calls"])
    total = r0["ref_bytes"]
    if case == "pp2":  # each stage's leader sent exactly its own stage; together the whole model, once
        assert r0["bytes"][0] > 0 and r1["bytes"][0] > 0
        assert [a + b for a, b in zip(r0["bytes"], r1["bytes"])] == [total, total]
    else:  # one stage: its leader broadcasts everything, rank 1's experts reached it inside the stage
        assert r0["bytes"] == [total, total] and r1["bytes"] == [0, 0]


def test_unserved_name_is_refused_before_the_sync_starts(ckpts):
    """The controller checks every tensor of the export before the session: nothing moves, no session opens."""
    hf, mc = ckpts["qwen3"]
    (err0, calls, gen), (err1, _, _) = run_distributed(refused_rank, 2, hf, mc, 2, "model.norm.weight")
    assert "WeightUpdateError" in err0 and "'model.norm.weight' is not in the served checkpoint" in err0
    assert "refused the weight sync before it started" in err1 and "model.norm.weight" in err1
    assert "begin_weight_update" not in calls and not any(c.startswith("update_weights") for c in calls)
    assert gen == "served"  # the old weights are intact


def test_unserved_name_of_a_remote_stage_stops_both_sides(ckpts):
    """A tensor only a bucket's stream adds (as FP8 scales are) is caught per bucket, on a remote stage: both sides
    stop, the session closes, and the engine refuses to generate from its half-updated weights."""
    hf, mc = ckpts["qwen3"]
    (err0, calls, gen), (err1, _, _) = run_distributed(refused_rank, 2, hf, mc, 2, "model.norm.weight",
                                                       "model.norm.extra")
    assert "WeightUpdateError" in err0 and "'model.norm.extra' is not in the served checkpoint" in err0
    assert "refused bucket" in err1  # stage 1's leader did not broadcast to nobody
    assert calls[-1] == "end_weight_update"  # the session was closed
    assert any(c.startswith("update_weights") for c in calls)  # stage 0's buckets had loaded
    assert "failed midway" in gen

"""Colocated weight sync to SGLang engines through per-device handles (rollout.engines.sglang.colocated.ColocatedIPCSync) over gloo
on CPU ranks, against the sglang 0.5.23 stand-in (update_weights_from_tensor with one serialized flattened-bucket
payload per TP rank, deserialized through the SafeUnpickler model, inside weight-update sessions).

After each of two syncs every engine's tensors equal the trainer's export exactly; every TP rank's payload was
produced by the trainer rank on its device (the shared-memory handle names its producer's pid); each pipeline
stage's leader broadcast exactly its own stage; a sync is one session per engine; an engine on a device without a
trainer rank and a name the engines do not serve are refused on every rank."""
import pytest

from megatron_s3ac.models.gloo_ranks import run_distributed
from colocated_ranks import colocated_rank, refused_rank
from test_stage_broadcast import ckpts  # noqa: F401 (fixture: tiny qwen3 / qwen3_moe, HF + torch_dist)

pytestmark = pytest.mark.slow  # 2 ranks + engine processes: ~20 s quiet, ~60 s on 2 busy cores


# pp2: one engine with 2 TP ranks on the two trainer ranks' devices; ep2: two engines of one TP rank each
CASES = {"pp2_tp2engine": ("qwen3", 1, 2, 1, 2, [0]), "ep2_two_engines": ("qwen3_moe", 1, 1, 2, 1, [0, 1])}


@pytest.mark.parametrize("case", list(CASES))
def test_each_engine_tp_rank_reads_from_the_trainer_rank_on_its_device(ckpts, case):
    name, tp, pp, ep, tp_size, bases = CASES[case]
    hf, mc = ckpts[name]
    r0, r1 = run_distributed(colocated_rank, 2, hf, mc, tp, pp, ep, tp_size, bases, 20_000)
    for per_engine in r0["diffs"]:  # every engine, after each sync: exactly the trainer's export
        assert len(per_engine) == len(bases)
        for diffs in per_engine:
            assert len(diffs) > 10 and max(diffs.values()) == 0.0, {n: d for n, d in diffs.items() if d}
    assert all(u == [] for u in r0["unsent"])
    pids = [r0["pid"], r1["pid"]]
    plan = r0["plan"]
    assert plan == r1["plan"] and plan == [[b + t for t in range(tp_size)] for b in bases]
    for e, log in enumerate(r0["logs"]):  # TP rank t of engine e read memory of the trainer rank on its device
        assert len(log) >= 2, "the engine saw no flattened payload"
        for entry in log:
            assert entry["producers"] == [pids[x] for x in plan[e]] and all(entry["matches_rank0"])
    total = r0["ref_bytes"]
    if pp == 2:  # each stage's leader broadcast exactly its stage; together the whole model, once per sync
        assert r0["bytes"][0] > 0 and r1["bytes"][0] > 0
        assert [a + b for a, b in zip(r0["bytes"], r1["bytes"])] == [total, total]
    else:
        assert r0["bytes"] == [total, total] and r1["bytes"] == [0, 0]
    calls = r0["calls"]  # one session per sync: begin, only tensor updates, end, flush
    begins = [i for i, c in enumerate(calls) if c == "begin_weight_update"]
    assert len(begins) == 2
    for i in begins:
        j = calls.index("end_weight_update", i)
        assert j > i + 1 and set(calls[i + 1:j]) == {"update_weights_from_tensor"}
        assert calls[j + 1] == "flush_cache"


def test_engine_on_a_device_without_trainer_rank_is_refused_everywhere(ckpts):
    hf, mc = ckpts["qwen3"]
    (err0, calls, _), (err1, _, _) = run_distributed(refused_rank, 2, hf, mc, 2, [5])
    for err in (err0, err1):
        assert err.startswith("ColocationError") and "engine 0's TP rank 0 runs on device" in err and "cpu5" in err
    assert "update_weights_from_tensor" not in calls


def test_unserved_name_is_refused_on_every_rank_before_the_sync_starts(ckpts):
    """The controller checks every tensor of the export before the session: nothing moves, no session opens."""
    hf, mc = ckpts["qwen3"]
    (err0, calls, gen), (err1, _, _) = run_distributed(refused_rank, 2, hf, mc, 2, [0], "model.norm.weight")
    assert "WeightUpdateError" in err0 and "'model.norm.weight' is not in the served checkpoint" in err0
    assert "refused the weight sync before it started" in err1 and "model.norm.weight" in err1
    assert "begin_weight_update" not in calls and "update_weights_from_tensor" not in calls
    assert gen == "served"  # the old weights are intact


def test_unserved_name_midway_stops_every_rank_and_closes_the_session(ckpts):
    """A tensor only a bucket's stream adds (as FP8 scales are) is caught per bucket, on the last stage: every rank
    stops, the session closes without a flush, and the engine refuses to generate from half-updated weights."""
    hf, mc = ckpts["qwen3"]
    (err0, calls, gen), (err1, _, _) = run_distributed(refused_rank, 2, hf, mc, 2, [0], "model.norm.weight",
                                                       "model.norm.extra")
    assert "WeightUpdateError" in err0 and "'model.norm.extra' is not in the served checkpoint" in err0
    assert "stopped the weight sync" in err1 and "model.norm.extra" in err1
    assert calls[-1] == "end_weight_update"  # the session was closed
    assert "update_weights_from_tensor" in calls  # stage 0's buckets had loaded
    assert "flush_cache" not in calls[calls.index("begin_weight_update"):]
    assert "failed midway" in gen


def test_fp8_quantized_on_the_stage_leaders_reaches_every_tp_rank_bit_exact(ckpts):
    """rollout.weights_dtype=fp8: each stage leader quantizes its buckets before the broadcast; both TP ranks of
    the engine receive exactly quantize_stream(export) (e4m3 weights + float32 scales), nothing else."""
    from colocated_ranks import fp8_rank

    hf, mc = ckpts["qwen3_moe"]
    r0, r1 = run_distributed(fp8_rank, 2, hf, mc, 2, 1, 20_000)
    assert r1 is None
    assert any(d == "torch.float8_e4m3fn" for d in r0["ref"].values())  # something was quantized
    for per_rank in r0["ranks"]:
        assert all(per_rank.values()), [n for n, ok in per_rank.items() if not ok]
    assert r0["extra"] == [[], []]
    assert r0["calls"][:2] == ["check", "begin"] and r0["calls"][-1] == "finish" and "end" not in r0["calls"]

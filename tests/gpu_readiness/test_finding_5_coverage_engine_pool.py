"""Finding 5: the pipeline's coverage stage with the trainer's engine pool holding every GPU in Ray.

Ray runs with fake GPUs (megatron_s3ac.rollout.engines.fake_gpus) and the sglang 0.5.23 stand-in engines ask it for the GPUs
real ones would, so placement is real: the trainer's pool (rollout.placement=separate, one engine of one GPU; a
cluster of 2 GPUs, one for the trainer) takes the only engine GPU, and a coverage engine can only be placed once that
pool is closed. Before the fix the coverage pool waited for a GPU the sleeping pool kept (900 s on a cluster; 45 s
here, bounded by the harness) and the stage failed; after it the stage writes coverage.jsonl and the trainer's engine
is back, serving the actor's weights. The other ranks' wait has a deadline and hears rank 0's failure at once:
test_other_ranks_hear_rank0s_failure (2 gloo ranks, CPU engine).
"""
import json
import os
import sys

import pytest

from megatron_s3ac.models.gloo_ranks import DistributedTestError, run_distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROLLOUT = os.path.join(os.path.dirname(HERE), "rollout")
BASE = ["rollout.prompts_per_step=2", "rollout.k=2", "rollout.max_new_tokens=4", "data.num_prompts=40",
        "data.eval_prompts=4", "algo.actor_minibatches=1", "algo.critic_minibatches=1", "train.progress=false",
        "train.tensorboard=false", "train.eval_every=0", "algo.dynamic_sampling=false", "daps.enabled=false",
        "pipeline.coverage_prompts=2", "pipeline.coverage_k=1", "pipeline.stop_after=coverage"]


def _hf_dir(path):
    """The demo's arithmetic Qwen3-MoE as an HF directory (config, random safetensors, character tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_s3ac.models.tiny_models import char_tokenizer
    from megatron_s3ac.data.prompts import ARITH_CHARS
    from megatron_s3ac.tasks.arithmetic import tiny_arithmetic_hf_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_arithmetic_hf_config()).save_pretrained(path)
    char_tokenizer(ARITH_CHARS).save_pretrained(path)
    return path


def _coverage_rank(overrides, gpus):
    """Rank 0 of a 1-rank job: Ray with ``gpus`` fake GPUs, the pipeline up to its coverage stage."""
    import ray

    sys.path.insert(0, ROLLOUT)
    import fake_sglang
    import rollout_fixtures

    import megatron_s3ac.rollout.factory as F
    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.engines.pool import EnginePool
    from megatron_s3ac.rollout.engines.fake_gpus import free_gpus, stand_ins_request_gpus, start_ray
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.stages.pipeline import Pipeline

    F.SGLANG_ENGINE_CLS = fake_sglang.FakeSGLangEngine
    start_ray(gpus, num_cpus=4, by_value=(fake_sglang, rollout_fixtures))
    out = {}
    try:
        with stand_ins_request_gpus(EnginePool, start_timeout_s=45):
            p = Pipeline(load_config(None, overrides))
            out["free_after_init"] = free_gpus()
            try:
                out["results"] = p.run()
                out["error"] = None
            except Exception as e:  # reported, so the assertion names it
                out["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            tr = p.tr
            out["engine_back"] = tr.engine is not None
            if tr.engine is not None:
                outs = tr.engine.generate([[4, 5, 6]], SamplingParams(max_new_tokens=3, temperature=0.0, seed=1))
                out["generated"] = len(outs[0][0].response_ids)
                out["free_after"] = free_gpus()
            tr.close()
    finally:
        ray.shutdown()
    return out


@pytest.mark.slow  # one trainer, three Ray actors loading a transformers model: ~1-2 min on 2 busy cores
def test_coverage_engines_placed_beside_the_trainers_pool(tmp_path):
    hf = _hf_dir(str(tmp_path / "hf"))
    out_dir = str(tmp_path / "run")
    over = BASE + [f"model.hf_config={hf}", f"model.engine_hf_dir={hf}", "rollout.engine=sglang",
                   "rollout.sglang.bucket_mb=1", "rollout.placement=separate", "rollout.sglang.num_engines=1",
                   "cluster.gpus=2", f"pipeline.policies=[{hf}]", f"train.out_dir={out_dir}"]
    (r,) = run_distributed(_coverage_rank, 1, over, 1, timeout=600)
    assert r["free_after_init"] == 0.0  # the harness is real: the trainer's pool holds the only engine GPU
    assert r["error"] is None, r["error"]
    assert r["results"]["coverage"]["status"] == "ran"
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "stages", "coverage", "coverage.jsonl"))]
    assert len(rows) == 2 and all(row["source"] == hf for row in rows)
    assert r["engine_back"] and r["generated"] >= 1  # the trainer's engine was started again and serves
    assert r["free_after"] == 0.0  # ... holding its GPU again (no pool leaked, none lost)


def _waiting_rank(overrides, rank0_delay_s):
    """Both ranks run the pipeline; rank 0's coverage fails (after ``rank0_delay_s``). Returns what each rank raised
    and when (s after the stage began)."""
    import time

    import torch.distributed as dist

    import megatron_s3ac.trainer.stages.coverage as C
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.stages.pipeline import Pipeline

    cfg = load_config(None, overrides)
    cfg.pipeline.coverage_timeout_s = 3.0  # the ranks' deadline (an attribute code without one never reads)
    if dist.get_rank() == 0:
        def failing(*a, **k):
            time.sleep(rank0_delay_s)
            raise RuntimeError("coverage engine could not start (injected)")

        C.build_coverage = failing
    p = Pipeline(cfg)
    t0 = time.time()
    try:
        p.run()
        return {"error": None, "s": time.time() - t0}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "s": time.time() - t0}


def _cpu_overrides(tmp_path):
    hf = _hf_dir(str(tmp_path / "hf"))
    return BASE + [f"model.hf_config={hf}", "rollout.engine=cpu", f"pipeline.policies=[{hf}]",
                   f"train.out_dir={tmp_path / 'run'}"]


def _two_ranks(tmp_path, rank0_delay_s):
    try:
        return run_distributed(_waiting_rank, 2, _cpu_overrides(tmp_path), rank0_delay_s, timeout=150)
    except DistributedTestError as e:  # a rank that never returns: the wait has no end
        pytest.fail(f"a rank did not finish (it still waits for rank 0's coverage?): {str(e)[:300]}")


@pytest.mark.slow  # two gloo ranks build a trainer each: ~1 min on 2 busy cores (fast variant below)
def test_other_ranks_hear_rank0s_failure(tmp_path):
    """Rank 0's coverage fails at once: rank 1 stops with rank 0's error instead of polling forever."""
    r0, r1 = _two_ranks(tmp_path, 0.0)
    assert "injected" in r0["error"]
    assert r1["error"] is not None and "rank 0" in r1["error"] and "injected" in r1["error"], r1


@pytest.mark.slow  # as above
def test_other_ranks_wait_has_a_deadline(tmp_path):
    """Rank 0 is still busy after rank 1's deadline (pipeline.coverage_timeout_s = 3 s): rank 1 gives up, naming
    the limit, long before rank 0 is done."""
    r0, r1 = _two_ranks(tmp_path, 12.0)
    assert r1["error"] is not None and r1["error"].startswith("TimeoutError") and "coverage_timeout_s" in r1["error"]
    assert r1["s"] < 12.0, r1


class _WaitingRank:
    """What the coverage stage of a rank != 0 touches of its trainer before it waits (fast variant: the waiting
    logic alone, in this process; the slow tests above run it in real 2-rank pipelines)."""
    rank = 1

    def close_weight_sync(self):
        pass

    def engine_sleep(self):
        raise AssertionError("only rank 0 drives the engine")


def _wait_in_thread(tmp_path, verdict, timeout_s):
    """Rank 1's coverage stage in a thread; returns (finished, exception) after at most 20 s."""
    import threading

    import megatron_s3ac.trainer.stages.coverage  # noqa: F401 (imported here, not on the clock: torch takes seconds)
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.stages.pipeline import Pipeline

    cfg = load_config(None, BASE + [f"train.out_dir={tmp_path / 'run'}", "rollout.engine=cpu"], check=False)
    cfg.pipeline.coverage_timeout_s = timeout_s
    p = Pipeline.__new__(Pipeline)  # no trainer build: only the stage's waiting logic runs
    p.cfg, p.tr, p.rank = cfg, _WaitingRank(), 1
    p.dirs = {"coverage": str(tmp_path / "coverage")}
    os.makedirs(p.dirs["coverage"])
    if verdict is not None:
        with open(os.path.join(p.dirs["coverage"], "coverage_verdict.json"), "w") as f:
            json.dump(verdict, f)
    box = {}

    def body():
        try:
            p._run_coverage(0.0)
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(20.0)
    return not t.is_alive(), box.get("error")


def test_waiting_rank_raises_rank0s_error_fast(tmp_path):
    done, err = _wait_in_thread(tmp_path, {"ok": False, "error": "RuntimeError: no placement (injected)"}, 60.0)
    assert done, "rank 1 still polls after rank 0 reported its failure"
    assert isinstance(err, RuntimeError) and "injected" in str(err) and "rank 0" in str(err)


def test_waiting_rank_deadline_fast(tmp_path):
    done, err = _wait_in_thread(tmp_path, None, 0.5)
    assert done, "rank 1 polls for rank 0's coverage with no deadline"
    assert isinstance(err, TimeoutError) and "coverage_timeout_s" in str(err)

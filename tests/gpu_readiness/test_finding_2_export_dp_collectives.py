"""Finding 2 (issue 24): the first weight sync with DP > 1 ran a different collective sequence on the DP ranks.

``convert/export.py`` took the export plan's device from the rank's first main-replica piece and fell back to the
host on a rank holding none; megatron gives the main replicas to DP rank 0 only (``replica_id = (0, tp,
dp_rank)``, megatron/core/utils.py), so on a GPU job DP rank 0 saw CUDA and skipped the shared-memory hand-shake
while every DP rank > 0 saw "cpu" and ran it alone: an ``all_gather`` of a host tensor on the NCCL group, then a
barrier. The fix decides the path once per group from its backend (``group_device``).

What CPU can show: every tensor is on the host, so the old rule agrees by luck. The test moves DP rank 0's model to
the ``meta`` device (the one non-host device a CPU machine has; meta tensors carry shapes, enough to build the
plan) in place of CUDA: the old code then diverges exactly as on the GPU, and the collective audit
(``megatron_s3ac.audit.collectives``) names the divergence. The same audit runs over the trainer at DP=2
(construction with its first sync, one step, another sync): every group's ranks issue the same collectives.
The device check covering the real thing is ``tools/device_checks/sglang_colocated.py`` with its default flags
(NCCL, DP > 1), on a GPU.
"""
import datetime

import pytest

from megatron_s3ac.audit.collectives import CollectiveDivergence, Record, audited, check_consistent
from megatron_s3ac.models.gloo_ranks import run_distributed

SMALL = ["model.tiny=arithmetic_moe", "rollout.prompts_per_step=4", "rollout.k=2", "rollout.max_new_tokens=3",
         "data.num_prompts=64", "data.eval_prompts=8", "algo.actor_minibatches=2", "algo.critic_minibatches=2",
         "algo.critic_epochs=1", "algo.dynamic_sampling=false", "daps.warmup_steps=0", "daps.rampup_steps=1",
         "train.progress=false", "train.tensorboard=false", "train.eval_every=0"]


def _plan_with_dp_rank0_off_host():
    """DP=2 (tp = pp = ep = 1 on 2 ranks): the export plan built with DP rank 0's pieces off the host."""
    import torch
    import torch.distributed as dist

    from megatron_s3ac.convert.export import local_pieces, prepare_export
    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.models.tiny_models import tiny_config

    info = model_info(tiny_config("qwen3").to_dict())
    lay = ParallelLayout()
    initialize_model_parallel(lay, seed=3)
    torch.manual_seed(0)
    model = build_actor(info, build_transformer_config(info, lay))
    pieces = len(local_pieces([model]))
    if dist.get_rank() == 0:
        model.to("meta")  # in place of CUDA: the rank holding the main replicas has them off the host
    # the export group (megatron's TPxDP group = both ranks here) with a short timeout: a rank left alone in a
    # collective ends in seconds, and the audit compares what each rank did
    group = dist.new_group(ranks=[0, 1], timeout=datetime.timedelta(seconds=5))
    res = audited(prepare_export, [model], info, 1 << 16, group=group, shm=True)
    plans = list(model.__dict__.get("_s3ac_export_plans", {}).values())
    res["pieces"] = pieces
    res["plan_device"] = str(plans[0].device) if plans else None
    res["result"] = None
    return res


def test_export_plan_path_is_the_groups_not_the_first_tensors():
    res = run_distributed(_plan_with_dp_rank0_off_host, 2)
    # the finding's premise, from megatron itself: DP rank 0 holds every main replica, DP rank 1 none
    assert res[0]["pieces"] > 0 and res[1]["pieces"] == 0
    n = check_consistent([r["records"] for r in res])  # the old code: rank 1's all_gather alone
    assert n > 0
    for r in res:
        assert r["error"] is None, r["error"]
    # one device path for the whole group: the backend's (gloo: the host), whatever the rank's tensors
    assert res[0]["plan_device"] == res[1]["plan_device"] == "cpu"


def _trainer_dp2(out):
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer

    def run():
        cfg = load_config(None, SMALL + [f"train.out_dir={out}"])
        tr = Trainer(cfg)  # models, engine (rank 0), first weight sync
        m = tr.step()  # rollout, distribute, old log-probs, updates, sync
        tr.sync_weights()  # the cached export plan
        tr.close()
        return {"dp": tr.dp, "step": m["step"]}

    return audited(run)


def test_collective_audit_over_the_trainer_at_dp2(tmp_path):
    res = run_distributed(_trainer_dp2, 2, str(tmp_path))
    for r in res:
        assert r["error"] is None, r["error"]
    assert [r["result"]["dp"] for r in res] == [2, 2]
    check_consistent([r["records"] for r in res])
    # not vacuous: the audit saw the export's plan (metadata exchange, shared-memory hand-shake) at every sync, and
    # the DP gradient reduce-scatter / parameter all-gather of megatron's distributed optimizer
    seen = {(rec.op, rec.where.split(":")[0]) for rec in res[1]["records"]}
    for want in [("all_reduce", "export.py"), ("all_gather_object", "export.py"), ("all_gather", "export.py"),
                 ("reduce_scatter_tensor", "param_and_grad_buffer.py"),
                 ("all_gather_into_tensor", "param_and_grad_buffer.py")]:
        assert want in seen, (want, sorted(seen))


def test_check_consistent_names_the_first_divergence():
    """The checker itself, on records of a known divergence (what the old export did at DP=2 on a GPU)."""
    def rec(op, args, where):
        return Record(op, "g1", (0, 1), args, where)

    common = [rec("all_reduce", (("tensor", "int64[7]"),), "export.py:240 _plan_for"),
              rec("all_gather_object", (("object_list", "2 objects"),), "export.py:125 __init__")]
    r0 = common
    r1 = common + [rec("all_gather", (("tensor", "uint8[64]"),), "export.py:188 _share")]
    assert check_consistent([r0, r0]) == 2
    with pytest.raises(CollectiveDivergence, match=r"(?s)group g1 \(ranks \[0, 1\]\): rank 0 and rank 1 diverge at "
                                                   r"collective #2:.*rank 0: nothing.*rank 1: all_gather"):
        check_consistent([r0, r1])
    r1 = [common[0], rec("all_gather_object", (("object_list", "3 objects"),), "x.py:1 f")]
    with pytest.raises(CollectiveDivergence, match="#1"):
        check_consistent([r0, r1])

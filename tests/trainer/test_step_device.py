"""Every tensor of a trainer step follows ``trainer_device()`` (issue 15): the step's batch shard, every
micro-batch field fed to the model, and every tensor handed to a torch.distributed call (NCCL takes only
CUDA tensors); log-probs, values, advantages, returns and losses are fp32 with bf16 models.

On this CPU-only machine ``trainer_device()`` is the host, so the device half is checked against it
here and on CUDA by tools/device_checks/train_loop_cuda.py; the dtype half is fully checked here
(model.dtype=bf16). The batch a rank trains on is its own shard (sharded data flow)."""
import pytest
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.config import load_config
from tests.trainer.test_trainer import SMALL

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "send", "recv", "isend", "irecv", "all_to_all_single")


def _step(out_dir):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import megatron_s3ac.models.pipeline as pipeline
    import megatron_s3ac.trainer.step.trainer as loop
    from megatron_s3ac.trainer.step.device import trainer_device
    from megatron_s3ac.trainer.step.trainer import Trainer

    tr = Trainer(load_config(None, SMALL + ["actor_layout.ep=2", "algo.dynamic_sampling=false", "model.dtype=bf16",
                                            f"train.out_dir={out_dir}"]))
    seen = {"collective": set(), "micro": set(), "loss_dtype": set(), "batches": []}
    on = [False]

    def spy(real):
        def f(*args, **kwargs):
            if on[0]:
                for a in list(args) + list(kwargs.values()):
                    for t in (a if isinstance(a, (list, tuple)) else [a]):
                        if torch.is_tensor(t):
                            seen["collective"].add(str(t.device))
            return real(*args, **kwargs)
        return f

    for name in COLLECTIVES:
        for mod in (c10d, dist):
            setattr(mod, name, spy(getattr(mod, name)))
    real_fb = pipeline.forward_backward

    def fb(chunks, mbs, loss_fn, forward_only=False):
        for mb in mbs:
            for k in ("input_ids", "flat_idx", "mask", "rollout_logp", "old_logp", "adv", "returns", "old_values"):
                v = getattr(mb, k, None)
                if torch.is_tensor(v):
                    seen["micro"].add(str(v.device))
        return real_fb(chunks, mbs, loss_fn, forward_only=forward_only)
    pipeline.forward_backward = fb
    for name in ("actor_loss", "critic_loss"):
        real = getattr(loop, name)

        def wrapped(*a, _real=real, **kw):
            loss, count, met = _real(*a, **kw)
            seen["loss_dtype"].add(str(loss.dtype))
            return loss, count, met
        setattr(loop, name, wrapped)
    real_adv = tr.advantages

    def adv(batch):
        m = real_adv(batch)
        seen["batches"].append({k: (str(getattr(batch, k).device), str(getattr(batch, k).dtype))
                                for k in ("tokens", "mask", "old_logp", "adv", "returns", "old_values", "is_w")
                                if getattr(batch, k) is not None})
        seen["rows"] = (len(batch), batch.global_len())
        return m
    tr.advantages = adv
    on[0] = True
    m = tr.step()
    on[0] = False
    tr.close()
    return {"seen": seen, "device": str(trainer_device()), "opt_steps": m["actor/opt_steps"]}


@pytest.mark.slow
def test_step_tensors_follow_trainer_device_and_are_fp32(tmp_path):
    for r in run_distributed(_step, 2, str(tmp_path)):
        s, dev = r["seen"], r["device"]
        assert r["opt_steps"] >= 1
        assert s["collective"] == {dev}, s["collective"]
        assert s["micro"] == {dev}, s["micro"]
        assert s["loss_dtype"] == {"torch.float32"}
        (b,) = s["batches"]
        assert {d for d, _ in b.values()} == {dev}
        assert {"old_logp", "adv", "returns", "old_values"} <= b.keys()
        for k in b.keys() - {"tokens", "mask"}:  # is_w too when the IS corrections are on
            assert b[k][1] == "torch.float32", (k, b[k])
        n, n_global = s["rows"]
        assert n < n_global  # this rank holds its shard only (DP=2)

"""Finding 9: idle-model offload pinned one host buffer per tensor; torch's pinned allocator rounds each up to a
power of two and never frees it (ATen/core/CachingHostAllocator.h:300-309, 341 in torch 2.13), and the planner
counted the host side at the bare state bytes.

After the fix a model's offload lives in ONE host arena (models.offload.HostOffload), allocated once, sized for the
Adam moments its first step will create, and reused by every later offload; the planner counts that arena rounded
up to a power of two (plan.memory.pinned_bytes) per model per GPU. Reference: a hand count of the model's storages
and Python's own power-of-two arithmetic. CPU cannot pin (the arena is plain host memory here, the same code path
otherwise); the device check tools/device_checks/colocated_residency.py compares torch's pinned bytes
(host_memory_stats) with the arenas on a GPU.
"""
import torch

from megatron_s3ac.models.offload import HostOffload


def _model_and_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step():
        opt.zero_grad()
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()

    return model, opt, step


def _raw(model, opt):
    out = [p.detach().clone() for p in model.parameters()] + [p.grad.clone() for p in model.parameters()]
    out += [v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return out


def _host_storages(h):
    return {e[-1].untyped_storage().data_ptr() for e in h._saved}


def test_one_arena_per_model_reused_by_every_offload():
    model, opt, step = _model_and_step()
    h = HostOffload([model], opt, device="cpu")
    step()
    h.offload()
    assert len(_host_storages(h)) == 1, "one host buffer per tensor, not one arena per model"
    arena = next(iter(_host_storages(h)))
    h.onload()
    step()
    before = _raw(model, opt)
    st = h.offload()
    assert _host_storages(h) == {arena}  # the same arena again: nothing allocated per offload
    n_state = sum(p.numel() * 4 for p in model.parameters())
    steps = sum(s["step"].nbytes for s in opt.state.values())  # Adam: exp_avg, exp_avg_sq and its step counter
    assert st.bytes == {"params": n_state, "grads": n_state, "optimizer": 2 * n_state + steps}
    h.onload()
    assert all(torch.equal(a, b) for a, b in zip(before, _raw(model, opt)))  # bit-exact round trip


def test_arena_sized_for_the_first_steps_adam_moments():
    model, opt, step = _model_and_step()
    step()
    opt.state.clear()  # as before the first optimizer step: no moments yet (the rollout of step 1 offloads so)
    h = HostOffload([model], opt, device="cpu")
    h.offload()
    first = _host_storages(h)
    assert len(first) == 1
    h.onload()
    step()  # the moments appear
    h.offload()
    assert _host_storages(h) == first  # they fit the arena taken before they existed


def test_planner_counts_each_models_arena_rounded_to_a_power_of_two():
    from megatron_s3ac.models.parallel import ParallelLayout
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.plan import constants as C
    from megatron_s3ac.plan.memory import Cluster, Knobs, Workload, estimate
    from megatron_s3ac.tasks.arithmetic import tiny_arithmetic_hf_config

    info = model_info(tiny_arithmetic_hf_config().to_dict())
    cl = Cluster(gpus=2, gpus_per_node=2)
    est = estimate(info, ParallelLayout(), cl, Workload(), Knobs(offload_idle=True, critic=True))
    pow2 = lambda n: 1 << (int(n) - 1).bit_length()  # noqa: E731
    worst = max(sum(pow2(s.gpu) for s in (st.actor, st.critic)) for st in est.stages)
    assert any(pow2(s.gpu) != s.gpu for st in est.stages for s in (st.actor, st.critic))  # the rounding shows
    assert est.host_per_node == 2 * (C.HOST_PROCESS_GIB_PER_GPU * C.GIB + worst)

"""HostOffload: parameters, main grads and optimizer state to host memory and back, bit-exact.

2 gloo ranks, DP=2 with megatron's distributed optimizer (sharded Adam state), fp32 and bf16 (fp32
main params separate from the bf16 model params). After one optimizer step, every tensor is
snapshotted as raw bytes; offload must free every storage (0 bytes left: the round trip is real),
report the bytes it moved (params + grads + optimizer, checked against a count from the tensors);
onload must restore every byte; and a second training step after the round trip must give exactly
the parameters of a run that never offloaded.
"""
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed


def _raw(t):
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _train(dtype, offload_between):
    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.logprobs import vocab_parallel_log_probs
    from megatron_s3ac.models.offload import HostOffload, _inner_optimizers
    from megatron_s3ac.models.optim import build_optimizer, wrap_ddp
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.models.pipeline import forward_backward
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.models.tiny_models import tiny_config

    info = model_info(tiny_config("qwen3_moe").to_dict())
    initialize_model_parallel(ParallelLayout(), seed=3)
    torch.manual_seed(11)
    cfg = build_transformer_config(info, ParallelLayout(), dtype)
    model = build_actor(info, cfg)
    ddp = wrap_ddp(model, cfg)
    opt = build_optimizer([ddp], lr=1e-2)
    g = torch.Generator().manual_seed(100 + torch.distributed.get_rank())

    def step():
        ids = torch.randint(0, 96, (2, 10), generator=g)

        def loss(b, o):
            lp = vocab_parallel_log_probs(o, b["labels"], info.vocab_size)
            return -lp.sum(), torch.tensor(lp.numel()), {}

        ddp.zero_grad_buffer()
        opt.zero_grad()
        forward_backward([ddp], [{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}], loss)
        assert opt.step()[0]

    step()
    report = {}
    if offload_between:
        inner = _inner_optimizers(opt)
        tensors = {f"p.{n}": p for n, p in model.named_parameters()}
        tensors.update({f"g.{n}": p.main_grad for n, p in model.named_parameters()})
        for i, o in enumerate(inner):
            for j, p in enumerate(pp for gr in o.param_groups for pp in gr["params"]):
                tensors[f"m.{i}.{j}"] = p
                for k, v in o.state[p].items():
                    if torch.is_tensor(v):
                        tensors[f"s.{i}.{j}.{k}"] = v
        before = {k: _raw(v) for k, v in tensors.items()}
        expect = {}
        seen = set()
        for k, v in tensors.items():
            st = v.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                expect[k[0]] = expect.get(k[0], 0) + st.nbytes()
        h = HostOffload([ddp], opt)
        off = h.offload()
        report["freed"] = all(v.untyped_storage().nbytes() == 0 for v in tensors.values())
        report["off_bytes"], report["expect"] = off.bytes, expect
        on = h.onload()
        report["on_bytes"] = on.bytes
        report["mismatch"] = [k for k, v in tensors.items() if not torch.equal(_raw(v), before[k])]
        report["metrics"] = sorted(off.metrics("actor"))
    step()
    report["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return report


def run(dtype):
    return _train(dtype, True), _train(dtype, False)


def test_offload_round_trip_bit_exact():
    for dtype in (torch.float32, torch.bfloat16):
        for r, ref in run_distributed(run, 2, dtype):
            assert r["freed"], "offload left device storage allocated"
            assert not r["mismatch"], r["mismatch"][:5]
            e = r["expect"]  # bytes per kind: params (p, and m shares them in fp32), grads, optimizer
            assert r["off_bytes"]["params"] == e["p"] and r["off_bytes"]["grads"] == e["g"]
            assert r["off_bytes"]["optimizer"] == e.get("m", 0) + e["s"] > 0
            assert r["on_bytes"] == r["off_bytes"]
            assert "time/offload_actor_offload" in r["metrics"] and "mem/actor_params_gb" in r["metrics"]
            for n, p in ref["params"].items():
                assert torch.equal(r["params"][n], p), n  # training after the round trip is unchanged

"""Vocab-parallel log-probs / entropy over a padded vocabulary vs a plain log_softmax reference."""
import pytest
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed

V_PAD, V = 128, 96  # the last TP shard at tp=4 is padding only


def _check(temperature):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_s3ac.models.logprobs import gather_vocab, vocab_parallel_entropy, vocab_parallel_log_probs
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel

    initialize_model_parallel(ParallelLayout(tp=dist.get_world_size()), seed=0)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 5, V_PAD, generator=g) * 3
    tgt = torch.randint(0, V, (2, 5), generator=g)
    r, w = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    sl = slice(r * V_PAD // w, (r + 1) * V_PAD // w)
    loc = full[..., sl].clone().requires_grad_(True)
    lp = vocab_parallel_log_probs(loc, tgt, V, temperature)
    lp.sum().backward()
    ref_in = full.clone().requires_grad_(True)
    ref_lsm = torch.log_softmax(ref_in[..., :V] / temperature, -1)
    ref = ref_lsm.gather(-1, tgt[..., None]).squeeze(-1)
    ref.sum().backward()
    ent_ref = -(ref_lsm.exp() * ref_lsm).sum(-1).detach()
    return dict(lp=(lp.detach() - ref.detach()).abs().max().item(),
                grad=(loc.grad - ref_in.grad[..., sl]).abs().max().item(),
                ent=(vocab_parallel_entropy(loc.detach(), V, temperature) - ent_ref).abs().max().item(),
                gathered=torch.equal(gather_vocab(loc.detach(), V), full[..., :V]),
                logits_untouched=torch.equal(loc.detach(), full[..., sl]))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vocab_parallel_logprobs_match_reference(tp, temperature):
    for res in run_distributed(_check, tp, temperature):
        assert res["lp"] < 1e-5 and res["grad"] < 1e-6 and res["ent"] < 1e-5
        assert res["gathered"] and res["logits_untouched"]


def _check_chunked(temperature, dtype):
    """Chunked (3 tokens at a time, 10 tokens: a ragged last chunk) vs unchunked, values and grads."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_s3ac.models.logprobs import vocab_parallel_entropy, vocab_parallel_log_probs
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel

    initialize_model_parallel(ParallelLayout(tp=dist.get_world_size()), seed=0)
    g = torch.Generator().manual_seed(1)
    full = (torch.randn(2, 5, V_PAD, generator=g) * 3).to(dtype)
    tgt = torch.randint(0, V, (2, 5), generator=g)
    w_out = torch.randn(2, 5, generator=g)  # a non-uniform upstream gradient
    r, w = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    sl = slice(r * V_PAD // w, (r + 1) * V_PAD // w)
    res = {}
    for chunk in (None, 3):
        loc = full[..., sl].clone().requires_grad_(True)
        lp = vocab_parallel_log_probs(loc, tgt, V, temperature, chunk_tokens=chunk)
        (lp * w_out).sum().backward()
        res[chunk] = (lp.detach(), loc.grad, vocab_parallel_entropy(loc.detach(), V, temperature, chunk_tokens=chunk),
                      torch.equal(loc.detach(), full[..., sl]))
    (lp0, g0, e0, _), (lp1, g1, e1, untouched) = res[None], res[3]
    return dict(lp=(lp1 - lp0).abs().max().item(), grad=(g1.float() - g0.float()).abs().max().item(),
                ent=(e1 - e0).abs().max().item(), dtype=(lp1.dtype, g1.dtype), untouched=untouched)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_chunked_logprobs_equal_unchunked(tp):
    for temperature, dtype in ((1.0, torch.float32), (0.7, torch.float32), (1.0, torch.bfloat16)):
        for res in run_distributed(_check_chunked, tp, temperature, dtype):
            assert res["lp"] < 2e-6 and res["ent"] < 5e-6, res  # fp32 rounding of values ~1-5
            # fp32: same maths, another summation order; bf16: the gradient itself is rounded to bf16
            assert res["grad"] < (1e-6 if dtype == torch.float32 else 2e-2), res
            assert res["dtype"] == (torch.float32, dtype) and res["untouched"]

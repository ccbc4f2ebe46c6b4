"""Weight sync trainer -> CPU engine: after a sync the engine scores tokens as the (perturbed) trainer does.

The trainer loads a converted tiny HF checkpoint at TP=2 / EP=2 / PP=2 on gloo CPU ranks, perturbs its
weights (so the sync is not vacuous), and syncs into a ``CPUEngine`` that was built from the
*original* HF checkpoint. The engine's teacher-forced log-probs of a fixed token sequence must then
equal the trainer's (``vocab_parallel_log_probs``) within 1e-5 in fp32, and differ from before the sync.
"""
import pytest
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.models.tiny_models import save_tiny_hf
from weight_sync_ranks import sync_rank

TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from megatron_s3ac.convert import hf_to_mcore

    root = tmp_path_factory.mktemp("sync")
    out = {}
    for i, (name, mt) in enumerate((("qwen3", "qwen3"), ("qwen3_moe", "qwen3_moe"), ("qwen2_tied", "qwen2"))):
        hf = save_tiny_hf(mt, str(root / f"hf_{name}"), seed=10 + i)
        mc = str(root / f"mcore_{name}")
        hf_to_mcore(hf, mc, workers=1, progress=False)
        out[name] = (hf, mc)
    return out


def _check(results, engine_rank):
    trainer = next(r["trainer"] for r in results if r["trainer"] is not None)
    eng = results[engine_rank]
    before, after = eng["before"], eng["after"]
    assert after.dtype == trainer.dtype == torch.float32
    diff = (after - trainer).abs().max().item()
    assert diff < 1e-5, f"engine vs trainer log-prob diff {diff:.3e}"
    assert (before - after).abs().max().item() > 1e-2  # the perturbation reached the engine
    st = eng["stats"]
    assert st.engine_rank == engine_rank and st.buckets > 1 and st.bytes > 0
    assert all(r["after"] is None for i, r in enumerate(results) if i != engine_rank)
    return st


# (model, tp, pp, ep, engine rank, handoff): the engine on the export leader, on a non-leader of its stage
# (buckets arrive from its own stage's leader), and on stage 0 receiving stage 1 from another rank; other
# leaders hand their buckets over in shared memory (handoff) or send the bytes (relay)
CASES = {
    "tp2": ("qwen3", 2, 1, 1, 0, True),
    "ep2_engine_on_rank1": ("qwen3_moe", 1, 1, 2, 1, True),
    "pp2_tied": ("qwen2_tied", 1, 2, 1, 0, True),
    "pp2_tied_relay": ("qwen2_tied", 1, 2, 1, 0, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sync_matches_trainer_log_probs(ckpts, case):
    name, tp, pp, ep, engine_rank, handoff = CASES[case]
    hf, mc = ckpts[name]
    results = run_distributed(sync_rank, 2, hf, mc, tp, pp, ep, engine_rank, 20_000, TOKENS, handoff)
    st = _check(results, engine_rank)
    other = results[1 - engine_rank]["stats"]  # the other rank leads a stage (pp2) / the engine's stage (ep2)
    if case == "tp2":
        assert other.bytes == other.handed_bytes == 0  # its TP shards went to the engine rank inside the export
    elif handoff:  # every byte of the other leader's buckets was read in place from its shared memory
        assert other.bytes > 0 and other.handed_bytes == other.bytes
    else:
        assert other.bytes > 0 and other.handed_bytes == 0
    # every HF tensor reached the engine exactly once: the bytes of the checkpoint's weights
    from safetensors import safe_open
    import glob

    total = 0
    for f in glob.glob(f"{hf}/*.safetensors"):
        with safe_open(f, "pt") as sf:
            total += sum(sf.get_tensor(k).nbytes for k in sf.keys() if k != "lm_head.weight" or name != "qwen2_tied")
    assert st.bytes == total


def test_fp8_quantized_before_the_transfer(ckpts):
    """quantize=quantize_stream on the stage leaders (engine on rank 1: buckets are sent from rank 0) gives
    the engine exactly the weights of quantizing on the engine rank after the transfer, while the bytes
    sent are the fp8 + float32-scale pairs: per quantized matrix fp8_nbytes, other tensors unchanged."""
    from megatron_s3ac.convert.fp8 import fp8_nbytes, will_quantize
    from weight_sync_ranks import sync_fp8_rank

    hf, mc = ckpts["qwen3_moe"]
    results = run_distributed(sync_fp8_rank, 2, hf, mc, 1, 1, 2, 1, 20_000)
    eng = results[1]
    pre, post = eng["before"], eng["after"]
    assert set(pre) == set(post) and all(torch.equal(pre[n], post[n]) for n in pre)
    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine

    orig = CPUEngine.from_pretrained(hf, tokenizer=None).model.state_dict()
    assert any(not torch.equal(pre[n], orig[n]) for n in pre)  # the sync changed the engine
    sent, plain = eng["stats_before"], eng["stats_after"]
    from safetensors import safe_open
    import glob

    want = total = 0
    for f in glob.glob(f"{hf}/*.safetensors"):
        with safe_open(f, "pt") as sf:
            for k in sf.keys():
                t = sf.get_tensor(k).float()  # the actor is fp32: its export is fp32
                total += t.nbytes
                want += fp8_nbytes(t.shape) if will_quantize(k, t.shape, t.dtype) else t.nbytes
    assert plain.bytes == total and sent.bytes == want < total
    assert sent.engine_rank == 1 and sent.tensors > plain.tensors


@pytest.mark.parametrize("case", ["tp2", "ep2"])
def test_shared_memory_export_stress(ckpts, case):
    """Many syncs of changing weights with the export's shared-memory handoff of TP/EP pieces: after every one, each
    engine tensor equals (exactly) a separate export over gloo messages alone, and so does an export with the handoff.
    Buckets are small (many handoffs per sync, the segment reused for each), every other round the bucket is assembled
    outside the engine, and rank 1 passes another bucket size to sync_weights than the engine rank (the trainer's
    non-engine ranks did: with a plan per rank, the leader read a segment rank 1 no longer wrote, one step stale)."""
    from weight_sync_ranks import sync_stress_rank

    name, tp, ep = ("qwen3", 2, 1) if case == "tp2" else ("qwen3_moe", 1, 2)
    hf, mc = ckpts[name]
    # small buckets (each sync many handoffs) alternating with ones that hold the whole (tiny) model, where rank 1
    # asks for larger ones (with different small buckets the old code deadlocked rather than read stale data)
    rounds = run_distributed(sync_stress_rank, 2, hf, mc, tp, 1, ep, [(4_000, None), (1 << 22, 1 << 28)] * 4, True)[0]
    assert len(rounds) == 8
    for i, (n, bad, bad_handed) in enumerate(rounds):
        assert n > 10 and bad == [], f"round {i}: {len(bad)} of {n} engine tensors differ from the export: {bad[:5]}"
        assert bad_handed == [], f"round {i}: the handoff export differs from the gloo one in {bad_handed[:5]}"


def test_export_refuses_ranks_asking_for_different_buckets(ckpts):
    from weight_sync_ranks import export_mismatch_rank

    hf, mc = ckpts["qwen3"]
    for msg in run_distributed(export_mismatch_rank, 2, hf, mc):
        assert msg is not None and "disagree on (bucket_bytes, shm, model chunks)" in msg and "4000" in msg

"""R3 for qwen3_5_moe: the CPU engine (transformers) captures routed experts for all 8 MoE layers
(GDN and attention layers alike, by global layer index); replaying them in megatron at TP1 / TP2 (+SP) /
EP2 / PP2 (boundary inside a layer group) makes every router use exactly the engine's experts, and
the replayed log-probs equal the engine's sampling log-probs."""
import numpy as np
import pytest
import torch

from megatron_s3ac.models.parallel import ParallelLayout
from megatron_s3ac.models.gloo_ranks import run_distributed
from tests.r3 import _r3_common as C

LAYOUTS = {"tp1": (1, ParallelLayout()), "tp2_sp": (2, ParallelLayout(tp=2)), "ep2": (2, ParallelLayout(ep=2)),
           "pp2_first2": (2, ParallelLayout(pp=2, first_stage_layers=2))}


@pytest.fixture(scope="module")
def engine_samples(q35_hf):
    """4 samples of 3 prompt + 8 response tokens from the CPU engine, with routes [T-1, 8, 2]."""
    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine

    engine = CPUEngine.from_pretrained(q35_hf["vl"], tokenizer=None)
    assert engine.moe_layers == list(range(8))
    g = np.random.default_rng(3)
    prompts = [g.integers(1, 90, C.PROMPT).tolist() for _ in range(4)]
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, seed=5),
                          return_routed_experts=True)
    smp, lps = [], []
    for (s,) in out:
        tokens = np.array(s.prompt_ids + s.response_ids)
        assert s.routed_experts.shape == (len(tokens) - 1, 8, 2)
        smp.append((tokens, s.routed_experts))
        lps.append(s.logprobs)
    return smp, lps


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replay_reproduces_engine_routing(q35_hf, q35_mcore, engine_samples, name):
    from megatron_s3ac.models.registry import load_hf_config
    from tests.qwen3_5.ranks import r3_replay

    smp, engine_lps = engine_samples
    world, layout = LAYOUTS[name]
    outs = run_distributed(r3_replay, world, load_hf_config(q35_hf["vl"]), q35_mcore["vl"], layout, smp)
    assert sorted({layer for o in outs for layer in o[2]}) == list(range(8))
    assert all(o[1] > 0 for o in outs)
    lps = next(o[0] for o in outs if o[0])
    _, pls, sids = C.microbatches("padded", smp)
    diff = 0.0
    for lp, pl, ids in zip(lps, pls, sids):
        for (row, start, n), i in zip(pl, ids):
            got = lp[row, start + C.PROMPT - 1:start + n - 1]
            diff = max(diff, (got - torch.as_tensor(engine_lps[i])).abs().max().item())
    print(f"{name}: max |log-prob - engine log-prob| = {diff:.2e}")
    assert diff < 1e-4

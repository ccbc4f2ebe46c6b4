"""Partial rollout in the asynchronous loop (``rollout.partial_rollout``; trainer/step/async_partial.py): config rules,
the per-token staleness arithmetic, and a few RL steps on 2 gloo ranks with the CPU engine in its own process, its
decode slowed (testing seam S3AC_TESTING_DECODE_DELAY) so that every weight sync finds the next batch generating:
the batch is interrupted, resumed on the new weights, and trained with per-token versions within the bounds."""
import pytest

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.trainer.step.async_loop import staleness_metrics
from megatron_s3ac.trainer.step.async_partial import versions_metrics
from megatron_s3ac.config import ConfigError, load_config
from tests.trainer.test_trainer import SMALL

SEP = ["rollout.placement=separate", "actor_layout.ep=2", "train.eval_every=0"]


def test_config_rules():
    cfg = load_config(None, SMALL + SEP + ["train.max_staleness=1", "rollout.partial_rollout=true"])
    assert cfg.rollout.partial_rollout and cfg.rollout.partial_max_versions == 2
    assert not load_config(None, SMALL).rollout.partial_rollout  # default off: the loop as without it
    with pytest.raises(ConfigError, match=r"partial_rollout=true .*needs train.max_staleness >= 1"):
        load_config(None, SMALL + SEP + ["rollout.partial_rollout=true"])
    with pytest.raises(ConfigError, match=r"partial_max_versions=0 must be an integer >= 1"):
        load_config(None, SMALL + SEP + ["train.max_staleness=1", "rollout.partial_rollout=true",
                                         "rollout.partial_max_versions=0"])
    # sglang pauses (SGLangEngine through sglang.Engine's tokenizer_manager): no partial-rollout error for it, only
    # the tiny model's own (sglang needs an HF directory)
    with pytest.raises(ConfigError) as err:
        load_config(None, SMALL + SEP + ["train.max_staleness=1", "rollout.partial_rollout=true",
                                         "rollout.engine=sglang"])
    assert "partial_rollout" not in str(err.value) and "cannot serve the built-in tiny model" in str(err.value)
    # vllm pauses too (server.py: AsyncLLM.pause_generation in mode abort): no partial-rollout error for it, only
    # the tiny model's own (vLLM needs an HF directory)
    with pytest.raises(ConfigError) as err:
        load_config(None, SMALL + SEP + ["train.max_staleness=1", "rollout.partial_rollout=true",
                                         "rollout.engine=vllm"])
    assert "partial_rollout" not in str(err.value) and "tiny model" in str(err.value)


def test_vllm_pool_with_partial_rollout_is_accepted(tmp_path):
    """rollout.vllm.num_engines=2 with partial rollout loads (VLLMEnginePool pauses every engine and splits the
    continuations over them, rollout/engines/vllm/pool.py): with an HF directory vLLM can serve, the config loads
    with no error at all, and the vllm spec's cross-section rules have nothing to say about it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_s3ac.rollout.engines.registry import engine_spec

    Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                 max_position_embeddings=64)).save_pretrained(str(tmp_path))
    keys = [k for k in SMALL if not k.startswith("model.tiny=")] + [
        f"model.hf_config={tmp_path}", f"model.engine_hf_dir={tmp_path}", "rollout.placement=separate",
        "train.eval_every=0", "rollout.engine=vllm", "rollout.vllm.num_engines=2"]
    for n in (1, 2):
        cfg = load_config(None, keys + [f"train.max_staleness={n}", "rollout.partial_rollout=true"])
        assert cfg.rollout.partial_rollout and cfg.rollout.vllm.num_engines == 2 and cfg.train.max_staleness == n
        assert engine_spec("vllm").config_errors(cfg) == []
        assert engine_spec("vllm").partial_rollout


def test_token_staleness_uses_each_tokens_version():
    # step 4: a sample of 4 tokens, oldest version 2, token versions 2, 2, 3, 3 (mean 2.5), and one of 2 tokens at 4.
    # token mean (4 x 1.5 + 2 x 0) / 6 = 1.0; sample staleness by the oldest token: 2 and 0
    got = staleness_metrics([{"version": 2, "version_mean": 2.5, "rlen": 4}, {"version": 4, "rlen": 2}], 4)
    assert got == {"async/staleness_mean": 1.0, "async/staleness_sample_mean": 1.0, "async/staleness_max": 2.0,
                   "async/trained_tokens": 6.0}
    assert versions_metrics([{"n_versions": 2}, {"n_versions": 1}]) == {
        "async/versions_per_response_mean": 1.5, "async/versions_per_response_max": 2.0}
    assert versions_metrics([{"version": 1}]) == {}


def _partial_run(n, extra, out_dir, steps):
    from megatron_s3ac.trainer.step.trainer import Trainer

    tr = Trainer(load_config(None, SMALL + SEP + [f"train.max_staleness={n}", f"train.steps={steps}",
                                                  "rollout.max_new_tokens=8", "rollout.partial_rollout=true",
                                                  "algo.dynamic_sampling=false", f"train.out_dir={out_dir}"] + extra))
    try:
        return {"kind": type(tr.engine).__name__ if tr.engine is not None else None,
                "metrics": [tr.step() for _ in range(steps)]}
    finally:
        tr.close()


def check_partial_steps(ms, n, max_versions):
    """Each step's staleness, versions-per-response and interruption counts within partial rollout's bounds."""
    for s, m in enumerate(ms):
        assert m["async/staleness_max"] <= min(s, n)
        assert 0.0 <= m["async/staleness_mean"] <= m["async/staleness_max"]
        assert 1.0 <= m["async/versions_per_response_max"] <= max_versions
        assert m["async/partial_interrupted"] == (m["async/partial_resumes"] + m["async/partial_regenerated"]
                                                  + m["async/partial_unstarted"])
        assert m["rollout/aborted"] == 0  # every interrupted response was completed before it trained


@pytest.mark.slow  # ~2-5 min here: the decode delay makes each batch's generation ~8 s
def test_partial_rollout_steps_world2(tmp_path, monkeypatch):
    """N=1: a sync finds the next batch mid-generation (its decode steps take 1 s, a training step less), so its
    responses are cut and resumed on the new weights: the trained batch's token staleness lies below its sample
    staleness, responses span 2 versions, and the counts add up."""
    monkeypatch.setenv("S3AC_TESTING_DECODE_DELAY", "1.0")
    r0, r1 = run_distributed(_partial_run, 2, 1, [], str(tmp_path), 3)
    assert r0["kind"] == "RemoteEngine"
    ms = r0["metrics"]
    check_partial_steps(ms, 1, 2)
    assert sum(m["async/partial_interrupted"] for m in ms) > 0
    assert ms[-1]["async/partial_resumes_total"] == sum(m["async/partial_resumes"] for m in ms)
    # the batches trained after a resume: some tokens one version newer than the batch
    resumed = [s for s in (1, 2) if ms[s - 1]["async/partial_resumes"] > 0]
    assert resumed, [m["async/partial_interrupted"] for m in ms]
    for s in resumed:
        assert ms[s]["async/staleness_mean"] < ms[s]["async/staleness_max"] == 1.0
        assert ms[s]["async/versions_per_response_max"] == 2.0
    # every rank computes the staleness metrics from rank 0's versions
    for k in ("async/staleness_mean", "async/staleness_max", "async/versions_per_response_max"):
        assert [m[k] for m in ms] == [m[k] for m in r1["metrics"]]


@pytest.mark.slow
def test_version_bound_world2(tmp_path, monkeypatch):
    """N=2 with rollout.partial_max_versions=1: an interrupted response is never resumed, it is regenerated from its
    prompt on the new weights: one version per response, staleness still within N."""
    monkeypatch.setenv("S3AC_TESTING_DECODE_DELAY", "0.5")
    r0, _ = run_distributed(_partial_run, 2, 2, ["rollout.partial_max_versions=1"], str(tmp_path), 4)
    ms = r0["metrics"]
    check_partial_steps(ms, 2, 1)
    assert sum(m["async/partial_regenerated"] for m in ms) > 0
    assert sum(m["async/partial_resumes"] for m in ms) == 0


def test_partial_panel_is_plotted(tmp_path):
    import json

    from megatron_s3ac.trainer.run.plotting import PANELS, plot_run

    rows = [{"step": s, "async/partial_resumes": 3 * s, "async/partial_regenerated": s % 2,
             "async/versions_per_response_max": 1.0 + (s > 0)} for s in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    names = {p.rsplit("/", 1)[1] for p in plot_run(str(tmp_path))}
    assert "async_partial.png" in names
    assert len(PANELS) + 2 <= 16  # every panel (and the two value-pretraining ones) has a cell in curves.png


def test_partial_responses_round_trip_through_a_checkpoint_file(tmp_path):
    """A batch whose continuation was submitted: the checkpoint saves the merged responses with their per-token
    versions, read back by the weights-only loader."""
    import numpy as np
    import torch

    from megatron_s3ac.rollout.base import PendingGeneration, Sample
    from megatron_s3ac.rollout.partial import PartialPending, continuation_requests
    from megatron_s3ac.trainer.step import async_loop as AL
    from megatron_s3ac.trainer.run.checkpoint import safe_load

    cut = Sample([1, 2, 3], [4, 5], np.array([-0.5, -1.25], np.float32), "abort",
                 routed_experts=np.zeros((4, 2, 2), np.uint8))
    groups, reqs, _ = continuation_requests([[cut]], 3, 4, 6, max_versions=2)
    cont = Sample([1, 2, 3, 4, 5], [6, 1], np.array([-0.75, -0.1], np.float32), "stop",
                  routed_experts=np.ones((6, 2, 2), np.uint8))
    ar = AL.AsyncSource(object(), 2)
    ar.queue.append(AL.Submitted(5, torch.tensor([7]), {}, 3,
                                 PartialPending(groups, reqs, PendingGeneration(lambda: [cont]), 4)))
    torch.save({"async_rollout": AL.state_dict(ar)}, tmp_path / "trainer_state.pt")
    back = AL.AsyncSource(object(), 2)
    AL.load_state_dict(back, safe_load(str(tmp_path / "trainer_state.pt"))["async_rollout"], rank=0)
    (got,) = back.queue[0].pending.result()[0]
    assert got.response_ids == [4, 5, 6, 1] and got.token_versions.tolist() == [3, 3, 4, 4]
    assert got.logprobs.tolist() == [-0.5, -1.25, -0.75, np.float32(-0.1)] and got.finish_reason == "stop"
    assert got.routed_experts[:4].sum() == 0 and (got.routed_experts[4:] == 1).all()


def test_a_resumed_batch_is_not_scored_as_a_stream():
    """With streaming rewards on, a batch whose aborted responses were resubmitted after a sync (PartialPending:
    its ``groups`` is the list of first pieces, not a stream) is handed back merged and left unscored for
    collection (it crashed with "'list' object is not callable" in bench/bench_async.py's partial arm)."""
    import numpy as np
    import torch

    from megatron_s3ac.rollout.base import Sample
    from megatron_s3ac.rollout.partial import PartialPending
    from megatron_s3ac.trainer.step.async_loop import AsyncSource, Submitted

    ar = AsyncSource.__new__(AsyncSource)
    ar.stream, ar.eager, ar.wait_s, ar.spans, ar.log = True, False, 0.0, [], []
    groups = [[Sample(prompt_ids=[1, 2], response_ids=[3], logprobs=np.zeros(1, np.float32), finish_reason="stop")]]
    e = Submitted(3, torch.tensor([0]), {}, 1)
    e.pending = PartialPending(groups, [], None, 2)
    assert ar._result(e) == groups and e.rewards is None and e.collected

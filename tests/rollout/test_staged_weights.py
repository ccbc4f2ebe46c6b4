"""RemoteEngine(stageable=True) (``rollout.sync.overlap``): the next weights version is received into a staging copy on
the actor's staging thread while its default thread generates on the current one; the swap runs between two generate
calls. Checked: the staging really ran inside the running generate, the generate sent before the swap is exactly the
old version's (tokens and log-probs of a local engine holding it) and the one sent after is the new one's, no
generate saw a swap start or end inside it; and the config rules of the key."""
import functools
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine

from rollout_fixtures import tiny_moe_config

PROMPTS = [[4, 5, 13, 6, 7, 14], [8, 9, 14]]
MAX_NEW = 8


def _weights(seed):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_moe_config()).state_dict()


def _local(state, params):
    engine = CPUEngine.from_config(tiny_moe_config(), state_dict=state)
    return engine.generate(PROMPTS, params, n_samples=2)


def _same(got, ref):
    for g, h in zip(got, ref):
        for a, b in zip(g, h):
            assert a.response_ids == b.response_ids
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)


def test_remote_engine_stages_beside_a_running_generate():
    import ray

    from megatron_s3ac.rollout.engines.remote import RemoteEngine

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    # each decode step slowed (the testing seam) so the first generate runs ~2 s: long enough to stage beside it
    env = {"runtime_env": {"env_vars": {"S3AC_TESTING_DECODE_DELAY": "0.25", "OMP_NUM_THREADS": "1"}}}
    w1, w2 = _weights(1), _weights(2)
    factory = functools.partial(CPUEngine.from_config, tiny_moe_config(), state_dict=w1)
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, ignore_eos=True, seed=11)
    try:
        with RemoteEngine(factory, timeout_s=120, torch_threads=1, stageable=True, actor_options=env,
                          bucket_bytes=16 << 10) as remote:
            old = remote.generate_async(PROMPTS, params, n_samples=2)
            time.sleep(0.5)  # the generate has started
            remote.staging = True
            remote.update_weights(w2.items())  # several 16 KiB buckets, into the staging copy
            remote.flush_cache()  # a no-op while staging (the swap flushes)
            remote.staging = False
            staged_at = time.time()
            remote.commit_staged()
            new = remote.generate_async(PROMPTS, params, n_samples=2)
            got_old, got_new = old.result(), new.result()
            log = remote.staging_log()
            assert remote.last_update.buckets > 3
            # a second version: staged once the first swap is done (the copy is reused), swapped behind nothing
            remote.staging = True
            remote.update_weights(w1.items())
            remote.staging = False
            remote.commit_staged()
            again = remote.generate(PROMPTS, params, n_samples=2)
    finally:
        if started:
            ray.shutdown()
    gens = [x for x in log if x[0] == "generate"]
    stages = [x for x in log if x[0] == "stage"]
    commits = [x for x in log if x[0] == "commit"]
    assert len(gens) == 2 and len(commits) == 1 and len(stages) > 3
    (_, a0, a1, ca0, ca1), (_, b0, b1, cb0, cb1) = gens
    assert (ca0, ca1, cb0, cb1) == (0, 0, 1, 1)  # no generate saw a swap begin or end inside it
    assert all(a0 < s0 and s1 < a1 for _, s0, s1, _, _ in stages)  # every bucket staged while the old one generated
    assert staged_at < a1  # the trainer's side of the sync was done before the old generate ended
    assert a1 <= commits[0][1] and commits[0][2] <= b0  # the swap sits between the two generates
    _same(got_old, _local(w1, params))  # generated wholly on the old version
    _same(got_new, _local(w2, params))  # and wholly on the new one
    _same(again, _local(w1, params))


def test_overlap_config_rules():
    from megatron_s3ac.config import ConfigError, load_config
    from megatron_s3ac.rollout.engines.registry import engine_spec

    base = ["model.tiny=arithmetic_moe", "rollout.placement=separate", "rollout.sync.overlap=true"]
    assert load_config(None, base + ["train.max_staleness=1"]).rollout.sync.overlap
    assert not load_config(None, ["model.tiny=arithmetic_moe"]).rollout.sync.overlap  # default off
    with pytest.raises(ConfigError, match=r"rollout.sync.overlap=true .*needs train.max_staleness >= 1"):
        load_config(None, base)
    with pytest.raises(ConfigError, match=r"rollout.sync.overlap=true with rollout.partial_rollout=true"):
        load_config(None, base + ["train.max_staleness=2", "rollout.partial_rollout=true"])
    # one staging copy: N > 1 would make the next sync wait for the last swap behind the queued batches
    with pytest.raises(ConfigError, match=r"rollout.sync.overlap=true with train.max_staleness=2: .*one staging copy"):
        load_config(None, base + ["train.max_staleness=2"])
    # eager replacements would queue behind the batches submitted after theirs
    with pytest.raises(ConfigError, match=r"rollout.sync.overlap=true with algo.refill_eager=true"):
        load_config(None, base + ["train.max_staleness=1", "algo.dynamic_sampling_refill=true",
                                  "algo.refill_eager=true"])
    assert all(engine_spec(k).stage_weights for k in ("cpu", "hf", "vllm"))  # vllm: tests/rollout/test_vllm_staged.py
    assert not engine_spec("sglang").stage_weights  # its refusal, from the spec (no engine is started)
    with pytest.raises(ConfigError, match=r"rollout.sync.overlap=true.*rollout.engine=sglang.*cannot receive"):
        load_config(None, base + ["train.max_staleness=1", "rollout.engine=sglang"])

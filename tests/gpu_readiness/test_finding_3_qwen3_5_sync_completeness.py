"""Finding 3 (issue 24): the colocated sync's completeness check counts only what the export can send.

A published Qwen3.5 checkpoint serves a vision tower (``model.visual.*``) and an MTP head (``mtp.*``) that the
trainer never has; at 2c164be ``SGLangEngine.finish_sync`` counted every served tensor, so
``ColocatedIPCSync(require_complete=True)`` raised at the first sync. The architecture's conversion plan
(``Plan.ignorable_hf``) says which served tensors are never exported. Here: a tiny vision-language Qwen3.5
checkpoint with an MTP head added, one real colocated sync (one gloo rank) from a megatron actor of it into an
SGLangEngine started from it; the sync completes, and a tensor of the language model left unsent is still refused.
"""
import pytest
import torch

from megatron_s3ac.rollout.engines.sglang.engine import SGLangConfig, SGLangEngine, WeightUpdateError
from megatron_s3ac.testing.colocated_completeness import add_served_tensors, colocated_sync_once
from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.rollout.engines.sglang.startup_stand_in import StartupEngine
from megatron_s3ac.models.tiny_qwen3_5 import save_tiny_qwen3_5

MTP = {"mtp.fc.weight": torch.zeros(64, 128), "mtp.norm.weight": torch.ones(64),
       "mtp.layers.0.mlp.gate.weight": torch.zeros(8, 64)}


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    path = str(save_tiny_qwen3_5(str(tmp_path_factory.mktemp("qwen3_5_vl")), variant="vl"))
    add_served_tensors(path, MTP)
    return path


def test_colocated_sync_into_a_vl_checkpoint_with_mtp_completes(vl_dir):
    out = run_distributed(colocated_sync_once, 1, vl_dir)[0]
    assert out["missing"] == []
    assert out["stats"].tensors > 0
    # the served checkpoint really has the tensors the export never sends
    served = SGLangEngine(SGLangConfig(model_path=vl_dir), engine_cls=StartupEngine).served_shapes
    assert sum(n.startswith("model.visual.") for n in served) > 0 and all(n in served for n in MTP)
    assert out["served"] == len(served) > out["stats"].tensors


def test_an_unsent_language_model_tensor_is_still_refused(vl_dir):
    engine = SGLangEngine(SGLangConfig(model_path=vl_dir), engine_cls=StartupEngine)
    lm = [n for n in engine.served_shapes if not n.startswith(("model.visual.", "mtp."))]
    left_out = next(n for n in lm if n.endswith("embed_tokens.weight"))
    engine.begin_weight_update()
    with pytest.raises(WeightUpdateError, match="1 served tensors unsent"):
        engine.finish_sync([n for n in lm if n != left_out], require_complete=True)
    assert engine.last_sync["missing"] == [left_out]

"""verify: megatron (loaded from the converted checkpoint at a layout) vs transformers, fp32."""
import pytest
import torch

from checkpoints_convert import main
from megatron_s3ac.convert import hf_to_mcore
from megatron_s3ac.convert.verify import verify
from megatron_s3ac.models.tiny_models import save_tiny_hf


@pytest.mark.parametrize("name,tp,pp,ep", [
    ("qwen3_moe", 1, 1, 1), ("qwen3_moe", 2, 1, 1), ("qwen3_moe", 1, 1, 2), ("qwen3_moe", 1, 2, 1),
    ("qwen2_tied", 2, 2, 1), ("qwen2_untied", 1, 2, 1), ("qwen3", 2, 1, 1),
])
def test_verify_layouts(hf_dirs, mcore_dirs, name, tp, pp, ep):
    r = verify(hf_dirs[name], mcore_dirs[name], tp=tp, pp=pp, ep=ep)
    assert r.max_abs_diff < 1e-4, r.summary()
    assert r.top1_agreement == 1.0
    assert r.hf_logits.shape == r.mcore_logits.shape == (2, 16, 96)


def test_verify_cli_dump_and_exit_codes(hf_dirs, mcore_dirs, tmp_path, capsys):
    dump = str(tmp_path / "logits.pt")
    assert main(["verify", "--hf", hf_dirs["qwen3_moe"], "--mcore", mcore_dirs["qwen3_moe"], "--ep", "2",
                 "--dump-logits", dump]) == 0
    assert "max abs logit diff" in capsys.readouterr().out
    d = torch.load(dump, weights_only=True)
    assert (d["hf"] - d["mcore"]).abs().max() < 1e-4
    # another model with the same architecture: logits differ, verify must fail
    other = save_tiny_hf("qwen3", str(tmp_path / "other"), seed=123)
    wrong = str(tmp_path / "wrong")
    hf_to_mcore(other, wrong, progress=False)
    assert main(["verify", "--hf", hf_dirs["qwen3"], "--mcore", wrong]) == 1
